"""Fixtures: a real redis-server per session on a free port, and a bus namespace per test."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import RedisServer
from inference_engine.bus.server import EngineServer, ServeSettings

from .fake_engine import FakeEngine


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


class ThreadedServer:
    """An `EngineServer` over a `FakeEngine`, running in a thread of the test process."""

    def __init__(self, url: str, prefix: str, model: str = "fake", **engine_kwargs) -> None:
        self.engine = FakeEngine(**engine_kwargs)
        settings = ServeSettings(prefix=prefix, heartbeat_interval=0.2, heartbeat_ttl=1.0, claim_min_idle=0.2,
                                 idle_block=0.05, shutdown_grace=2.0)
        self.server = EngineServer(self.engine, url, model, settings)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadedServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def fake_server(redis_server: RedisServer, prefix: str) -> Iterator[ThreadedServer]:
    server = ThreadedServer(redis_server.url, prefix)
    # Registered before the thread runs, so clients never race the first heartbeat.
    server.server._connect()
    server.start()
    yield server
    server.stop()
