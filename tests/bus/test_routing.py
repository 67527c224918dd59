"""Prefix-aware routing (`inference_engine.bus.routing`): the digests and the policy on their own, then two
real engine processes behind a real redis-server. The SIGKILL test runs last because it kills one replica."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference_engine.bus import protocol as P
from inference_engine.bus import routing
from inference_engine.bus.client import AsyncEngineClient, EngineClient
from inference_engine.errors import EngineUnavailableError

from . import engines

MODEL = "smol"
SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 12}
GREEDY = {"max_tokens": 4, "temperature": 0.0}
HEARTBEAT_TTL = 1.5  # engines.TEST_FLAGS

_decisions: list[tuple[str, str]] = []
routing.on_route(lambda model, policy: _decisions.append((model, policy)))


def _chat(*turns: str) -> P.Generate:
    messages = [SYSTEM]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return P.Generate(id="x", params={}, messages=messages)


def test_digests_chain_over_the_conversation_and_are_deterministic_across_processes():
    first, second = routing.prefix_digests(_chat("hi")), routing.prefix_digests(_chat("hi", "hello", "more"))
    assert len(first) == 2 and len(second) == 4
    assert second[:2] == first  # the next turn starts with the same chain
    assert routing.prefix_digests(_chat("ho"))[0] == first[0] != routing.prefix_digests(_chat("ho"))[1]
    text = P.Generate(id="x", params={}, prompt="a" * 600)
    assert [c for _, c in routing.prefix_digests(text)] == [256, 512]  # full chunks only
    code = (
        "from inference_engine.bus import protocol as P, routing;"
        "print(routing.prefix_digests(P.Generate(id='x', params={}, prompt='a' * 600))[1][0])"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == routing.prefix_digests(text)[1][0]


def test_policy_prefers_the_longest_prefix_within_the_load_margin():
    loads = {"a": 5, "b": 1}
    assert routing.choose(loads, {"a": 300, "b": 0}, margin=4) == routing.Decision(routing.PREFIX, "a", 300)
    assert routing.choose(loads, {"a": 300, "b": 0}, margin=3) == routing.Decision(routing.LEAST_LOADED, "b")
    assert routing.choose(loads, {"a": 0, "b": 0}, margin=4).policy == routing.LEAST_LOADED
    assert routing.choose({"a": 0}, {"a": 300}, margin=4) == routing.Decision(routing.SHARED)
    # Several replicas hold the same prefix: the less loaded one.
    assert routing.choose({"a": 3, "b": 2}, {"a": 9, "b": 9}, margin=4).replica == "b"


@pytest.fixture(scope="module")
def prefix() -> str:
    return "routing"


@pytest.fixture(scope="module")
def replicas(redis_server, prefix) -> Iterator[list]:
    with engines.live_replicas(
        redis_server.url, prefix, MODEL, 2, "--max-num-seqs", "8", "--max-inflight", "3"
    ) as procs:
        yield procs


def _client(url: str, prefix: str, margin: int) -> EngineClient:
    return EngineClient(url, prefix=prefix, ack_timeout=60, stream_timeout=30, routing_load_margin=margin)


def _acked_by(client: EngineClient, request_id: str) -> list[str]:
    entries = [P.decode(f) for _, f in client.redis.xrange(client.keys.output(request_id))]
    return [e["replica"] for e in entries if e["type"] == P.ACK]


def _run_chat(client: EngineClient, message: P.Generate, params: dict, request_id: str) -> str:
    """Runs a chat turn to its end; the replica that served it."""
    client.generate(MODEL, messages=message.messages, params=params, request_id=request_id).result()
    return _acked_by(client, request_id)[0]


def _wait_summary(client: EngineClient, replica: str, message: P.Generate) -> None:
    """Until the replica published the request's prefix (at most every `summary_interval`)."""
    digest = routing.prefix_digests(message)[-1][0]
    deadline = time.monotonic() + 5
    while client.redis.zscore(routing.summary_key(client.keys, replica), digest) is None:
        assert time.monotonic() < deadline, "the replica never published the prefix it served"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_next_turn_goes_to_the_replica_that_served_the_first(redis_server, prefix, replicas):
    client = _client(redis_server.url, prefix, margin=4)
    try:
        for conversation in range(3):
            first = _chat(f"Conversation {conversation}: name a colour.")
            served = _run_chat(client, first, GREEDY, f"turn1-{conversation}")
            _wait_summary(client, served, first)
            _decisions.clear()
            second = _chat(f"Conversation {conversation}: name a colour.", "Blue.", "And another?")
            assert _run_chat(client, second, GREEDY, f"turn2-{conversation}") == served
            assert _decisions == [(MODEL, routing.PREFIX)]
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_the_async_client_routes_the_same_way(redis_server, prefix, replicas):
    """The web tier's client: the same routing, run on redis.asyncio."""
    client = _client(redis_server.url, prefix, margin=4)
    first = _chat("Async conversation: name a fruit.")
    second = _chat("Async conversation: name a fruit.", "Apple.", "And another?")

    async def turn(message: P.Generate, request_id: str) -> None:
        aclient = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=60, stream_timeout=30)
        try:
            stream = await aclient.generate(
                MODEL, messages=message.messages, params=GREEDY, request_id=request_id
            )
            async for _ in stream:
                pass
        finally:
            await aclient.close()

    try:
        asyncio.run(turn(first, "async-1"))
        served = _acked_by(client, "async-1")[0]
        _wait_summary(client, served, first)
        _decisions.clear()
        asyncio.run(turn(second, "async-2"))
        assert _acked_by(client, "async-2") == [served]
        assert _decisions == [(MODEL, routing.PREFIX)]
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_a_busy_prefix_replica_loses_to_the_least_loaded_one(redis_server, prefix, replicas):
    client = _client(redis_server.url, prefix, margin=1)
    long = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    streams = []
    try:
        first = _chat("Busy conversation: say hello.")
        served = _run_chat(client, first, GREEDY, "busy-0")
        _wait_summary(client, served, first)
        _decisions.clear()
        for i in range(3):  # loads 0 and 1 are within the margin of the idle replica's 0; load 2 is not
            message = _chat("Busy conversation: say hello.", "Hello.", f"Count to {i + 100}.")
            stream = client.generate(
                MODEL, messages=message.messages, params=long, request_id=f"busy-{i + 1}"
            )
            streams.append(stream)
        assert [policy for _, policy in _decisions] == [routing.PREFIX, routing.PREFIX, routing.LEAST_LOADED]
        assert [_acked_by(client, s.request_id)[0] == served for s in streams] == [True, True, False]
    finally:
        for stream in streams:
            stream.abort()
        client.close()


