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


def interleaved_best(fns: list[Callable[[], object]], rounds: int = 5) -> list[float]:
    """Each function's `best_time` of one call over `rounds` rounds in which they take turns: on a shared
    machine whose speed drifts, every function meets the same drift, and one undisturbed call is enough."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_time(fn, 1))
    return best
