"""Where a thread's OpenMP team starts out (`csrc/team.c`)."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import function, i32


def spread_team() -> int | None:
    """Spreads the calling thread's OpenMP team (torch's thread count) one thread to a CPU, then lets each run
    anywhere again. Call it on a thread about to run the model, after setting its thread count: a new team's
    threads otherwise start on one core until Linux spreads them (see `csrc/team.c`). Returns the CPUs this
    thread may run on, or None where the kernels or the system cannot say."""
    fn = function("spread_team", i32, i32)
    if fn is None:
        return None
    cpus = fn(torch.get_num_threads())
    return cpus if cpus > 0 else None
