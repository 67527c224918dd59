"""Fixtures: a real redis-server per session on a free port, a bus namespace per test, and one real
`LLMEngine` (SmolLM2-135M on CPU) per session, served in threads of the test process."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import redis

from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import RedisServer
from inference_engine.bus.server import EngineServer, ServeSettings
from inference_engine.outputs import RequestOutput
from inference_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inference_engine.llm_engine import LLMEngine

MODEL = "smol"  # the name the threaded servers serve the engine under
MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer().start() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """A fresh key namespace per test: tests share one redis-server but never each other's keys."""
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(redis_server: RedisServer, prefix: str) -> Iterator[EngineClient]:
    c = EngineClient(redis_server.url, prefix=prefix, ack_timeout=5, stream_timeout=5, poll_interval=0.2)
    yield c
    c.close()


@pytest.fixture
def raw_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield r
    r.close()


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    """The real engine, loaded once (a few seconds) and shared by every threaded server of the session.

    Only one server serves it at a time, and tests drive it directly (`generate_offline`) only while none
    does."""
    import torch

    from inference_engine.config import EngineConfig
    from inference_engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    return LLMEngine(
        EngineConfig(
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            kv_cache_memory_bytes=64 * 2**20,
            log_stats_interval=0,
        )
    )


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left in the engine and every KV block back in the free pool."""
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def wait_idle(engine: LLMEngine, timeout: float = 5.0) -> None:
    """Waits for the serving thread to drop the engine's last request (e.g. once an abort is processed)."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # let the serving thread finish the iteration that emptied the engine
    assert_idle(engine)


def generate_offline(
    engine: LLMEngine, prompt: str | list[int], params: SamplingParams | dict
) -> RequestOutput:
    """Runs one request to completion on the engine itself, with no bus: what the bus must reproduce.

    Only while no server is serving `engine`."""
    assert_idle(engine)
    params = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
    request_id = f"offline-{uuid.uuid4().hex}"
    engine.add_request(request_id, prompt, params)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                assert_idle(engine)
                return output


class ThreadedServer:
    """An `EngineServer` over the session's `LLMEngine`, running in a thread of the test process."""

    def __init__(self, engine: LLMEngine, url: str, prefix: str, model: str = MODEL, **settings: Any) -> None:
        """`settings`: `ServeSettings` fields other than these tests' defaults."""
        self.engine = engine
        defaults = {
            "heartbeat_interval": 0.2,
            "heartbeat_ttl": 1.0,
            "claim_min_idle": 0.2,
            "idle_block": 0.05,
            "shutdown_grace": 2.0,
        }
        settings = ServeSettings(prefix=prefix, **{**defaults, **settings})
        self.server = EngineServer(engine, url, model, settings)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadedServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()
        # The engine outlives the server: whatever the server started, it finished or aborted.
        leftovers = list(self.engine.groups)
        self.engine.abort_request(leftovers)  # so one failure does not spill into the next tests
        assert not leftovers, f"the stopped server left requests in the engine: {leftovers}"
        assert_idle(self.engine)


@pytest.fixture
def serve(
    engine: LLMEngine, redis_server: RedisServer, prefix: str
) -> Iterator[Callable[[], ThreadedServer]]:
    """Starts a server over the shared engine (call it after any `generate_offline`); stopped at teardown."""
    servers: list[ThreadedServer] = []

    def start() -> ThreadedServer:
        server = ThreadedServer(engine, redis_server.url, prefix)
        # Registered before the thread runs, so clients never race the first heartbeat.
        server.server._connect()
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.stop()
