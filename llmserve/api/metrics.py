"""``GET /metrics``: Prometheus text; unauthenticated like /health, for scrapers on the private network."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST

from inference_engine.errors import EngineError
from llmserve import bus
from llmserve import metrics as registry
from llmserve.api.decorators import api_view


@api_view(("GET",), authenticated=False)
async def metrics(request: HttpRequest, principal: None) -> HttpResponse:
    try:
        models = await bus.async_client().list_models()
    except EngineError:
        models = []  # the web-side metrics are still worth scraping
    return HttpResponse(registry.render(models), content_type=CONTENT_TYPE_LATEST)
