"""The chat consumer in process, through the host project's whole ASGI stack (origin check, sessions,
routing), with Channels' WebsocketCommunicator and the real engine (served in a thread) on a real Redis
bus."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from hostproject.asgi import application
from llmserve.models import APIKey, ModelConfig
from tests.bus.conftest import MODEL, generate_offline, wait_idle
from tests.rate_window import early_in_a_rate_window

ORIGIN, HOST = (b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")
MESSAGES = [{"role": "user", "content": "Hi"}]
# Long enough (about 100 ms a token here) that the answer is still streaming whenever a test stops it or
# leaves; the prompt (31 tokens) plus this fits the engine's 512-token context.
LONG = 400
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture
def session_cookie(django_user_model) -> bytes:
    user = django_user_model.objects.create_user("alice", password="pw-alice-123")
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


def communicator(
    *headers: tuple[bytes, bytes], subprotocols: list[str] | None = None
) -> WebsocketCommunicator:
    return WebsocketCommunicator(
        application,
        "/ws/chat/",
        headers=[ORIGIN, HOST, *headers],
        subprotocols=subprotocols or ["llmserve.chat"],
    )


async def connected(cookie: bytes) -> WebsocketCommunicator:
    ws = communicator((b"cookie", cookie))
    ok, subprotocol = await ws.connect()
    assert ok and subprotocol == "llmserve.chat"
    ready = await ws.receive_json_from(5)
    assert ready["type"] == "ready" and [m["id"] for m in ready["models"]] == [MODEL]
    return ws


def greedy(max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}


def chat(request_id: Any = 1, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A greedy chat message that runs exactly `max_tokens` tokens (EOS ignored)."""
    return {
        "type": "chat",
        "id": request_id,
        "model": MODEL,
        "messages": MESSAGES,
        "params": greedy(max_tokens),
        **extra,
    }


async def until_idle(engine) -> None:
    """The engine holds no request any more and every KV block is back in the free pool (within 5 s)."""
    await asyncio.to_thread(wait_idle, engine)


