"""Lone UTF-16 surrogates (``"\\ud800"``: valid JSON, not text) are refused where they enter, naming the
field: a 400 on the REST API, an ``error`` message on the WebSocket (the socket stays usable). Batch API
lines are in tests/bulk. In process: the refusal comes before the bus is needed."""

from __future__ import annotations

import json

import pytest
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from hostproject.asgi import application

RAW = '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'


@pytest.mark.django_db
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", RAW, "messages[0].content"),
        ("/v1/completions", '{"model": "m", "prompt": "\\udc01"}', "prompt"),
        ("/v1/chat/completions", '{"model": "m\\ud83d", "messages": []}', "model"),
        (
            "/v1/chat/completions",
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["ok", "\\udfff"]}',
            "stop[1]",
        ),
    ],
)
async def test_the_api_refuses_a_lone_surrogate_naming_its_field(settings, path, body, param) -> None:
    settings.LLMSERVE = {"REDIS_URL": "redis://127.0.0.1:9/0", "OPEN_ACCESS": True}
    reply = await AsyncClient().post(path, body.encode(), content_type="application/json")
    assert reply.status_code == 400, reply.content
    error = json.loads(reply.content)["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"]


def test_a_paired_surrogate_escape_is_ordinary_text() -> None:
    from llmserve.api import schema

    assert schema.lone_surrogate(json.loads('{"content": "\\ud83d\\ude00", "n": [1, {"k": "v"}]}')) is None
    assert schema.lone_surrogate(json.loads('{"a": [{"b": "ok"}, {"\\ud800": 1}]}')) == "a[1].\\ud800"


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_the_websocket_answers_a_lone_surrogate_with_an_error(settings) -> None:
    settings.LLMSERVE = {"REDIS_URL": "redis://127.0.0.1:9/0", "CHAT_LOGIN_REQUIRED": False}
    ws = WebsocketCommunicator(
        application,
        "/ws/chat/",
        headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")],
        subprotocols=["llmserve.chat"],
    )
    connected, _ = await ws.connect()
    assert connected
    assert (await ws.receive_json_from(5))["type"] in ("ready", "error")
    while not await ws.receive_nothing(0.2):  # an unreachable bus: an error about the models, then ready
        await ws.receive_json_from(5)
    frame = '{"type": "chat", "id": 7, "model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    await ws.send_to(text_data=frame)
    error = await ws.receive_json_from(5)
    assert error["type"] == "error" and error["id"] == 7, error
    assert error["param"] == "messages[0].content" and error["code"] == "invalid_value", error
    await ws.send_to(text_data='{"type": "bogus"}')  # still connected, still answering
    assert (await ws.receive_json_from(5))["param"] == "type"
    await ws.disconnect()
