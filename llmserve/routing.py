"""WebSocket routes of the app; a host project mounts them in its ASGI router:

    SameOriginValidator(AuthMiddlewareStack(URLRouter(llmserve.routing.websocket_urlpatterns)))

``AuthMiddlewareStack`` lets the chat know logged-in users; `SameOriginValidator` keeps other sites' pages
from opening sockets with the visitor's cookies.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from django.urls import path

from llmserve.consumers import ChatConsumer

CHAT_PATH = "ws/chat/"

websocket_urlpatterns = [
    path(CHAT_PATH, ChatConsumer.as_asgi(), name="llmserve-chat-socket"),
]

_DEFAULT_PORTS = {"http": 80, "https": 443}


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
