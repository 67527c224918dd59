"""ASGI entry point (daphne): HTTP goes to Django; WebSocket routes join the ProtocolTypeRouter here."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")

# Initialise Django (apps, settings) before anything imports models.
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import SuspiciousFileOperation  # noqa: E402
from django.http import Http404, HttpRequest, HttpResponse  # noqa: E402

from llmserve.routing import APIRouter, SameOriginValidator, websocket_urlpatterns  # noqa: E402


class StaticFilesHandler(ASGIStaticFilesHandler):
    """Django's static file handler, with a path that climbs out of the static folders (``%2e%2e/``) answered
    as the missing file it is (404) rather than an unhandled error (500)."""

    def serve(self, request: HttpRequest) -> HttpResponse:
        try:
            return super().serve(request)
        except SuspiciousFileOperation:
            raise Http404("No such static file.") from None


application = ProtocolTypeRouter(
    {
        # The standalone project has no web server in front: Django serves the static files itself.
        "http": StaticFilesHandler(APIRouter(django_asgi_app)),
        # Only our own pages may open sockets (they carry the visitor's session cookie).
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