@pytest.mark.asyncio
async def test_streams_an_answer_token_by_token(engine, serve, session_cookie) -> None:
    # What the engine itself answers to the same greedy chat, EOS allowed: the socket must stream exactly it.
    params = greedy(32, ignore_eos=False)
    expected = generate_offline(engine, engine.tokenizer.apply_chat_template(MESSAGES), params).outputs[0]
    assert expected.finish_reason == "stop" and 1 < len(expected.token_ids) < 32  # a natural end, not the cap
    serve()
    ws = await connected(session_cookie)
    await ws.send_json_to({**chat("q1"), "params": params})
    start = await ws.receive_json_from(5)
    assert start["type"] == "start" and start["id"] == "q1" and start["model"] == MODEL
    prompt_tokens = len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES)))
    assert start["prompt_tokens"] == prompt_tokens
    deltas, end = [], None
    while end is None:
        message = await ws.receive_json_from(5)
        if message["type"] == "delta":
            assert message["id"] == "q1"
            deltas.append(message["text"])
        else:
            end = message
    assert "".join(deltas) == expected.text
    # One frame per token, each carrying that token's text (the final EOS has none, so it sends no frame).
    per_token = [engine.tokenizer.decode([token]) for token in expected.token_ids]
    assert deltas == [text for text in per_token if text] and len(deltas) > 1
    completion_tokens = len(expected.token_ids)
    assert end["type"] == "end" and end["id"] == "q1" and end["finish_reason"] == "stop"
    assert end["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    assert 0 < end["ttft"] < 5 and end["tokens_per_s"] > 0
    await ws.disconnect()


@pytest.mark.asyncio
async def test_stop_mid_answer_aborts_and_the_socket_goes_on(served, session_cookie) -> None:
    ws = await connected(session_cookie)
    await ws.send_json_to(chat("long", max_tokens=LONG))
    assert (await ws.receive_json_from(5))["type"] == "start"
    assert (await ws.receive_json_from(5))["type"] == "delta"
    assert served.has_unfinished_requests()  # it is running
    await ws.send_json_to({"type": "stop"})
    while (message := await ws.receive_json_from(5))["type"] == "delta":
        pass
    assert message["type"] == "end" and message["id"] == "long" and message["finish_reason"] == "abort"
    assert 0 < message["usage"]["completion_tokens"] < LONG
    await until_idle(served)  # aborted in the engine: no request left, every KV block free
    await ws.send_json_to({"type": "stop"})  # nothing runs: harmless, no answer
    await ws.send_json_to(chat("next", max_tokens=3))
    messages = [await ws.receive_json_from(5) for _ in range(5)]
    assert [m["type"] for m in messages] == ["start", "delta", "delta", "delta", "end"]
    assert all(m["id"] == "next" for m in messages)
    assert messages[-1]["finish_reason"] == "length" and messages[-1]["usage"]["completion_tokens"] == 3
    await ws.disconnect()


@pytest.mark.asyncio
async def test_disconnect_mid_answer_aborts(served, session_cookie) -> None:
    ws = await connected(session_cookie)
    await ws.send_json_to(chat(max_tokens=LONG))
    assert (await ws.receive_json_from(5))["type"] == "start"
    assert (await ws.receive_json_from(5))["type"] == "delta"
    assert served.has_unfinished_requests()  # it is running
    await ws.disconnect()
    await until_idle(served)  # long before the LONG tokens could have run out


@pytest.mark.asyncio
async def test_one_answer_at_a_time(served, session_cookie) -> None:
    ws = await connected(session_cookie)
    await ws.send_json_to(chat(1, max_tokens=LONG))
    assert (await ws.receive_json_from(5))["type"] == "start"
    await ws.send_json_to(chat(2))
    while (message := await ws.receive_json_from(5))["type"] == "delta":
        assert message["id"] == 1
    assert message["type"] == "error" and message["code"] == "busy" and message["id"] == 2
    assert served.has_unfinished_requests()  # the first answer goes on
    await ws.disconnect()
    await until_idle(served)


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("not json", "invalid_json", None),
        ('["chat"]', "invalid_message", "type"),
        ('{"type": "dance"}', "invalid_message", "type"),
        (chat(model=""), "invalid_value", "model"),
        (chat(model="no-such-model"), "model_not_found", "model"),
        (chat(messages=[]), "invalid_value", "messages"),
        (chat(messages=[{"role": "wizard", "content": "hi"}]), "invalid_value", "messages[0].role"),
        (chat(params={"temperature": "hot"}), "invalid_type", "temperature"),
        (chat(params={"temperature": -1}), "invalid_value", "temperature"),
        (chat(params={"n": 2}), "unknown_parameter", "params.n"),
        (chat(params={"frobnicate": 1}), "unknown_parameter", "frobnicate"),
        (chat(params=[1]), "invalid_type", "params"),
    ],
)
@pytest.mark.asyncio
async def test_bad_input_gets_an_error_and_the_socket_stays_usable(
    served, session_cookie, frame, code, param
) -> None:
    ws = await connected(session_cookie)
    if isinstance(frame, dict):
        await ws.send_json_to(frame)
    else:
        await ws.send_to(text_data=frame)
    error = await ws.receive_json_from(5)
    assert error["type"] == "error" and error["code"] == code and error["param"] == param, error
    assert error["message"]
    await ws.send_to(bytes_data=b"\x00")
    assert (await ws.receive_json_from(5))["code"] == "invalid_message"
    await ws.send_json_to({"type": "models"})
    assert (await ws.receive_json_from(5))["models"][0]["id"] == MODEL
    await ws.disconnect()


@pytest.mark.parametrize(
    ("name", "enabled", "code", "words"),
    [
        (MODEL, False, "model_not_found", "is disabled"),  # served, but the admin switched it off
        ("configured-only", True, "engine_unavailable", "no engine is serving it"),
    ],
)
@pytest.mark.asyncio
async def test_the_admins_models_are_refused_as_rest_refuses_them(
    served, session_cookie, name, enabled, code, words
) -> None:
    ws = await connected(session_cookie)
    await ModelConfig.objects.acreate(name=name, enabled=enabled)
    await ws.send_json_to(chat(model=name))
    error = await ws.receive_json_from(5)
    assert error["type"] == "error" and error["id"] == 1 and error["code"] == code, error
    assert error["param"] == "model" and words in error["message"]
    await ws.send_json_to({"type": "models"})  # the socket goes on
    served_names = [m["id"] for m in (await ws.receive_json_from(5))["models"]]
    assert served_names == ([MODEL] if enabled else [])
    await ws.disconnect()
    await until_idle(served)


@pytest.mark.asyncio
async def test_login_is_required_by_default(served, settings) -> None:
    ws = communicator()
    assert (await ws.connect())[0]
    error = await ws.receive_json_from(5)
    assert error["type"] == "error" and error["code"] == "login_required"
    assert (await ws.receive_output(5)) == {"type": "websocket.close", "code": 4401}

    settings.LLMSERVE = {**settings.LLMSERVE, "CHAT_LOGIN_REQUIRED": False}
    ws = communicator()
    assert (await ws.connect())[0]
    assert (await ws.receive_json_from(5))["type"] == "ready"
    await ws.disconnect()


