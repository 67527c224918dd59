"""Rate-limit counters in the bus's Redis (in process, a real redis-server): counted there in one round trip,
shared by concurrent requests, and a Redis that does not answer lets requests through rather than refusing
them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from inference_engine.bus.redis_server import RedisServer
from llmserve import ratelimit
from tests.rate_window import early_in_a_rate_window


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


@pytest.fixture
def raw(server: RedisServer, settings) -> Iterator[redis.Redis]:
    settings.LLMSERVE = {"REDIS_URL": server.url}
    connection = redis.Redis.from_url(server.url, decode_responses=True)
    connection.flushdb()
    yield connection
    connection.close()


def test_counts_in_one_window_and_expire(raw: redis.Redis) -> None:
    async def run() -> list[float | None]:
        return [await ratelimit.ahit("key:1", 2) for _ in range(3)] + [await ratelimit.ahit("key:9", 0)]

    early_in_a_rate_window(5)
    first, second, third, unlimited = asyncio.run(run())
    assert first is None and second is None and unlimited is None
    assert third is not None and 0 < third <= ratelimit.WINDOW
    (counter,) = raw.keys("*ratelimit*")  # the unlimited identity is not counted at all
    assert "key:1" in counter and raw.get(counter) == "3"
    assert 0 < raw.ttl(counter) <= ratelimit.WINDOW + 1


def test_counts_every_concurrent_request(raw: redis.Redis) -> None:
    async def run() -> list[float | None]:
        return await asyncio.gather(*(ratelimit.ahit("concurrent", 10) for _ in range(30)))

    early_in_a_rate_window(5)
    refused = [r for r in asyncio.run(run()) if r is not None]
    assert len(refused) == 20


def test_requests_share_one_connection(raw: redis.Redis) -> None:
    """Each ASGI request runs in a task and context of its own; the counters use the event loop's bus client
    and its pool, not a connection per request."""

    async def run() -> None:
        await ratelimit.ahit("key:2", 100)  # the loop's client connects once
        before = raw.info("stats")["total_connections_received"]
        for _ in range(5):
            assert await asyncio.create_task(ratelimit.ahit("key:2", 100)) is None
        assert raw.info("stats")["total_connections_received"] == before

    asyncio.run(run())


def test_an_unreachable_redis_lets_requests_through(settings, caplog) -> None:
    settings.LLMSERVE = {"REDIS_URL": "redis://127.0.0.1:9/0"}

    async def run() -> list[float | None]:
        return [await ratelimit.ahit("key:1", 1) for _ in range(2)]

    assert asyncio.run(run()) == [None, None]
    assert "rate-limit counters unavailable" in caplog.text
