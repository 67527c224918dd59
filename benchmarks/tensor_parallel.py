"""Tensor parallelism on this machine: the mixed workload at TP=1 (all threads in one process) and TP=2 (the
cores split, one process per rank), on a random model of the bundled model's size whose 8 heads and 2 KV
heads split in two, and the time a step spends in communication.

    .venv/bin/python -m benchmarks.tensor_parallel [--threads 2] [--repeats 2]

Communication is measured twice: rank 0's time inside collectives during the workload (which includes
waiting for the other rank to finish its share: load imbalance), and the bare latency of the step's
all-reduces ([tokens, hidden] bf16, two per layer and one for the embedding) in a group of two on loopback.
JSON and a PNG plot under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.offline_throughput import run_engine
from benchmarks.random_llama import write_random_llama
from benchmarks.workload import mixed_workload
from inference_engine import LLM

LAYERS = 30


class CollectiveTimer:
    """Adds up the wall time rank 0 spends in torch.distributed's collectives."""

    names = ("all_reduce", "gather", "broadcast_object_list")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._originals = {name: getattr(dist, name) for name in self.names}

    def __enter__(self) -> CollectiveTimer:
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def _all_reduce_latency(rank: int, port: int, rows: list[int], hidden: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for n in rows:
        x = torch.randn(n, hidden).to(torch.bfloat16)
        for _ in range(20):
            dist.all_reduce(x)
        start = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        if rank == 0:
            result[n] = (time.perf_counter() - start) / 200
    dist.destroy_process_group()


def all_reduce_latency(rows: list[int], hidden: int) -> dict[int, float]:
    from inference_engine.bus.redis_server import free_port

    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_all_reduce_latency, args=(free_port(), rows, hidden, result), nprocs=2)
        return dict(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="cores; TP=2 gives each rank half")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = write_random_llama(Path(tempfile.mkdtemp()) / "tp-8-heads", heads=8, kv_heads=2, layers=LAYERS)
    requests = mixed_workload(args.requests)
    result: dict = {"model": "random Llama, hidden 576, 8 heads / 2 KV heads, 30 layers", "runs": {}}
    for size in (1, 2):
        llm = LLM(model=str(folder), dtype="bfloat16", tensor_parallel_size=size, log_stats_interval=0)
        runs = []
        for _ in range(args.repeats):
            with CollectiveTimer() as timer:
                run = run_engine(llm, requests)
            run["collective_seconds"] = timer.seconds
            run["collective_calls"] = timer.calls
            runs.append(run)
        best = max(runs, key=lambda r: r["tokens_per_s"])
        result["runs"][f"tp{size}"] = best
        print(f"TP={size}: {best['tokens_per_s']:.1f} tokens/s", flush=True)
        llm.llm_engine.shutdown()
        del llm
    tp2 = result["runs"]["tp2"]
    result["speedup_tp2"] = tp2["tokens_per_s"] / result["runs"]["tp1"]["tokens_per_s"]
    result["collective_share_tp2"] = tp2["collective_seconds"] / tp2["seconds"]
    latency = all_reduce_latency([1, 32, 256, 2048], 576)
    result["all_reduce_latency_us"] = {n: 1e6 * s for n, s in latency.items()}
    result["all_reduces_per_step"] = 2 * LAYERS + 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tensor_parallel.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "tensor_parallel.png")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(result["runs"])
    left.bar(names, [result["runs"][n]["tokens_per_s"] for n in names])
    left.set(ylabel="output tokens/s", title="Mixed workload")
    latency = result["all_reduce_latency_us"]
    right.plot(list(latency), list(latency.values()), "o-")
    right.set(
        xscale="log", xlabel="rows all-reduced", ylabel="µs", title="gloo all-reduce, 2 ranks, loopback"
    )
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
