"""Acceptance: 200 requests abandoned by their clients after 0.5 s are aborted in the engine. A normal request
then succeeds promptly, and the engine's KV blocks are all free again (read from its heartbeat)."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from inference_engine.bus.client import EngineClient

pytestmark = pytest.mark.timeout(300)


async def _abandon(port: int, key: str, body: dict, after: float) -> None:
    payload = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    await writer.drain()
    await asyncio.sleep(after)
    writer.close()  # the client gives up: daphne sees the connection go away
    await writer.wait_closed()


async def _abandon_all(port: int, key: str, model: str, count: int) -> None:
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell me a long story about {i}."}],
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        for i in range(count)
    ]
    await asyncio.gather(*(_abandon(port, key, body, 0.5) for body in bodies))


def _kv_blocks(client: EngineClient, model: str) -> tuple[int, int]:
    (info,) = [m for m in client.list_models() if m.name == model]
    return sum(r.num_free_blocks for r in info.replicas), sum(r.num_blocks for r in info.replicas)


def test_abandoned_requests_are_aborted_and_free_their_blocks(stack) -> None:
    asyncio.run(_abandon_all(stack.port, stack.api_key, stack.model, 200))

    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=60)
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    elapsed = time.monotonic() - started
    assert answer.choices[0].message.content and elapsed < 20, elapsed

    bus = EngineClient(stack.redis.url)
    try:
        deadline = time.monotonic() + 15
        while (blocks := _kv_blocks(bus, stack.model))[0] != blocks[1] and time.monotonic() < deadline:
            time.sleep(0.25)
        free, total = blocks
        assert free == total, f"{total - free} KV blocks still in use"
        assert stack.engine.poll() is None
    finally:
        bus.close()
