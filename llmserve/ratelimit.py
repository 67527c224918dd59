"""Per-key rate limiting: a fixed one-minute window counted in a Django cache.

A fixed window is the simplest scheme that bounds a key's load; counting in the cache framework (not in
process memory) lets a shared cache (Redis) enforce one limit across several web processes. Shared by the REST
API and the WebSocket consumer.
"""

from __future__ import annotations

import time

from django.core.cache import caches

from llmserve import conf

WINDOW = 60  # seconds


async def ahit(identity: str, limit: int) -> float | None:
    """Count one request of `identity`; returns None if allowed, else the seconds until the window resets.

    ``limit`` is requests per minute; 0 means unlimited.
    """
    if limit <= 0:
        return None
    now = time.time()
    window = int(now // WINDOW)
    key = f"llmserve:ratelimit:{identity}:{window}"
    cache = caches[conf.get("RATE_LIMIT_CACHE")]
    # add() then incr() is atomic on backends that implement incr atomically (Redis, Memcached, locmem).
    await cache.aadd(key, 0, timeout=WINDOW + 1)
    try:
        count = await cache.aincr(key)
    except ValueError:  # expired between add and incr
        await cache.aset(key, 1, timeout=WINDOW + 1)
        count = 1
    if count > limit:
        return (window + 1) * WINDOW - now
    return None
