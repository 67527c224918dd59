"""What batch invariance costs: the mixed workload's tokens/s with it (the default) and without, in one run.

    .venv/bin/python -m benchmarks.batch_invariance [--quantization gguf|none] [--requests 32] [--repeats 2]

Two engines on the same model file, one built with LLMSERVE_BATCH_INVARIANT=0 (the timed kernel plans: oneDNN
and dequantized copies for many rows), take turns on the workload (benchmarks/workload.py, greedy, every
request to its max_tokens), so a noisy neighbour slows both alike; each one's median run is reported. Delete
~/.cache/llmserve/kernels/*.plans.json first where plans were timed on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks.offline_throughput import run_engine
from benchmarks.workload import mixed_workload
from inference_engine import LLM, SamplingParams

MODES = {"invariant": "1", "timed plans": "0"}


def build(invariant: str, quantization: str, threads: int) -> LLM:
    """An engine whose linear layers were packed with LLMSERVE_BATCH_INVARIANT=`invariant`."""
    before = os.environ.get("LLMSERVE_BATCH_INVARIANT")
    os.environ["LLMSERVE_BATCH_INVARIANT"] = invariant
    try:
        options = {} if quantization == "gguf" else {"quantization": quantization}
        llm = LLM(dtype="bfloat16", seed=0, log_stats_interval=0, **options)
    finally:
        if before is None:
            del os.environ["LLMSERVE_BATCH_INVARIANT"]
        else:
            os.environ["LLMSERVE_BATCH_INVARIANT"] = before
    torch.set_num_threads(threads)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    return llm


def _median_run(runs: list[dict]) -> dict:
    middle = statistics.median(run["tokens_per_s"] for run in runs)
    return min(runs, key=lambda run: abs(run["tokens_per_s"] - middle))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(MODES), [result[m]["tokens_per_s"] for m in MODES], color=["tab:blue", "tab:gray"])
    ax.set_title(f"mixed workload, {result['workload']}, {result['quantization']}: tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="gguf", help="gguf: the bundled Q4_1 file; none: bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {mode: build(flag, args.quantization, args.threads) for mode, flag in MODES.items()}
    requests = mixed_workload(args.requests)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            runs[mode].append(run_engine(llm, requests))
            print(mode, f"{runs[mode][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    median = {mode: _median_run(r) for mode, r in runs.items()}
    result = {
        "workload": f"{len(requests)} requests",
        "quantization": args.quantization,
        "threads": args.threads,
        "repeats": args.repeats,
        **median,
        "cost": 1 - median["invariant"]["tokens_per_s"] / median["timed plans"]["tokens_per_s"],
        "all_runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"batch_invariance_{args.quantization}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"{name}.png")
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}, indent=2))


if __name__ == "__main__":
    main()
