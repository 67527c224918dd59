"""What the Redis bus costs: the same mixed workload in-process and through the bus, in one run.

    .venv/bin/python -m benchmarks.bus_overhead [--requests 32] [--threads 1] [--out bus_overhead.json]

Reports generated tokens/s of both (target: bus >= 90 % of in-process), the added latency per delta (the mean
gap between consecutive deltas of one lone stream, bus minus in-process), and the bus's bare round trip (a
tokenize request). Writes JSON and a PNG next to it. The engine process and the in-process engine never run
at the same time, so they do not compete for cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.workload import mixed_workload
from inference_engine.bus.client import AsyncEngineClient, EngineClient
from inference_engine.bus.redis_server import RedisServer
from inference_engine.sampling_params import SamplingParams

MODEL = "bench"


def workload(n: int) -> list[tuple[str, SamplingParams]]:
    """The case study's mixed workload (benchmarks/workload.py), greedy, every request to its max_tokens."""
    return [
        (req.prompt, SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True))
        for req in mixed_workload(n)
    ]


def in_process(args: argparse.Namespace, jobs: list) -> dict:
    import torch

    from inference_engine.config import EngineConfig
    from inference_engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_model_len=1024, log_stats_interval=0))

    def run(batch: list) -> tuple[int, float, list[float]]:
        stamps: list[float] = []
        start = time.perf_counter()
        for i, (prompt, params) in enumerate(batch):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
        tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                stamps.append(time.perf_counter())
                if out.finished:
                    tokens += sum(len(o.token_ids) for o in out.outputs)
        return tokens, time.perf_counter() - start, stamps

    run(jobs[:2])  # warm-up
    tokens, seconds, _ = run(jobs)
    _, _, stamps = run([(jobs[0][0], SamplingParams(max_tokens=48, ignore_eos=True))])
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "delta_gap_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1),
    }


def through_bus(url: str, jobs: list) -> dict:
    async def one(client: AsyncEngineClient, prompt: str, params: SamplingParams) -> tuple[int, list[float]]:
        stream = await client.generate(MODEL, prompt, params)
        tokens, stamps = 0, []
        async for delta in stream:
            tokens += sum(len(o.token_ids) for o in delta.outputs)
            stamps.append(time.perf_counter())
        return tokens, stamps

    async def run(batch: list) -> tuple[int, float, list[float]]:
        client = AsyncEngineClient(url)
        try:
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, p, s) for p, s in batch))
            return sum(t for t, _ in results), time.perf_counter() - start, results[0][1]
        finally:
            await client.close()

    asyncio.run(run(jobs[:2]))  # warm-up
    tokens, seconds, _ = asyncio.run(run(jobs))
    _, _, stamps = asyncio.run(run([(jobs[0][0], SamplingParams(max_tokens=48, ignore_eos=True))]))
    stamps = stamps[:-1]  # the last entry is the `final`, written in the same step as the last delta
    sync = EngineClient(url)
    round_trips = []
    for _ in range(50):
        t = time.perf_counter()
        sync.tokenize(MODEL, "hello")
        round_trips.append(time.perf_counter() - t)
    sync.close()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "delta_gap_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1),
        "round_trip_ms_median": 1000 * sorted(round_trips)[len(round_trips) // 2],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["in-process", "bus"]
    a.bar(names, [result["in_process"]["tokens_per_s"], result["bus"]["tokens_per_s"]], color=["gray", "C0"])
    a.set_title(f"tokens/s (bus = {100 * result['bus_ratio']:.0f} %)")
    b.bar(names, [result["in_process"]["delta_gap_ms"], result["bus"]["delta_gap_ms"]], color=["gray", "C0"])
    b.set_title(f"ms between deltas (+{result['added_latency_per_delta_ms']:.2f} ms)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bus_overhead.json"))
    args = parser.parse_args()
    jobs = workload(args.requests)
    with RedisServer() as redis_server:
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inference_engine",
                "serve",
                "--redis-url",
                redis_server.url,
                "--served-model-name",
                MODEL,
                "--threads",
                str(args.threads),
                "--dtype",
                args.dtype,
                "--max-model-len",
                "1024",
                "--log-level",
                "WARNING",
            ]
        )
        try:
            client = EngineClient(redis_server.url)
            while not client.live_replicas(MODEL):  # load it first, so the two never overlap
                if engine.poll() is not None:
                    raise SystemExit("engine process failed to start")
                time.sleep(0.2)
            client.close()
            local = in_process(args, jobs)
            bus = through_bus(redis_server.url, jobs)
        finally:
            engine.terminate()
            engine.wait(30)
    result = {
        "requests": args.requests,
        "threads": args.threads,
        "dtype": args.dtype,
        "in_process": local,
        "bus": bus,
        "bus_ratio": bus["tokens_per_s"] / local["tokens_per_s"],
        "added_latency_per_delta_ms": bus["delta_gap_ms"] - local["delta_gap_ms"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
