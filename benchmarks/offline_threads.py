"""Offline generation from threads: the seeds' task-queue example (001, section 7.2) against one call.

    .venv/bin/python -m benchmarks.offline_threads [--dtype bfloat16] [--threads 2] [--max-tokens 32]

The same 8 prompts, each generating the same number of tokens (ignore_eos), run as
- one `llm.generate(prompts)` call (the batch the engine is built for);
- 8 threads each calling `llm.generate([prompt])` at once: they join the engine loop's one batch;
- the task queue of the seeds: 16 prompts through a ThreadPoolExecutor of 2, 4 and 8 workers;
- one call after another (what the threads would get if calls took turns).
Every mode takes its turn in each repeat (so a noisy neighbour slows all alike); the median run of each
is reported with its tokens per CPU-second of this process, and the median over repeats of the ratio of
8 threads to one call (in tokens/s, and in tokens per CPU-second).
Writes benchmarks/results/offline_threads.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.offline_throughput import median_run
from inference_engine import LLM, SamplingParams

PROMPTS = [
    "写一首关于春天的短诗",
    "用 Python 实现快速排序",
    "解释量子计算的基本原理",
    "写一个产品介绍",
    "生成周报模板",
    "如何优化深度学习模型的推理速度？",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
]


def one_call(llm: LLM, prompts: list[str], params: SamplingParams) -> int:
    return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))


def thread_per_prompt(llm: LLM, prompts: list[str], params: SamplingParams, workers: int) -> int:
    def process_single_prompt(prompt: str) -> int:
        return len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    with ThreadPoolExecutor(max_workers=workers) as executor:
        return sum(executor.map(process_single_prompt, prompts))


def one_after_another(llm: LLM, prompts: list[str], params: SamplingParams) -> int:
    return sum(one_call(llm, [p], params) for p in prompts)


def timed(run: Callable[[], int]) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    tokens = run()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["modes"])[::-1]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), sharey=True)
    panels = (
        ("generated tokens/s (median run)", [result["modes"][n]["tokens_per_s"] for n in names], "%.0f"),
        (
            "tokens/s relative to one call in the same repeat (median)",
            [result["relative"][n] for n in names],
            "%.2f",
        ),
        (
            "generated tokens per CPU-second (median run)",
            [result["modes"][n]["tokens_per_cpu_s"] for n in names],
            "%.0f",
        ),
    )
    for ax, (label, values, fmt) in zip(axes, panels, strict=True):
        ax.bar_label(ax.barh(names, values, color="tab:blue"), fmt=fmt)
        ax.set_xlabel(label)
    fig.suptitle(
        f"{result['max_tokens']} tokens per prompt, {result['dtype']}, {result['threads']} torch threads, "
        f"{result['repeats']} repeats, modes taking turns"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each mode, taking turns")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(dtype=args.dtype, device=args.device, log_stats_interval=0, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    one_call(llm, PROMPTS, SamplingParams(max_tokens=4))  # warm up
    modes: dict[str, Callable[[], int]] = {
        "one call, 8 prompts": lambda: one_call(llm, PROMPTS, params),
        "8 threads, 1 prompt each": lambda: thread_per_prompt(llm, PROMPTS, params, 8),
        **{
            f"task queue: 16 prompts, {w} workers": lambda w=w: thread_per_prompt(llm, PROMPTS * 2, params, w)
            for w in (2, 4, 8)
        },
        "8 calls one after another": lambda: one_after_another(llm, PROMPTS, params),
    }
    # Each repeat runs every mode once, starting one mode later than the repeat before, so no mode always
    # follows the same one; ratios to one call are taken within each repeat.
    names = list(modes)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            runs[name].append(timed(modes[name]))
            run = runs[name][-1]
            rates = f"{run['tokens_per_s']:.1f} tokens/s, {run['tokens_per_cpu_s']:.1f} per CPU-s"
            print(f"{name}: {rates}", flush=True)
    median = {name: median_run(r) for name, r in runs.items()}
    one = runs["one call, 8 prompts"]
    relative = {  # each mode's tokens/s over one call's in the same repeat: the machine's noise cancels
        name: statistics.median(
            r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(runs[name], one, strict=True)
        )
        for name in names
    }
    threads = runs["8 threads, 1 prompt each"]
    cpu_ratios = [t["tokens_per_cpu_s"] / o["tokens_per_cpu_s"] for t, o in zip(threads, one, strict=True)]
    result = {
        "dtype": args.dtype,
        "device": str(llm.llm_engine.runner.device),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "modes": median,
        "relative": relative,
        "threads_8_vs_one_call": relative["8 threads, 1 prompt each"],
        "threads_8_vs_one_call_per_repeat": [
            t["tokens_per_s"] / o["tokens_per_s"] for t, o in zip(threads, one, strict=True)
        ],
        "threads_8_vs_one_call_per_cpu_s": statistics.median(cpu_ratios),
        "all_runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_threads.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "offline_threads.png")
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}, indent=2))


if __name__ == "__main__":
    main()
