"""Per-key rate limiting: a fixed one-minute window counted in the bus's Redis.

A fixed window is the simplest scheme that bounds a key's load. The counters live beside the request queues,
in the Redis every web process and Celery worker already shares, so one limit holds across all of them, and
counting costs one round trip from the event loop (an increment and its expiry, pipelined).
"""

from __future__ import annotations

import logging
import time

from inference_engine.errors import EngineError
from llmserve import bus

log = logging.getLogger(__name__)

WINDOW = 60  # seconds


async def ahit(identity: str, limit: int) -> float | None:
    """Count one request of `identity`; returns None if allowed, else the seconds until the window resets.

    ``limit`` is requests per minute; 0 means unlimited. When Redis does not answer, the request is let
    through (and logged): the request then fails on the bus itself, with the bus's error, not with a 429.
    """
    if limit <= 0:
        return None
    now = time.time()
    window = int(now // WINDOW)
    try:
        count = await bus.async_client().count(f"ratelimit:{identity}:{window}", WINDOW + 1)
    except EngineError as exc:
        log.warning("rate-limit counters unavailable (%s); request allowed", exc)
        return None
    if count > limit:
        return (window + 1) * WINDOW - now
    return None