@pytest.mark.asyncio
async def test_api_key_as_subprotocol_or_header_and_its_rate_limit(served) -> None:
    from asgiref.sync import sync_to_async

    key, raw = await sync_to_async(APIKey.objects.create_key)("chat", rate_limit=1)
    for ws in (
        communicator(subprotocols=["llmserve.chat", f"llmserve.key.{raw}"]),
        communicator((b"authorization", f"Bearer {raw}".encode())),
    ):
        ok, subprotocol = await ws.connect()
        assert ok and subprotocol == "llmserve.chat"  # never the key
        assert (await ws.receive_json_from(5))["type"] == "ready"
        await ws.disconnect()

    early_in_a_rate_window(10)
    ws = communicator(subprotocols=["llmserve.chat", f"llmserve.key.{raw}"])
    await ws.connect()
    await ws.receive_json_from(5)
    await ws.send_json_to(chat(1, max_tokens=2))
    assert [(await ws.receive_json_from(5))["type"] for _ in range(4)] == ["start", "delta", "delta", "end"]
    await ws.send_json_to(chat(2, max_tokens=2))
    error = await ws.receive_json_from(5)
    assert error["code"] == "rate_limit_exceeded" and error["retry_after"] > 0
    await sync_to_async(key.revoke)()
    await ws.send_json_to(chat(3, max_tokens=2))
    assert (await ws.receive_json_from(5))["code"] == "invalid_api_key"
    await ws.disconnect()

    ws = communicator(subprotocols=["llmserve.chat", "llmserve.key.sk-llm-wrong"])
    await ws.connect()
    assert (await ws.receive_json_from(5))["code"] == "login_required"


async def _opens(headers: list[tuple[bytes, bytes]], subprotocols: list[str] | None = None) -> str | None:
    """The first message the socket gets (``ready``, or the error code of a refusal); None when the
    handshake itself is refused."""
    ws = WebsocketCommunicator(application, "/ws/chat/", headers=headers, subprotocols=subprotocols)
    ok, _ = await ws.connect()
    if not ok:
        return None
    first = await ws.receive_json_from(5)
    await ws.disconnect()
    return first["type"] if first["type"] == "ready" else first["code"]


@pytest.mark.asyncio
async def test_other_sites_cannot_open_the_socket(served, session_cookie, settings) -> None:
    """Same origin means the same scheme, host and port as the socket itself: another port of an allowed host
    (any local page) or the other scheme is another site."""
    cookie, host = (b"cookie", session_cookie), (b"host", b"127.0.0.1:8000")
    for foreign in (b"https://evil.example", b"http://127.0.0.1:9999", b"https://127.0.0.1:8000", b"null"):
        assert await _opens([(b"origin", foreign), host, cookie]) is None, foreign
    assert await _opens([(b"origin", b"http://127.0.0.1:8000"), host, cookie]) == "ready"
    localhost = [(b"origin", b"http://localhost:8000"), (b"host", b"localhost:8000"), cookie]
    assert await _opens(localhost) == "ready"
    # Behind a TLS proxy the page's origin differs from what the server sees: trusted by configuration.
    settings.CSRF_TRUSTED_ORIGINS = ["https://chat.example.com"]
    assert await _opens([(b"origin", b"https://chat.example.com"), host, cookie]) == "ready"
    # A Host outside ALLOWED_HOSTS is refused even when Origin matches it.
    assert await _opens([(b"origin", b"http://evil.example"), (b"host", b"evil.example"), cookie]) is None


@pytest.mark.asyncio
async def test_programs_without_origin_need_an_api_key(served, session_cookie) -> None:
    """No Origin: not a browser. An API key lets it in; a session cookie does not (browsers always send
    Origin, so a cookie without one is not a page of ours)."""
    from asgiref.sync import sync_to_async

    _, raw = await sync_to_async(APIKey.objects.create_key)("program")
    assert await _opens([HOST], ["llmserve.chat", f"llmserve.key.{raw}"]) == "ready"
    assert await _opens([HOST, (b"authorization", f"Bearer {raw}".encode())]) == "ready"
    assert await _opens([HOST, (b"cookie", session_cookie)]) == "login_required"
    assert await _opens([HOST]) == "login_required"


def test_chat_page(client, django_user_model) -> None:
    response = client.get("/chat/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/?next=/chat/")
    client.force_login(django_user_model.objects.create_user("bob", password="pw-bob-123"))
    page = client.get("/chat/").content.decode()
    assert '"socket_path": "/ws/chat/"' in page and "llmserve/chat.js" in page and "llmserve/chat.css" in page