@pytest.mark.timeout(300)
def test_sigkill_a_replica_with_routed_requests_queued(redis_server, prefix, replicas):
    """Everything routed to the killed replica ends exactly once: what it had not started completes on the
    survivor, what it had started is re-run or failed cleanly; its summary vanishes with its heartbeat."""
    client = _client(redis_server.url, prefix, margin=100)  # every turn of the conversation to one replica
    try:
        first = _chat("Doomed conversation: count.")
        victim = _run_chat(client, first, GREEDY, "doomed-0")
        _wait_summary(client, victim, first)
        params = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}

        def run(i: int) -> tuple[str, object]:
            message = _chat("Doomed conversation: count.", "1 2 3", f"Continue from {i}.")
            try:
                stream = client.generate(
                    MODEL, messages=message.messages, params=params, request_id=f"doomed-{i}"
                )
                return stream.request_id, stream.result()
            except EngineUnavailableError as exc:
                return f"doomed-{i}", exc

        routed = routing.routed_stream(client.keys, MODEL, victim)
        with ThreadPoolExecutor(8) as pool:
            # 3 run on the victim (--max-inflight), 5 wait on its stream
            futures = [pool.submit(run, i) for i in range(1, 9)]
            deadline = time.monotonic() + 30
            while client.redis.xlen(routed) < 8:
                assert time.monotonic() < deadline, "the requests were not all routed to one replica"
                time.sleep(0.01)
            pid = int(victim.split("-")[-2])
            next(p for p in replicas if p.pid == pid).kill()
            killed_at = time.monotonic()
            outcomes = [f.result(timeout=120) for f in futures]
        survivor = next(r for r in client.live_replicas(MODEL) if r != victim)
        completed = 0
        for request_id, outcome in outcomes:
            acks = _acked_by(client, request_id)
            if isinstance(outcome, Exception):  # the victim had streamed part of it
                assert acks[0] == victim
            else:
                completed += 1
                assert outcome.usage.completion_tokens == 64
                assert acks[-1] == survivor or acks == [victim]
        assert completed >= 5, "the requests queued on the dead replica's stream were not taken over"
        keys = [routing.summary_key(client.keys, victim), routing.load_key(client.keys, victim)]
        while client.redis.exists(*keys):
            assert time.monotonic() - killed_at < HEARTBEAT_TTL + 0.5, (
                "the dead replica's summary outlived it"
            )
            time.sleep(0.05)
    finally:
        client.close()
