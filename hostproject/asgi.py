"""ASGI entry point (daphne): HTTP goes to Django; WebSocket routes join the ProtocolTypeRouter here."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")

# Initialise Django (apps, settings) before anything imports models.
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from llmserve.routing import SameOriginValidator, websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The standalone project has no web server in front: Django serves the static files itself.
        "http": ASGIStaticFilesHandler(django_asgi_app),
        # Only our own pages may open sockets (they carry the visitor's session cookie).
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
