"""WebSocket routes of the app; a host project mounts them in its ASGI router:

    URLRouter(llmserve.routing.websocket_urlpatterns)

wrapped in ``AuthMiddlewareStack`` (the chat knows logged-in users) and ``AllowedHostsOriginValidator`` (other
sites' pages must not open sockets with the visitor's cookies).
"""

from django.urls import path

from llmserve.consumers import ChatConsumer

CHAT_PATH = "ws/chat/"

websocket_urlpatterns = [
    path(CHAT_PATH, ChatConsumer.as_asgi(), name="llmserve-chat-socket"),
]
