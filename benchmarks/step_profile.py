"""Where a decode step's time goes: the engine's wall time per step against the time the device spends
in kernels, and the host functions that take the rest, at a few batch sizes, greedy and sampled.

    python -m benchmarks.step_profile [--model DIR] [--device cuda] [--batches 1 8 32] [--out DIR]

On a GPU a small model's step is bound by the host (scheduling, input preparation, sampling glue, kernel
launches) long before the GPU is busy; this says by how much and where. Each batch decodes short prompts,
greedy and then sampled (temperature 0.8, top-p 0.95, seeded, as the mixed-workload benchmark samples):
first timed plain (the wall time per step), then under torch's profiler (kernel time per step) and under
cProfile (host functions by own time). Writes step_profile.json and a plot.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from inference_engine import LLM, SamplingParams

PROMPT = "Tell me a long story about the sea and the ships that sail on it."
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_p": 0.95, "seed": 0}}


def _steps(llm: LLM, count: int) -> list[float]:
    engine, times = llm.llm_engine, []
    for _ in range(count):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _device_kernel_ms(llm: LLM, count: int) -> float | None:
    """Milliseconds of device kernels per step (None on the CPU, where there is no separate device)."""
    if llm.llm_engine.runner.device.type != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _steps(llm, count)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / count


def _host_functions(llm: LLM, count: int, top: int = 15) -> list[dict]:
    profiler = cProfile.Profile()
    profiler.runcall(_steps, llm, count)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{Path(file).name}:{line} {name}",
            "own_ms_per_step": own * 1e3 / count,
            "cumulative_ms_per_step": cumulative * 1e3 / count,
            "calls_per_step": calls / count,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]


def profile_batch(llm: LLM, batch: int, steps: int, sampling: str = "greedy") -> dict:
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8 + 4 * steps, ignore_eos=True, **SAMPLINGS[sampling])
    ids = [f"{sampling}-b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, PROMPT, params)
    _steps(llm, 8)  # prompts, then warm decode steps
    wall = _steps(llm, steps)
    kernel_ms = _device_kernel_ms(llm, steps)
    host = _host_functions(llm, steps)
    engine.abort_request(ids)
    return {
        "batch": batch,
        "sampling": sampling,
        "step_ms": 1e3 * statistics.median(wall),
        "kernel_ms_per_step": kernel_ms,
        "host_functions": host,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    batches = [f"{r['batch']} {r['sampling']}" for r in rows]
    ax.bar(batches, [r["step_ms"] for r in rows], label="engine step (wall)")
    if all(r["kernel_ms_per_step"] is not None for r in rows):
        ax.bar(batches, [r["kernel_ms_per_step"] for r in rows], width=0.4, label="device kernels")
    ax.set_xlabel("decode batch, sampling")
    ax.set_ylabel("ms per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model path (default: the bundled model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch and method")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches))
    rows = [
        profile_batch(llm, batch, args.steps, sampling) for batch in args.batches for sampling in SAMPLINGS
    ]
    result = {"model": args.model or "bundled", "device": str(llm.llm_engine.runner.device), "batches": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "step_profile.png")
    for row in rows:
        kernels = row["kernel_ms_per_step"]
        print(
            f"batch {row['batch']} {row['sampling']}: step {row['step_ms']:.2f} ms, "
            f"kernels {kernels and f'{kernels:.2f}'} ms"
        )
        for f in row["host_functions"][:8]:
            print(
                f"    {f['own_ms_per_step']:7.3f} ms own  {f['calls_per_step']:6.1f} calls  {f['function']}"
            )


if __name__ == "__main__":
    main()
