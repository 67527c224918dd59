"""The chat flows against a real daphne serving the host project, with the bundled model in an engine process:
streamed answer, stop mid-answer and disconnect mid-answer — after which every KV block is free again."""

from __future__ import annotations

import asyncio
import time

import pytest

from inference_engine.bus.client import EngineClient

from .wsclient import ChatSocket, HandshakeRefused

pytestmark = pytest.mark.timeout(180)

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


async def open_chat(stack, origin: str | None = None) -> ChatSocket:
    ws = await ChatSocket.open(
        stack.base_url.replace("http", "ws") + "/ws/chat/",
        origin=origin or stack.base_url,
        protocols=["llmserve.chat", f"llmserve.key.{stack.api_key}"],
    )
    assert ws.subprotocol == "llmserve.chat"
    ready = await ws.receive()
    assert ready["type"] == "ready" and stack.model in [m["id"] for m in ready["models"]]
    return ws


def ask(ws: ChatSocket, stack, request_id: int, params: dict, text: str = "Tell me about the sea.") -> None:
    ws.send(
        {
            "type": "chat",
            "id": request_id,
            "model": stack.model,
            "messages": [{"role": "user", "content": text}],
            "params": params,
        }
    )


async def all_blocks_free(stack, timeout: float = 10) -> None:
    """Every replica's heartbeat reports its whole KV cache free (the aborted request's blocks came back)."""
    client = EngineClient(stack.redis.url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            replicas = [r for m in client.list_models() if m.name == stack.model for r in m.replicas]
            if replicas and all(r.num_free_blocks == r.num_blocks for r in replicas):
                return
            assert time.monotonic() < deadline, [(r.num_free_blocks, r.num_blocks) for r in replicas]
            await asyncio.sleep(0.25)
    finally:
        client.close()


async def first_deltas(ws: ChatSocket, count: int) -> str:
    start = await ws.receive()
    assert start["type"] == "start" and start["prompt_tokens"] > 0, start
    text = ""
    for _ in range(count):
        delta = await ws.receive()
        assert delta["type"] == "delta", delta
        text += delta["text"]
    return text


@pytest.mark.asyncio
async def test_streamed_answer(stack) -> None:
    ws = await open_chat(stack)
    ask(ws, stack, 1, {"temperature": 0, "max_tokens": 12}, "What is the capital of France?")
    text = await first_deltas(ws, 2)
    while (message := await ws.receive())["type"] == "delta":
        text += message["text"]
    assert message["type"] == "end" and message["finish_reason"] in ("stop", "length"), message
    assert 0 < message["usage"]["completion_tokens"] <= 12 and message["ttft"] > 0
    assert "Paris" in text
    ws.close()


@pytest.mark.asyncio
async def test_stop_mid_answer_frees_the_kv_cache(stack) -> None:
    ws = await open_chat(stack)
    ask(ws, stack, 1, LONG)
    await first_deltas(ws, 3)
    ws.send({"type": "stop"})
    while (message := await ws.receive())["type"] == "delta":
        pass
    assert message["type"] == "end" and message["finish_reason"] == "abort"
    assert message["usage"]["completion_tokens"] < 400
    await all_blocks_free(stack)
    ask(ws, stack, 2, {"temperature": 0, "max_tokens": 4}, "Hi")  # the socket goes on
    await first_deltas(ws, 1)
    while (message := await ws.receive())["type"] == "delta":
        pass
    assert message["type"] == "end" and message["id"] == 2
    ws.close()


@pytest.mark.asyncio
async def test_disconnect_mid_answer_frees_the_kv_cache(stack) -> None:
    ws = await open_chat(stack)
    ask(ws, stack, 1, LONG)
    await first_deltas(ws, 3)
    ws.drop()  # no close frame: the TCP connection just goes away
    await all_blocks_free(stack)


@pytest.mark.asyncio
async def test_foreign_origin_is_refused(stack) -> None:
    with pytest.raises(HandshakeRefused):
        await open_chat(stack, origin="https://evil.example")


def test_static_files_are_served(stack) -> None:
    import urllib.request

    with urllib.request.urlopen(stack.base_url + "/static/llmserve/chat.js", timeout=10) as reply:
        assert b"renderMarkdown" in reply.read()
