"""ASGI routing of the app; a host project mounts it in its ASGI router:

    ProtocolTypeRouter({
        "http": APIRouter(get_asgi_application()),
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    })

``AuthMiddlewareStack`` lets the chat know logged-in users; `SameOriginValidator` keeps other sites' pages
from opening sockets with the visitor's cookies; `APIRouter` spares the API's requests the host's middleware.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponse
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, path, resolve

from llmserve.consumers import ChatConsumer

CHAT_PATH = "ws/chat/"

websocket_urlpatterns = [
    path(CHAT_PATH, ChatConsumer.as_asgi(), name="llmserve-chat-socket"),
]

_DEFAULT_PORTS = {"http": 80, "https": 443}


class APIRouter:
    """Sends each HTTP request for an API view (`llmserve.api.decorators.api_view`: the OpenAI endpoints,
    /health, /metrics, the tokenizer's) to a Django handler without middleware, and every other request to
    the host's application.

    Django runs each hook of a synchronous middleware on a thread of its own when the request is served
    asynchronously: the stock middleware of a new project costs every request a dozen trips to another
    thread and back, milliseconds of a small server's CPU while the engine computes the first token. The API
    uses none of it: its callers authenticate with bearer keys, send no cookies and are exempt from CSRF.
    A host project that wants middleware on the API too (CORS, say) mounts its application without this
    router; the API behaves the same, a little slower.
    """

    def __init__(self, application: Any) -> None:
        self.application = application
        self.api = _APIHandler()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _serves_api(scope["path"].removeprefix(scope.get("root_path", ""))):
            return await self.api(scope, receive, send)
        return await self.application(scope, receive, send)


class _APIHandler(ASGIHandler):
    """Django's ASGI handler without ``settings.MIDDLEWARE``, keeping the two of its checks that concern an
    API: a Host outside ``ALLOWED_HOSTS`` is refused (400, the host's ``handler400``), as CommonMiddleware
    refuses it, and responses carry ``X-Content-Type-Options: nosniff`` as SecurityMiddleware sets it."""

    def load_middleware(self, is_async: bool = False) -> None:
        async def checked(request: HttpRequest) -> HttpResponse:
            request.get_host()  # raises DisallowedHost
            response = await self._get_response_async(request)
            if settings.SECURE_CONTENT_TYPE_NOSNIFF:
                response.headers.setdefault("X-Content-Type-Options", "nosniff")
            return response

        self._view_middleware, self._template_response_middleware, self._exception_middleware = [], [], []
        self._middleware_chain = convert_exception_to_response(checked)


def _serves_api(path_info: str) -> bool:
    try:
        view = resolve(path_info).func
    except Resolver404:
        return False
    return getattr(view, "llmserve_api", False)


class SameOriginValidator:
    """Refuses a WebSocket handshake from a page of another origin: the ``Origin`` header must name this very
    site — the scheme (``ws`` pairs with ``http``, ``wss`` with ``https``), host and port the client
    connected to, on a host of ``ALLOWED_HOSTS`` — or an origin listed in ``CSRF_TRUSTED_ORIGINS`` (e.g. the
    public ``https://`` origin of a site behind a TLS-terminating proxy).

    A handshake without ``Origin`` does not come from a browser (browsers always send it) and passes; the
    consumer then accepts only an API key from it, never the session cookie.
    """

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers", ()))
        origin = headers.get(b"origin")
        if origin is not None and not _same_origin(origin.decode("latin-1"), scope, headers):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)


def _same_origin(origin: str, scope: dict, headers: dict[bytes, bytes]) -> bool:
    if origin in getattr(settings, "CSRF_TRUSTED_ORIGINS", ()):
        return True
    host = headers.get(b"host", b"").decode("latin-1").lower()
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if scope.get("scheme") == "wss" else "http"
    return _origin_key(origin) == _origin_key(f"{scheme}://{host}")


def _origin_key(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) with the scheme's default port filled in; None for anything malformed."""
    try:
        parts = urlsplit(url.lower())
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.scheme, parts.hostname, port
