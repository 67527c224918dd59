"""ASGI entry point (daphne): HTTP goes to Django; WebSocket routes join the ProtocolTypeRouter here."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")

# Initialise Django (apps, settings) before anything imports models.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

application = ProtocolTypeRouter({
    "http": django_asgi_app,
})
