"""Offline generation from threads: the seeds' task-queue example (001, section 7.2) against one call.

    .venv/bin/python -m benchmarks.offline_threads [--dtype bfloat16] [--threads 2] [--max-tokens 64]

The same 8 prompts, each generating the same number of tokens (ignore_eos), run as
- one `llm.generate(prompts)` call (the batch the engine is built for);
- 8 threads each calling `llm.generate([prompt])` at once: they join the engine loop's one batch;
- the task queue of the seeds: 16 prompts through a ThreadPoolExecutor of 2, 4 and 8 workers;
- one call after another (what the threads would get if calls took turns).
Every mode takes its turn in each repeat (so a noisy neighbour slows all alike); the median run of each
is reported, and the ratio of 8 threads to one call. Writes benchmarks/results/offline_threads.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

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
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["modes"])
    values = [result["modes"][n]["tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bars = ax.barh(names[::-1], values[::-1], color="tab:blue")
    ax.bar_label(bars, fmt="%.0f")
    ax.set_xlabel("generated tokens/s (median run)")
    ratio = result["threads_8_vs_one_call"]
    ax.set_title(
        f"{result['max_tokens']} tokens per prompt, {result['dtype']}, {result['threads']} torch threads, "
        f"median of {result['repeats']} — 8 threads / one call = {ratio:.2f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, taking turns")
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
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, run in modes.items():
            runs[name].append(timed(run))
            print(name, f"{runs[name][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    median = {name: sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for name, r in runs.items()}
    result = {
        "dtype": args.dtype,
        "device": str(llm.llm_engine.runner.device),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "modes": median,
        "threads_8_vs_one_call": median["8 threads, 1 prompt each"]["tokens_per_s"]
        / median["one call, 8 prompts"]["tokens_per_s"],
        "all_runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_threads.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "offline_threads.png")
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}, indent=2))


if __name__ == "__main__":
    main()
