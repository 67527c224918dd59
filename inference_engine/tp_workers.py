"""The ranks of a tensor-parallel engine besides rank 0, and how rank 0 drives them.

Rank 0 (the engine process) owns the scheduler, the block manager, the sampler and the bus. Each step it
broadcasts a `StepPlan` (the flattened batch, block tables and cache copies); every rank runs the same
forward pass on its shard, all-reducing after the row-parallel layers, and only rank 0 receives the
logits. Rank 0 starts the other ranks of its machine as `python -m inference_engine rank` processes; on
other machines `python -m inference_engine worker` starts them (same model and flags, `--node-rank`).

A rank that dies takes the engine down: rank 0 watches its children and marks the engine failed (a
collective with a dead rank fails at once, its sockets closed); children die with rank 0 (Linux's
parent-death signal), and a worker whose collective fails exits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from inference_engine import distributed
from inference_engine.config import EngineConfig
from inference_engine.errors import InvalidRequestError
from inference_engine.model_loader import ModelConfig, load_configured_model
from inference_engine.runners import make_runner

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
    init_rank(config, rank)
    runner = make_runner(config, load_configured_model(config))
    distributed.freeze_startup_heap()
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


def rank_main(rank: int, parent_pid: int, ready_fd: int) -> None:
    """A rank process (`python -m inference_engine rank`): reads its config from stdin, says it started (a
    byte on `ready_fd`), then runs as `rank` until rank 0 stops it, or dies with its parent."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6").prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was set
        os._exit(1)
    config = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )
    with os.fdopen(ready_fd, "wb") as ready:
        ready.write(b"1")
    run_worker(config, rank)


class RankProcess(subprocess.Popen):
    """A rank's process (`python -m inference_engine rank`), and which rank it runs."""

    def __init__(self, rank: int, command: list[str], **options) -> None:
        super().__init__(command, **options)
        self.rank = rank
        self.name = f"tp-rank-{rank}"


def start_node_workers(config: EngineConfig, node_rank: int) -> list[RankProcess]:
    """Starts this machine's ranks (all but rank 0 on node 0) and returns once each process has started.

    New interpreters rather than multiprocessing's spawn, which re-imports the caller's main module: a script
    that builds an engine at top level, with no `if __name__ == "__main__":` guard, would build it again in
    each rank, which then never joins the group."""
    local_size = config.tensor_parallel_size // config.nnodes
    first = node_rank * local_size
    try:
        payload = pickle.dumps(config)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TensorParallelError(
            f"tensor_parallel_size > 1 sends the engine's config to its rank processes, and it does not "
            f"pickle ({exc}): give the model as a path or hub id."
        ) from exc
    started = [_start_rank(rank, payload) for rank in range(max(first, 1), first + local_size)]
    try:
        for process, ready in started:
            _wait_started(process, ready)
    except TensorParallelError:
        for process, _ in started:
            process.kill()
            process.wait()
        raise
    return [process for process, _ in started]


def _start_rank(rank: int, payload: bytes) -> tuple[RankProcess, int]:
    """The rank's process, and the pipe on which it says it started. The package's own folder goes first on
    its path: the caller may have imported inference_engine from a folder the new interpreter would not
    search (a script's, not the working directory)."""
    ready, ready_in_child = os.pipe()
    package_root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "inference_engine", "rank", str(rank)]
    command += ["--parent-pid", str(os.getpid()), "--ready-fd", str(ready_in_child)]
    try:
        process = RankProcess(
            rank,
            command,
            stdin=subprocess.PIPE,
            pass_fds=(ready_in_child,),
            env={**os.environ, "PYTHONPATH": path},
        )
    finally:
        os.close(ready_in_child)
    with contextlib.suppress(BrokenPipeError):  # it died at once: _wait_started says so
        process.stdin.write(payload)
        process.stdin.close()
    return process, ready


def _wait_started(process: RankProcess, ready: int) -> None:
    """Waits for the rank's byte: a rank that exits first fails the engine at once, not after the group's
    rendezvous timeout."""
    with os.fdopen(ready, "rb") as pipe:
        started = pipe.read(1)
    if not started:
        code = process.wait()
        raise TensorParallelError(
            f"tensor-parallel {process.name} exited with code {code} before it started (its error is above); "
            f"`{sys.executable} -m inference_engine rank --help` must run in this environment."
        )


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
        for process in self.processes:
            threading.Thread(target=self._watch, args=(process,), name="tp-watchdog", daemon=True).start()
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """A script that ends without shutting the engine down: the ranks go before the interpreter tears
        down the process group under its threads (which aborts the process)."""
        self.stop(kill=True)

    def take_cores(self) -> None:
        """Rank 0's cores for the calling thread: the one that runs its steps, where that is not the one that
        built the engine (`EngineLoop`)."""
        take_cores(self.config, 0)

    def _watch(self, process: RankProcess) -> None:
        code = process.wait()
        if not self._stopping:
            self.fail(f"tensor-parallel {process.name} (pid {process.pid}) died with exit code {code}")

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
        atexit.unregister(self._stop_at_exit)
        if not kill and self.failure is None:
            try:
                dist.broadcast_object_list([None], src=0)
            except (RuntimeError, dist.DistBackendError):
                kill = True
        for process in self.processes:
            if not kill:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            process.kill()
            process.wait(timeout=5)
        distributed.destroy_process_group()
