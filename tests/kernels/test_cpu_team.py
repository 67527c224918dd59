"""`spread_team`: a thread's OpenMP team pinned one thread to a CPU for a moment, then free again, within the
CPUs the caller may run on. The speed it buys a new thread's first forward pass is measured by
benchmarks.latency's offline first token; here, that it leaves no thread pinned and never widens a mask."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from llmserve_kernels.cpu import available
from llmserve_kernels.cpu.team import spread_team
from tests.thread_masks import TASKS, thread_masks

pytestmark = pytest.mark.skipif(
    not available() or not TASKS.is_dir(), reason="needs the native kernels and Linux"
)


def on_a_new_thread(fn):
    """fn() on a thread of its own, which ends (and with it its OpenMP team); its result."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_the_team_runs_anywhere_allowed_afterwards() -> None:
    allowed = os.sched_getaffinity(0)

    def spread_then_look():
        torch.set_num_threads(max(2, len(allowed)))
        cpus = spread_team()
        torch.ones(1 << 16).sum()  # the team runs a region after being let go
        return cpus, thread_masks()

    cpus, masks = on_a_new_thread(spread_then_look)
    assert cpus == len(allowed)
    assert all(mask == allowed for mask in masks.values()), masks


def test_a_narrowed_caller_keeps_its_team_within_its_cpus() -> None:
    allowed = os.sched_getaffinity(0)
    first = min(allowed)

    def narrowed():
        os.sched_setaffinity(0, {first})
        torch.set_num_threads(2)  # a team of two on one CPU: both pinned to it, then let go within it
        cpus = spread_team()
        return cpus, os.sched_getaffinity(0), thread_masks()

    cpus, own, masks = on_a_new_thread(narrowed)
    assert cpus == 1 and own == {first}
    narrowed_threads = [mask for mask in masks.values() if mask != allowed]
    assert len(narrowed_threads) >= 2 and all(mask == {first} for mask in narrowed_threads), masks
