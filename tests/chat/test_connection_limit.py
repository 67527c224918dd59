"""Per-caller WebSocket connection limits, counted in the bus's Redis (so they hold across web workers): the
connection past ``WS_CONNECTIONS_PER_KEY`` is told why and closed with 4429; closing one frees its slot."""

from __future__ import annotations

import uuid

import pytest
from channels.testing import WebsocketCommunicator

from hostproject.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def _socket() -> WebsocketCommunicator:
    return WebsocketCommunicator(
        application,
        "/ws/chat/",
        headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")],
        subprotocols=["llmserve.chat"],
    )


async def _ready(ws: WebsocketCommunicator) -> None:
    connected, _ = await ws.connect()
    assert connected
    message = await ws.receive_json_from(5)
    assert message["type"] == "ready", message


@pytest.mark.asyncio
async def test_the_connection_past_the_limit_is_refused(settings, redis_server) -> None:
    settings.LLMSERVE = {
        "REDIS_URL": redis_server.url,
        "BUS_PREFIX": f"t{uuid.uuid4().hex[:8]}",
        "CHAT_LOGIN_REQUIRED": False,
        "WS_CONNECTIONS_PER_KEY": 2,
    }
    first, second, third = _socket(), _socket(), _socket()
    await _ready(first)
    await _ready(second)
    connected, _ = await third.connect()
    assert connected  # accepted, so that the refusal can say why
    error = await third.receive_json_from(5)
    assert error["type"] == "error" and error["code"] == "too_many_connections", error
    assert await third.receive_output(5) == {"type": "websocket.close", "code": 4429}
    await first.disconnect()  # its slot is free again
    fourth = _socket()
    await _ready(fourth)
    for ws in (second, fourth):
        await ws.disconnect()
