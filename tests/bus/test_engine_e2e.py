"""The acceptance tests of the bus: a real redis-server and real engine processes (SmolLM2-135M on CPU).

One module-scoped pair of replicas serves every test; the SIGKILL test runs last because it kills one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference_engine.bus import protocol as P
from inference_engine.bus.client import AsyncEngineClient, EngineClient
from inference_engine.errors import EngineUnavailableError, ModelNotFoundError
from inference_engine.sampling_params import SamplingParams

from . import engines

pytestmark = pytest.mark.timeout(300)

MODEL = "smol"
PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]


@pytest.fixture(scope="module")
def prefix() -> str:
    return "e2e"


@pytest.fixture(scope="module")
def replicas(redis_server, prefix) -> Iterator[list]:
    with engines.live_replicas(
        redis_server.url, prefix, MODEL, 2, "--max-num-seqs", "16", "--max-inflight", "8"
    ) as procs:
        yield procs


@pytest.fixture
def client(redis_server, prefix, replicas) -> Iterator[EngineClient]:
    c = EngineClient(redis_server.url, prefix=prefix, ack_timeout=60, stream_timeout=30, poll_interval=0.5)
    yield c
    c.close()


def _replicas_of(client: EngineClient, request_id: str) -> list[str]:
    entries = [P.decode(f) for _, f in client.redis.xrange(client.keys.output(request_id))]
    return [e["replica"] for e in entries if e["type"] == P.DELTA]


def test_streaming_equals_offline_greedy(client):
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def run(prompt: str):
        stream = client.generate(MODEL, prompt, params)
        tokens = [t for d in stream for o in d.outputs for t in o.token_ids]
        return stream.request_id, tokens

    with ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(run, PROMPTS))
    # Both replicas took part in the burst (each takes at most 8 at once).
    assert len({r for rid, _ in streamed for r in _replicas_of(client, rid)}) == 2

    import torch

    from inference_engine.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 * 2**20)
    offline = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [tokens for _, tokens in streamed] == [o.outputs[0].token_ids for o in offline]


def _blocks(client: EngineClient) -> list[tuple[int, int]]:
    [model] = [m for m in client.list_models() if m.name == MODEL]
    return [(r.num_free_blocks, r.num_blocks) for r in model.replicas]


def test_cancel_after_first_delta_frees_every_block(redis_server, prefix, client):
    async def cancel_one(aclient: AsyncEngineClient, i: int) -> None:
        stream = await aclient.generate(MODEL, f"Tell me a long story about dragon {i}.", {"max_tokens": 200})
        async with stream:
            async for _ in stream:
                break

    async def main() -> None:
        aclient = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=60, stream_timeout=30)
        try:
            await asyncio.gather(*(cancel_one(aclient, i) for i in range(50)))
        finally:
            await aclient.close()

    asyncio.run(main())
    deadline = time.monotonic() + 1.0
    while any(free != total for free, total in _blocks(client)):
        assert time.monotonic() < deadline, f"KV blocks still in use: {_blocks(client)}"
        time.sleep(0.05)
    result = client.generate(MODEL, "Say hello.", {"max_tokens": 8, "temperature": 0}).result()
    assert result.outputs[0].finish_reason in ("length", "stop") and result.usage.completion_tokens > 0


def test_hot_load_and_unload_a_second_model(redis_server, prefix, client):
    supervisor = engines.start(redis_server.url, prefix, "supervise", "--name", "sup")
    try:
        with pytest.raises(EngineUnavailableError, match="supervisor"):
            client.load_model("smol-b", supervisor="nobody")
        deadline = time.monotonic() + 30
        while not client.redis.exists(client.keys.supervisor("sup")):
            assert supervisor.poll() is None and time.monotonic() < deadline, "supervisor did not start"
            time.sleep(0.1)
        client.load_model(
            "smol-b",
            engine_args={"max_num_seqs": 4, "kv_cache_memory_bytes": 64 * 2**20},
            supervisor="sup",
            timeout=120,
        )
        assert {m.name for m in client.list_models()} == {MODEL, "smol-b"}
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(
                lambda m: client.generate(m, "Hi!", {"max_tokens": 6, "temperature": 0}).result(),
                [MODEL, "smol-b"],
            )
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # same weights, same greedy answer
        client.unload_model("smol-b", supervisor="sup", timeout=60)
        with pytest.raises(ModelNotFoundError):
            client.generate("smol-b", "Hi!")
        assert client.generate(MODEL, "Hi!", {"max_tokens": 2}).result().usage.completion_tokens == 2
    finally:
        engines.stop(supervisor)


def test_sigkill_one_replica_mid_burst(client, replicas):
    params = {"max_tokens": 24, "temperature": 0.0}

    def run(i: int):
        try:
            stream = client.generate(MODEL, f"Count from {i} upwards:", params, request_id=f"kill-{i}")
            return stream.request_id, stream.result()
        except EngineUnavailableError as exc:
            return None, exc

    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, i) for i in range(16)]
        time.sleep(1.0)  # both replicas are mid-batch
        seconds, micros = client.redis.time()
        killed_ms = seconds * 1000 + micros // 1000
        replicas[1].kill()
        results = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - start < 120
    completed = [(rid, r) for rid, r in results if rid is not None]
    failed = [r for rid, r in results if rid is None] + [
        r for rid, r in completed if r.outputs[0].finish_reason is None
    ]
    assert all(isinstance(r, EngineUnavailableError) for r in failed if isinstance(r, Exception))
    for rid, result in completed:
        assert len(set(_replicas_of(client, rid))) == 1, "a request ran on two replicas"
        assert result.usage.completion_tokens == len(result.outputs[0].token_ids)
    assert completed, "the surviving replica should have completed some requests"
    # Who took each request from the stream before the kill: its first ACK then. (After it the survivor also
    # takes what the killed replica had read, as its own requests end: not a breach of the bound.)
    first_acks = [
        next(
            (
                P.decode(f)
                for entry_id, f in client.redis.xrange(client.keys.output(f"kill-{i}"))
                if P.decode(f)["type"] == P.ACK and int(entry_id.split("-")[0]) < killed_ms
            ),
            None,
        )
        for i in range(16)
    ]
    per_replica = [a["replica"] for a in first_acks if a is not None]
    assert len(set(per_replica)) == 2, "the killed replica had no request in flight"
    assert max(per_replica.count(r) for r in set(per_replica)) <= 8, "a replica took more than --max-inflight"
