"""Timing for the choices the engine makes by measuring this machine once (which attention path a
prompt chunk takes, whether the LM head is padded): the best of a few runs after a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], runs: int = 3) -> float:
    """Seconds of the fastest of `runs` calls, after one untimed call (first touch, lazy builds)."""
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
