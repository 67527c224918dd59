"""Which of two linear routines serves which row counts, timed on this machine.

A routine's speed against another's depends on the CPU, the weight's shape and the threads, so the choice
is measured once per shape (and kept: `plan_cache`) rather than guessed from the CPU's flags.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from llmserve_kernels.cpu.plan_cache import Plan
from llmserve_kernels.timing import interleaved_best

ALL = math.inf  # a plan's native_rows where the native routine serves every row count
_LARGE_ROWS = 512  # the row count at which a routine for prompts (many rows) is timed
_CANDIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)  # where a crossover is looked for


def timed_plan(
    native: Callable,
    other: Callable,
    k: int,
    dtype: torch.dtype,
    other_costs_memory: bool,
    floor: int = 0,
    one_thread: bool = False,
) -> Plan:
    """Times two routines on random rows (interleaved, best of a few) and finds up to how many rows the
    native one is the faster: all of them if it is at half `_LARGE_ROWS` and at `_LARGE_ROWS` rows (its lead
    shrinks as rows grow), else by halving the candidates above `floor`, the rows the native routine serves
    whatever the timing (below `floor` its lead need not shrink with rows: where its AMX routine takes only
    steps of more than 20 rows, see `linear_pack._amx_rows`, the bf16 kernel can lose to oneDNN at a few rows
    and win again from 21). Where the other routine needs its own copy of the weight, the native one serves
    every row count if it is within a tenth of the other at both row counts, sparing that copy: oneDNN's rate
    varies from one row count to the next, so one count alone could land in one of its slow splits.

    Timed on the threads the engine runs with: oneDNN does not split every shape's work evenly over them,
    which a one-thread timing cannot see. With two threads any other busy process makes a call wait for a
    descheduled thread, so each routine keeps its best of five calls: one call free of other processes is
    enough. `one_thread`: two routines that split their work over threads alike, timed where that noise
    cannot reach them. (Measured cases: benchmarks/results/kernel-and-runner-timings.md.)"""
    gen = torch.Generator().manual_seed(0)

    def native_faster(rows: int, margin: float = 1.0) -> bool:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        native_time, other_time = interleaved_best([lambda: native(x, None), lambda: other(x, None)])
        return native_time <= margin * other_time

    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        return search(native_faster, other_costs_memory, floor)
    finally:
        torch.set_num_threads(threads)


def search(native_faster: Callable[..., bool], other_costs_memory: bool, floor: int = 0) -> Plan:
    """The plan `timed_plan` settles on, given `native_faster(rows, margin)`."""
    margin = 1.1 if other_costs_memory else 1.0
    if all(native_faster(rows, margin) for rows in (_LARGE_ROWS // 2, _LARGE_ROWS) if rows > floor):
        return Plan(ALL, keep_other=False)
    candidates = [rows for rows in _CANDIDATE_ROWS if rows > floor]  # none above the largest: the floor
    low, high = 0, len(candidates)  # candidates[:low] measured faster, candidates[high:] not
    while low < high:
        middle = (low + high) // 2
        if native_faster(candidates[middle]):
            low = middle + 1
        else:
            high = middle
    if candidates and low == len(candidates):
        return Plan(ALL, keep_other=False)
    return Plan(candidates[low - 1] if low else floor, keep_other=True)
