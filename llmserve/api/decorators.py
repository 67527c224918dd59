"""`api_view`: what every API endpoint needs before its own code runs, in one place.

Method check, body size limit, JSON parsing, API-key authentication and the rate limit; and afterwards, any
`APIError` or engine error turned into an OpenAI-style JSON response, so no path returns an HTML error page.
Where django-cors-headers is installed, its middleware's rules (the host's ``CORS_*`` settings) also apply
here: `llmserve.routing.APIRouter` serves the API without the host's middleware, so the views answer
preflight requests and add the CORS headers themselves.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from django.apps import apps
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from inference_engine.errors import EngineError
from llmserve import conf
from llmserve.api import errors
from llmserve.auth import AuthenticationFailed, Principal, RateLimited, aauthenticate, acheck_rate

log = logging.getLogger("llmserve.api")

View = Callable[..., Awaitable[HttpResponse]]


def api_view(
    methods: tuple[str, ...], *, json_body: bool = False, authenticated: bool = True
) -> Callable[[View], View]:
    """Wrap an async view as an API endpoint.

    With ``json_body`` the view is called as ``view(request, body, principal)`` with the parsed JSON object;
    otherwise as ``view(request, principal)``. Bearer-token auth is exempt from CSRF (no cookies involved).
    """

    def decorate(view: View) -> View:
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if _cors_installed():
                from corsheaders.middleware import CorsMiddleware

                async def respond(request: HttpRequest) -> HttpResponse:
                    return await handle(request, *args, **kwargs)

                return await CorsMiddleware(respond)(request)
            return await handle(request, *args, **kwargs)

        async def handle(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if request.method not in methods:
                    raise errors.MethodNotAllowed(
                        f"Method {request.method} is not allowed here; use {' or '.join(methods)}."
                    )
                principal = await _authorize(request) if authenticated else None
                if json_body:
                    body = _json_object(request)
                    if principal is not None and isinstance(body.get("model"), str):
                        principal.check_model(body["model"])  # a key limited to some models
                    return await view(request, body, principal, *args, **kwargs)
                return await view(request, principal, *args, **kwargs)
            except errors.APIError as exc:
                return _respond(exc, methods)
            except EngineError as exc:
                return _respond(errors.from_engine_error(exc), methods)
            except MultiPartParserError as exc:  # a form upload with a broken body (no boundary, ...)
                return _respond(errors.BadRequest(f"The multipart body is malformed: {exc}"), methods)
            except Exception:
                log.exception("unhandled error in %s %s", request.method, request.path)
                return _respond(errors.InternalError("The server failed to handle the request."), methods)

        wrapper.llmserve_api = True  # `llmserve.routing.APIRouter` serves it without the host's middleware
        return csrf_exempt(wrapper)

    return decorate


@functools.cache
def _cors_installed() -> bool:
    return apps.is_installed("corsheaders")


def _respond(exc: errors.APIError, methods: tuple[str, ...]) -> HttpResponse:
    response = exc.response()
    if isinstance(exc, errors.MethodNotAllowed):
        response["Allow"] = ", ".join(methods)
    return response


async def _authorize(request: HttpRequest) -> Principal:
    try:
        principal = await aauthenticate(request.headers.get("Authorization"), request.META.get("REMOTE_ADDR"))
        await acheck_rate(principal)
    except AuthenticationFailed as exc:
        raise errors.Unauthorized(str(exc)) from None
    except RateLimited as exc:
        raise errors.TooManyRequests(str(exc), retry_after=exc.retry_after) from None
    return principal


def _json_object(request: HttpRequest) -> dict[str, Any]:
    limit = conf.get("MAX_BODY_BYTES")
    declared = request.META.get("CONTENT_LENGTH")
    if declared and declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge(f"The request body exceeds {limit} bytes.")
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise errors.UnsupportedMediaType(
            f"Expected Content-Type: application/json, got {content_type or 'none'!r}."
        )
    try:
        raw = request.body
    except RequestDataTooBig:
        raise errors.PayloadTooLarge(f"The request body exceeds {limit} bytes.") from None
    if len(raw) > limit:
        raise errors.PayloadTooLarge(f"The request body exceeds {limit} bytes.")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise errors.BadRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise errors.BadRequest("The request body must be a JSON object.", code="invalid_json")
    return body
