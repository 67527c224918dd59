"""The ranks of a tensor-parallel engine besides rank 0, and how rank 0 drives them.

Rank 0 (the engine process) owns the scheduler, the block manager, the sampler and the bus. Each step it
broadcasts a `StepPlan` (the flattened batch, block tables and cache copies); every rank runs the same
forward pass on its shard, all-reducing after the row-parallel layers, and only rank 0 receives the
logits. Rank 0 starts the other ranks of its machine as child processes; on other machines
`python -m inference_engine worker` starts them (same model and flags, `--node-rank`).

A rank that dies takes the engine down: rank 0 watches its children and marks the engine failed (a
collective with a dead rank fails at once, its sockets closed); children die with rank 0 (Linux's
parent-death signal), and a worker whose collective fails exits.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from inference_engine import distributed
from inference_engine.config import EngineConfig
from inference_engine.errors import InvalidRequestError
from inference_engine.model_loader import ModelConfig

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering: the engine cannot go on."""


def check_tensor_parallel(model: ModelConfig, size: int) -> None:
    """Raises a clear error where the model cannot be split across `size` ranks."""
    if size == 1:
        return
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads (nor does {size} divide by them, to replicate them)")
    if model.intermediate_size % size:
        problems.append(f"its MLP width {model.intermediate_size}")
    if problems:
        raise InvalidRequestError(
            f"tensor_parallel_size={size} does not divide {' or '.join(problems)}; choose a size that does."
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6").prctl(pr_set_pdeathsig, signal.SIGKILL)


def init_rank(config: EngineConfig, rank: int) -> None:
    """Joins the group as `rank` and takes this rank's cores (CPU) or GPU (CUDA)."""
    take_cores(config, rank)
    local, _ = _on_this_node(config, rank)
    distributed.init_process_group(
        rank, config.tensor_parallel_size, local, config.distributed_init_method, _device(config)
    )


def take_cores(config: EngineConfig, rank: int) -> None:
    """On a CPU, `rank`'s share of this machine's cores for the calling thread and the threads it starts."""
    if _device(config) == "cpu":
        distributed.pin_to_cpu_share(*_on_this_node(config, rank))


def _on_this_node(config: EngineConfig, rank: int) -> tuple[int, int]:
    """`rank`'s index among its node's ranks, and how many ranks a node runs."""
    local_size = config.tensor_parallel_size // config.nnodes
    return rank % local_size, local_size


def _device(config: EngineConfig) -> str:
    return config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


def run_worker(config: EngineConfig, rank: int) -> None:
    """A rank other than 0: builds its model shard, then runs every step rank 0 broadcasts until told to
    stop."""
    from inference_engine.engine_loop import freeze_startup_heap
    from inference_engine.model_loader import load_configured_model
    from inference_engine.model_runner import ModelRunner  # imports this module

    init_rank(config, rank)
    runner = ModelRunner(config, load_configured_model(config))
    freeze_startup_heap()
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            plan = message[0]
            if plan is None:
                break
            runner.run(plan.to(runner.device))
    except (RuntimeError, dist.DistBackendError) as exc:
        logger.error("tensor-parallel rank %d: lost the group (%s); exiting", rank, exc)
        os._exit(1)
    distributed.destroy_process_group()


def _child_main(config: EngineConfig, rank: int) -> None:
    _die_with_parent()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )
    run_worker(config, rank)


def start_node_workers(config: EngineConfig, node_rank: int) -> list[multiprocessing.Process]:
    """Starts this machine's ranks (all but rank 0 on node 0) as child processes."""
    local_size = config.tensor_parallel_size // config.nnodes
    first = node_rank * local_size
    ranks = range(max(first, 1), first + local_size)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_child_main, args=(config, rank), name=f"tp-rank-{rank}", daemon=True)
        for rank in ranks
    ]
    for process in processes:
        process.start()
    return processes


class TPWorkers:
    """Rank 0's side: the other ranks of this machine, the step broadcast and the death watch."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[str], None] | None = None) -> None:
        if config.master_port is None:
            config = replace(config, master_port=_free_port())
        self.config = config
        self.processes = start_node_workers(config, node_rank=0)
        self.failure: str | None = None
        self.on_failure = on_failure
        self._stopping = False
        init_rank(config, 0)
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def take_cores(self) -> None:
        """Rank 0's cores for the calling thread: the one that runs its steps, where that is not the one that
        built the engine (`EngineLoop`)."""
        take_cores(self.config, 0)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        if not sentinels:
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        dead = sentinels[ready[0]]
        dead.join(timeout=1)
        self.fail(f"tensor-parallel {dead.name} (pid {dead.pid}) died with exit code {dead.exitcode}")

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("%s; the engine stops", reason)
            self.stop(kill=True)
            if self.on_failure is not None:
                self.on_failure(reason)

    def send(self, plan) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            dist.broadcast_object_list([plan], src=0)
        except (RuntimeError, dist.DistBackendError) as exc:
            self.fail(f"tensor-parallel group failed: {exc}")
            raise TensorParallelError(self.failure) from exc

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def stop(self, kill: bool = False) -> None:
        """Ends the other ranks: a stop message when they are healthy, SIGKILL otherwise or if they linger."""
        if self._stopping:
            return
        self._stopping = True
        if not kill and self.failure is None:
            try:
                dist.broadcast_object_list([None], src=0)
            except (RuntimeError, dist.DistBackendError):
                kill = True
        for process in self.processes:
            process.join(timeout=0 if kill else 10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        distributed.destroy_process_group()
