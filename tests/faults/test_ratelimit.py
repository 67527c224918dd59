"""Rate-limit counters in a Redis cache (in process): counted there, and a cache that does not answer lets
requests through rather than refusing them."""

from __future__ import annotations

import asyncio

import pytest
import redis

from inference_engine.bus.redis_server import RedisServer
from llmserve import ratelimit
from tests.rate_window import early_in_a_rate_window


def redis_cache(url: str) -> dict:
    return {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": url}}


@pytest.mark.asyncio
async def test_counts_in_redis(settings) -> None:
    with RedisServer() as server:
        settings.CACHES = redis_cache(server.url)
        early_in_a_rate_window(5)
        results = [await ratelimit.ahit("key:1", 2) for _ in range(3)]
        assert results[:2] == [None, None] and 0 < results[2] <= ratelimit.WINDOW


@pytest.mark.asyncio
async def test_requests_share_one_connection(settings) -> None:
    """Each ASGI request runs in a context of its own, where ``caches[alias]`` is a new object with a new
    connection pool: the counters must not open a connection per request."""
    with RedisServer() as server:
        settings.CACHES = redis_cache(server.url)
        connections = redis.Redis.from_url(server.url)
        before = connections.info("stats")["total_connections_received"]
        for _ in range(5):  # a task per request, each with its own context, as the ASGI handler does
            assert await asyncio.create_task(ratelimit.ahit("key:2", 100)) is None
        assert connections.info("stats")["total_connections_received"] - before == 1


@pytest.mark.asyncio
async def test_an_unreachable_cache_lets_requests_through(settings) -> None:
    settings.CACHES = redis_cache("redis://127.0.0.1:9/0")
    assert await ratelimit.ahit("key:1", 1) is None
    assert await ratelimit.ahit("key:1", 1) is None
