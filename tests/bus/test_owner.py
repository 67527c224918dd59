"""Request ownership: a client that dies (SIGKILL, no abort sent) leaves no request running in the engine; a
live client keeps its requests however slowly it reads them; a request another client attached to survives
the death of the client that submitted it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

from inference_engine.bus import protocol as P
from inference_engine.bus.client import AsyncEngineClient, EngineClient

from .conftest import MODEL, wait_idle

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
OWNER = {"owner_beat": 0.2, "owner_ttl": 1.0}


def _submitter(url: str, prefix: str) -> subprocess.Popen:
    """A process that submits one long generation, prints its id, and then only waits (to be killed)."""
    code = textwrap.dedent(
        f"""
        import time
        from inference_engine.bus.client import EngineClient
        client = EngineClient({url!r}, prefix={prefix!r}, owner_beat=0.2, owner_ttl=1.0)
        stream = client.generate({MODEL!r}, "Tell me a long story.", {LONG!r})
        print(stream.request_id, flush=True)
        time.sleep(120)
        """
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _ending(raw_redis, prefix: str, request_id: str) -> P.Message:
    (entry,) = raw_redis.xrevrange(P.Keys(prefix).output(request_id), count=1)
    return P.parse(entry[1])


def test_the_requests_of_a_killed_client_are_aborted(engine, serve, redis_server, raw_redis, prefix):
    serve()
    process = _submitter(redis_server.url, prefix)
    try:
        request_id = process.stdout.readline().strip()
        assert request_id, "the submitting process failed"
        time.sleep(0.5)
        assert engine.has_unfinished_requests()  # it runs while its client lives
        os.kill(process.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        process.kill()
        process.wait()
    wait_idle(engine, timeout=5.0)
    freed_after = time.monotonic() - killed
    final = _ending(raw_redis, prefix, request_id)
    assert isinstance(final, P.Final), final
    assert final.outputs[0]["finish_reason"] == "abort"
    assert final.usage["completion_tokens"] < LONG["max_tokens"]
    print(f"\nblocks freed {freed_after:.2f}s after the client's SIGKILL (owner TTL 1s)")


def test_a_live_client_keeps_its_request_while_it_does_not_read(serve, redis_server, prefix):
    serve()
    client = EngineClient(redis_server.url, prefix=prefix, ack_timeout=10, stream_timeout=10, **OWNER)
    try:
        stream = client.generate(MODEL, "Tell me a long story.", {**LONG, "max_tokens": 200})
        time.sleep(2.5)  # well past the owner TTL: the beat thread keeps the request alive
        result = stream.result()
    finally:
        client.close()
    assert result.outputs[0].finish_reason == "length"
    assert len(result.outputs[0].token_ids) == 200


def test_an_attached_request_outlives_the_client_that_submitted_it(engine, serve, redis_server, prefix):
    serve()
    process = _submitter(redis_server.url, prefix)

    async def adopt_and_read(request_id: str):
        client = AsyncEngineClient(redis_server.url, prefix=prefix, stream_timeout=20, **OWNER)
        try:
            stream = await client.attach(MODEL, request_id)
            os.kill(process.pid, signal.SIGKILL)
            return await stream.result()
        finally:
            await client.close()

    try:
        request_id = process.stdout.readline().strip()
        assert request_id, "the submitting process failed"
        result = asyncio.run(adopt_and_read(request_id))
    finally:
        process.kill()
        process.wait()
    assert result.outputs[0].finish_reason == "length"
    assert len(result.outputs[0].token_ids) == LONG["max_tokens"]
    wait_idle(engine)
