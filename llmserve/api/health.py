"""``GET /health``: 200 while the bus answers, with each served model's live replica count; 503 otherwise.

Unauthenticated on purpose: load balancers and orchestrators probe it without a key.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from inference_engine.errors import EngineError
from llmserve import bus
from llmserve.api.decorators import api_view


@api_view(("GET",), authenticated=False)
async def health(request: HttpRequest, principal: None) -> HttpResponse:
    try:
        models = await bus.async_client().list_models()
    except EngineError as exc:
        return JsonResponse({"status": "unavailable", "detail": str(exc)}, status=503)
    return JsonResponse({"status": "ok", "models": {m.name: {"replicas": len(m.replicas)} for m in models}})
