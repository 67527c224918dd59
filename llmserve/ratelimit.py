"""Per-key rate limiting: a fixed one-minute window counted in a Django cache.

A fixed window is the simplest scheme that bounds a key's load. Counting in the cache framework (not in
process memory) lets a shared cache enforce one limit across every web process: the host project uses the
bus's Redis (``LLMSERVE["RATE_LIMIT_CACHE"]`` names the cache). Shared by the REST API and the WebSocket
consumer.
"""

from __future__ import annotations

import logging
import time

from asgiref.sync import sync_to_async
from django.core.cache import BaseCache, caches
from django.core.signals import setting_changed
from django.dispatch import receiver

from llmserve import conf

log = logging.getLogger(__name__)

WINDOW = 60  # seconds


async def ahit(identity: str, limit: int) -> float | None:
    """Count one request of `identity`; returns None if allowed, else the seconds until the window resets.

    ``limit`` is requests per minute; 0 means unlimited. When the cache does not answer, the request is let
    through (and logged): an outage of the counters must not refuse traffic the engines can still serve.
    """
    if limit <= 0:
        return None
    now = time.time()
    window = int(now // WINDOW)
    key = f"llmserve:ratelimit:{identity}:{window}"
    try:
        # Not the cache's async methods: Django implements `aincr` as a get then a set, which loses counts
        # between concurrent requests. One call off the event loop, and not on the request's own thread
        # (the counter touches no database connection), keeps `incr` atomic and costs one hop.
        count = await sync_to_async(_count, thread_sensitive=False)(conf.get("RATE_LIMIT_CACHE"), key)
    except Exception as exc:  # each cache backend raises its own errors
        log.warning("rate-limit cache unavailable (%s); request allowed", type(exc).__name__)
        return None
    if count > limit:
        return (window + 1) * WINDOW - now
    return None


def _count(alias: str, key: str) -> int:
    # add() then incr() is atomic on backends that implement incr atomically (Redis, Memcached, locmem).
    cache = _cache(alias)
    cache.add(key, 0, timeout=WINDOW + 1)
    try:
        return cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.set(key, 1, timeout=WINDOW + 1)
        return 1


_caches: dict[str, BaseCache] = {}


def _cache(alias: str) -> BaseCache:
    """One cache object per process for the counters.

    ``caches[alias]`` is a new object in each ASGI request's context, and a new Redis cache object opens a new
    connection pool: every request paid a TCP connect and redis-py's package-metadata lookup, about a third of
    the web process's time for a completion. Django's cache backends are safe to share between threads.
    """
    cache = _caches.get(alias)
    if cache is None:
        cache = _caches[alias] = caches.create_connection(alias)
    return cache


@receiver(setting_changed)
def _forget_caches(setting: str, **kwargs: object) -> None:
    if setting == "CACHES":
        _caches.clear()
