"""Tensor parallelism's process group: rank and size, the collectives the layers call, and its setup.

One process per rank (`inference_engine.tp_workers` starts them). Rank 0 is the engine itself; every
rank holds its shard of the weights and of the KV cache and runs the same forward pass. Layers read the
rank and size they are built for (`building`) once, and call the collectives only when their own size is
above one: an unsharded engine in a process that also hosts a sharded one stays unsharded.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from llmserve_kernels.cpu.team import spread_team

_local_rank = 0
_building = (0, 1)  # (rank, size) of the model being built


@contextmanager
def building(rank: int, size: int) -> Iterator[None]:
    """Layers constructed inside take this rank's shard of a model split `size` ways."""
    global _building
    previous, _building = _building, (rank, size)
    try:
        yield
    finally:
        _building = previous


def tp_rank() -> int:
    return _building[0]


def tp_size() -> int:
    return _building[1]


def local_rank() -> int:
    """This rank's index among the ranks of its machine (its GPU on CUDA)."""
    return _local_rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the group in place (layers of a sharded model call it)."""
    dist.all_reduce(x)
    return x


def gather_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenates every rank's x along the last dimension on rank 0 (None on the others)."""
    first = dist.get_rank() == 0
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())] if first else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def init_process_group(
    rank: int, world_size: int, local: int, init_method: str, device_type: str, timeout: float = 120.0
) -> None:
    """Joins this process to the tensor-parallel group (NCCL between GPUs, gloo between CPU ranks).

    The timeout bounds how long a rank waits for the others to join, and a collective for a rank that
    stopped answering; a rank that dies outright is noticed at once (its sockets close).
    """
    global _local_rank
    _local_rank = local
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"tensor-parallel rank {rank} needs GPU {local} but this machine has "
                f"{torch.cuda.device_count()}: lower tensor_parallel_size or spread ranks over nodes."
            )
        torch.cuda.set_device(local)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_share(local: int, local_size: int) -> list[int]:
    """This rank's cores: the machine's (allowed) cores split into equal contiguous parts, so TP=2 on
    two cores runs one thread per rank and ranks never compete for a core."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // local_size)
    share = cores[local * per_rank : (local + 1) * per_rank]
    return share or [cores[local % len(cores)]]


def pin_to_cpu_share(local: int, local_size: int) -> None:
    cores = cpu_share(local, local_size)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    spread_team()


@contextmanager
def thread_placement_kept() -> Iterator[None]:
    """The calling thread's CPU affinity and torch thread count as they were before the block, whatever it
    set (a rank 0 built on a caller's thread takes its cores for that thread: see `EngineLoop.build`), and its
    OpenMP team free to run on those CPUs again (`pin_to_cpu_share` placed the team on the share)."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        spread_team()


def freeze_startup_heap() -> None:
    """Puts every object alive now beyond the reach of Python's cyclic collector, in a process that serves
    one engine for its whole life. The model, its tables and the tokenizer leave some 200,000 objects that
    every full collection would walk again (a pause in which no step runs) and never free. Garbage from
    startup is collected first, so none of it is kept."""
    gc.collect()
    gc.freeze()
