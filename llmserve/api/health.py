"""``GET /health``: 200 when some live engine replica can serve, with each served model's replica count; 503
with the reason otherwise (the bus is unreachable, or no replica is alive). ``GET /health?model=NAME``
answers for that one model.

Unauthenticated on purpose: load balancers and orchestrators probe it without a key. A replica counts as live
while its heartbeat key exists; a supervisor withdraws the heartbeat of an engine process that died at once.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from inference_engine.errors import EngineError
from llmserve import bus
from llmserve.api.decorators import api_view


@api_view(("GET",), authenticated=False)
async def health(request: HttpRequest, principal: None) -> HttpResponse:
    return await check(request)


async def check(request: HttpRequest) -> HttpResponse:
    """The answer of /health (and of vLLM's /ping)."""
    wanted = request.GET.get("model")
    try:
        models = {m.name: {"replicas": len(m.replicas)} for m in await bus.async_client().list_models()}
    except EngineError:
        return _unavailable("the request bus (Redis) does not answer.", {})
    if wanted is not None:
        if wanted not in models:
            return _unavailable(f"no live engine replica serves the model `{wanted}`.", models)
        return JsonResponse({"status": "ok", "model": wanted, **models[wanted]})
    if not models:
        return _unavailable("no live engine replica serves any model.", models)
    return JsonResponse({"status": "ok", "models": models})


def _unavailable(detail: str, models: dict) -> JsonResponse:
    return JsonResponse({"status": "unavailable", "detail": detail, "models": models}, status=503)
