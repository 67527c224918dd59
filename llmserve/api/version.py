"""``GET /version`` and ``GET`` / ``POST /ping``, as vLLM's server has them: the server's version, and a
liveness probe (SageMaker's name for `/health`). Unauthenticated, like /health."""

from __future__ import annotations

from importlib import metadata

from django.http import HttpRequest, HttpResponse, JsonResponse

from llmserve.api import health
from llmserve.api.decorators import api_view


def _version() -> str:
    try:
        return metadata.version("llmserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


@api_view(("GET",), authenticated=False)
async def version(request: HttpRequest, principal: None) -> HttpResponse:
    return JsonResponse({"version": _version()})


@api_view(("GET", "POST"), authenticated=False)
async def ping(request: HttpRequest, principal: None) -> HttpResponse:
    return await health.check(request)
