"""``GET /openapi.json`` (the API's OpenAPI document), ``GET /docs`` (Swagger UI over it, served from the
static files of the ``drf_spectacular_sidecar`` app: no CDN), and OpenAI's JSON 404 for unknown paths under
``/v1/``. Unauthenticated: they say what the API is, not what it serves."""

from __future__ import annotations

from django.apps import apps
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from llmserve.api import errors, openapi
from llmserve.api.decorators import api_view

ALL_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


@api_view(("GET",), authenticated=False)
async def openapi_json(request: HttpRequest, principal: None) -> HttpResponse:
    return JsonResponse(openapi.document())


@require_GET
def page(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "llmserve/docs.html",
        {
            "schema_url": reverse("llmserve:openapi"),
            "swagger_ui": apps.is_installed("drf_spectacular_sidecar"),
        },
    )


@api_view(ALL_METHODS, authenticated=False)
async def not_found(request: HttpRequest, principal: None) -> HttpResponse:
    raise errors.NotFound(f"Unknown endpoint: {request.method} {request.path}.", code="unknown_url")
