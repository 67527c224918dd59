"""Per-key rate limiting: a fixed one-minute window counted in a Django cache.

A fixed window is the simplest scheme that bounds a key's load. Counting in the cache framework (not in
process memory) lets a shared cache enforce one limit across every web process: the host project uses the
bus's Redis (``LLMSERVE["RATE_LIMIT_CACHE"]`` names the cache). Shared by the REST API and the WebSocket
consumer.
"""

from __future__ import annotations

import logging
import time

from django.core.cache import caches

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
    cache = caches[conf.get("RATE_LIMIT_CACHE")]
    try:
        # add() then incr() is atomic on backends that implement incr atomically (Redis, Memcached, locmem).
        await cache.aadd(key, 0, timeout=WINDOW + 1)
        try:
            count = await cache.aincr(key)
        except ValueError:  # expired between add and incr
            await cache.aset(key, 1, timeout=WINDOW + 1)
            count = 1
    except Exception as exc:  # each cache backend raises its own errors
        log.warning("rate-limit cache unavailable (%s); request allowed", type(exc).__name__)
        return None
    if count > limit:
        return (window + 1) * WINDOW - now
    return None
