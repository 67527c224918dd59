"""Loading and unloading LoRA adapters at run time over the bus (issue 59; vLLM's /v1/load_lora_adapter):
two replicas of one model, each its own engine served in a thread over a real redis-server, get every update;
a replica that starts later loads what was loaded before it; bad adapters are refused with the reason while
both keep serving; an unloaded adapter's running request finishes with the adapter's tokens and new requests
for it are refused as an unknown model. About 25 s: -m slow (tests/web/test_lora_api.py has the same through
the API on one replica in the default run)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference_engine.bus import protocol as P
from inference_engine.bus.redis_server import RedisServer
from inference_engine.bus.server import EngineServer, ServeSettings
from inference_engine.bus.sync_client import EngineClient
from inference_engine.config import EngineConfig
from inference_engine.errors import InvalidRequestError, ModelNotFoundError
from inference_engine.llm_engine import LLMEngine

from .quant_checkpoints import dense_folder
from .test_lora import ADAPTERS, write_adapter

MODEL, PREFIX = "smol", "lora-runtime"
PARAMS = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
PROMPT = "The three most useful things to pack for a long hike are"


class Replica:
    """An `EngineServer` over its own LoRA-enabled engine, in a thread of the test process."""

    def __init__(self, engine: LLMEngine, url: str) -> None:
        settings = ServeSettings(prefix=PREFIX, heartbeat_interval=0.2, heartbeat_ttl=1.0, idle_block=0.05)
        self.engine, self.server = engine, EngineServer(engine, url, MODEL, settings)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


def lora_engine() -> LLMEngine:
    config = EngineConfig(
        model=str(dense_folder()),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=32 * 2**20,
        enable_lora=True,
        max_lora_rank=16,
        log_stats_interval=0,
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def bus() -> Iterator[tuple[RedisServer, list[LLMEngine]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with RedisServer().start() as server:
            yield server, [lora_engine(), lora_engine()]
    finally:
        torch.set_num_threads(threads)


def adapters_served(client: EngineClient) -> list[list[str]]:
    """Each live replica's adapters, as its heartbeat lists them."""
    return [sorted(r.data["lora_modules"]) for m in client.list_models() for r in m.replicas]


def wait_replicas(client: EngineClient, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(client.live_replicas(MODEL)) != count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_updates_reach_every_replica_and_unload_lets_running_requests_finish(bus, tmp_path: Path):
    redis_server, (first_engine, second_engine) = bus
    good = write_adapter(tmp_path / "good", *ADAPTERS["qv-r4"], seed=5)
    too_big = write_adapter(tmp_path / "big", 32, 32, ["q_proj"], {}, seed=6)
    client = EngineClient(redis_server.url, prefix=PREFIX, ack_timeout=10, stream_timeout=10)
    replicas = [Replica(first_engine, redis_server.url), Replica(second_engine, redis_server.url)]
    try:
        wait_replicas(client, 2)
        base = client.generate(MODEL, PROMPT, PARAMS).result().outputs[0].token_ids
        assert client.load_lora_adapter(MODEL, "tuned", str(good)) == 2
        assert adapters_served(client) == [["tuned"], ["tuned"]]
        assert client.load_lora_adapter(MODEL, "tuned", str(good)) == 2  # the same again: nothing to do

        other = write_adapter(tmp_path / "other", *ADAPTERS["qv-r4"], seed=7)
        for name, path, reason in [
            ("broken", too_big, "has rank 32, above max_lora_rank 16"),
            ("broken", tmp_path / "missing", "no such folder"),
            ("tuned", other, "has already been loaded"),  # the name is taken
        ]:
            with pytest.raises(InvalidRequestError, match=reason):
                client.load_lora_adapter(MODEL, name, str(path))
        assert adapters_served(client) == [["tuned"], ["tuned"]]
        raw = client.redis
        assert raw.hgetall(P.Keys(PREFIX).lora_adapters(MODEL)) == {"tuned": str(good)}

        # A replica that starts later loads what was loaded at run time before it.
        replicas.pop().stop()
        wait_replicas(client, 1)
        replicas.append(Replica(second_engine, redis_server.url))
        wait_replicas(client, 2)
        assert adapters_served(client) == [["tuned"], ["tuned"]]

        tuned = client.generate(MODEL, PROMPT, PARAMS, lora_name="tuned").result().outputs[0].token_ids
        assert tuned != base
        with client.generate(MODEL, PROMPT, PARAMS, lora_name="tuned") as running:
            streamed = iter(running)
            first = next(streamed)  # running now, on one of the replicas
            engine = next(r.engine for r in replicas if r.engine.has_unfinished_requests())
            assert engine.stats()["lora_running"] == {"tuned": 1}
            assert client.unload_lora_adapter(MODEL, "tuned") == 2
            assert engine.has_unfinished_requests()  # the unload came while it ran
            tokens = list(first.outputs[0].token_ids) + [t for d in streamed for t in d.outputs[0].token_ids]
        assert tokens == tuned  # it finished with its adapter
        assert adapters_served(client) == [[], []]
        with pytest.raises(ModelNotFoundError, match="tuned"):
            client.generate(MODEL, PROMPT, PARAMS, lora_name="tuned")
        with pytest.raises(ModelNotFoundError, match="The lora adapter 'tuned' cannot be found"):
            client.unload_lora_adapter(MODEL, "tuned")
        assert not raw.hgetall(P.Keys(PREFIX).lora_adapters(MODEL))
        assert client.generate(MODEL, PROMPT, PARAMS).result().outputs[0].token_ids == base
        for r in replicas:
            assert r.engine.block_manager.num_free_blocks == r.engine.block_manager.num_blocks
    finally:
        for r in replicas:
            r.stop()
        client.close()
