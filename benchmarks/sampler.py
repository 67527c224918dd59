"""Per-step sampling time: the previous per-row sampler against the batched one, in one process.

Three samplers run on the same logits, interleaved (old, new, new-torch, old, ...): the sampler of commit
502f816 (fp32 logits on the CPU, per-row top-k / top-p loops; loaded from git history), the batched sampler
on its native CPU kernel, and the batched sampler's PyTorch path (the code CUDA runs) on the CPU. Each call
is one engine step: `sampler(logits, seqs)` for a batch of unseeded sequences, metadata building included.

Logits: rows the bundled model (SmolLM2-135M, vocabulary 49,152) produced while generating at temperature
0.8. For the 128,256-token vocabulary each row gets 79,104 more tokens whose logits are drawn uniformly
between the row's minimum and its median (a larger vocabulary mostly adds rare tokens), and the columns are
shuffled. "flat" rows are N(0, 1) logits, the worst case for top-p alone (no token stands out, so the
nucleus holds most of the vocabulary).

Configurations: temperature 0.8 / top_p 0.95 / top_k 50; greedy; temperature 0.8 / top_p 0.95 on model
rows and on flat rows; at 2 threads and at 1 (on a shared machine a parallel region waits for its slowest
thread, so both are worth reading). Times are the median and minimum of the repeats after a warm-up call
(fewer where one old step takes seconds).

    .venv/bin/python -m benchmarks.sampler [--batches 1 32 256] [--vocabs 49152 128256] [--threads 2 1]
                                           [--skip-old]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from inference_engine import LLM, SamplingParams
from inference_engine.sampler import Sampler
from inference_engine.sequence import Sequence, SequenceGroup

REPO_ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "502f816"
PROMPTS = [
    "Write a short poem about the sea:",
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nGive me three tips for a job interview.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "The main causes of inflation are",
    "SELECT name, COUNT(*) FROM orders",
    "Translate to French: 'Good morning, how are you?' ->",
]
CONFIGS = {
    "t0.8_k50_p0.95": ("model", SamplingParams(temperature=0.8, top_p=0.95, top_k=50)),
    "greedy": ("model", SamplingParams(temperature=0.0)),
    "t0.8_p0.95": ("model", SamplingParams(temperature=0.8, top_p=0.95)),
    "t0.8_p0.95_flat": ("flat", SamplingParams(temperature=0.8, top_p=0.95)),
}


def load_old_sampler() -> type:
    """The Sampler class of OLD_COMMIT, compiled from `git show` into a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "show", f"{OLD_COMMIT}:inference_engine/sampler.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType(f"sampler_{OLD_COMMIT}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{OLD_COMMIT}:inference_engine/sampler.py", "exec"), module.__dict__)
    return module.Sampler


def model_rows() -> torch.Tensor:
    """Logits rows of the bundled model generating at temperature 0.8 (recorded at the sampler's call)."""
    llm = LLM(dtype="float32", seed=0)
    recorded = []
    sampler = llm.engine.sampler

    def recording(logits: torch.Tensor, seqs: list[Sequence]):
        recorded.append(logits.clone())
        return sampler(logits, seqs)

    llm.engine.sampler = recording
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=48, seed=0), use_tqdm=False)
    return torch.cat(recorded)


def widen(rows: torch.Tensor, vocab: int, gen: torch.Generator) -> torch.Tensor:
    extra = vocab - rows.shape[1]
    if extra <= 0:
        return rows[:, :vocab].contiguous()
    low = rows.min(dim=1, keepdim=True).values
    median = rows.median(dim=1, keepdim=True).values
    tail = low + (median - low) * torch.rand(len(rows), extra, generator=gen)
    return torch.cat([rows, tail], dim=1)[:, torch.randperm(vocab, generator=gen)].contiguous()


def logits_for(kind: str, rows: torch.Tensor, batch: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(batch, vocab, generator=gen)
    picked = rows[torch.randint(len(rows), (batch,), generator=gen)]
    return widen(picked, vocab, gen)


def sequences(params: SamplingParams, batch: int) -> list[Sequence]:
    seqs = []
    for i in range(batch):
        group = SequenceGroup(f"r{i}", None, [1, 2, 3], params)
        seq = Sequence(i, group, [1, 2, 3, 4], 3)
        group.seqs.append(seq)
        seqs.append(seq)
    return seqs


def time_step(sampler, logits: torch.Tensor, seqs: list[Sequence]) -> float:
    start = time.perf_counter()
    sampler(logits, seqs)
    return (time.perf_counter() - start) * 1e3


def run(
    batches: list[int], vocabs: list[int], threads: list[int], repeats: int, skip_old: bool
) -> list[dict]:
    rows = model_rows()
    samplers = {"new": Sampler([2], seed=0), "new-torch": Sampler([2], seed=0, use_native=False)}
    if not skip_old:
        samplers = {"old": load_old_sampler()([2], 0), **samplers}
    results = []
    for num_threads, vocab, batch, name in itertools.product(threads, vocabs, batches, CONFIGS):
        torch.set_num_threads(num_threads)
        kind, params = CONFIGS[name]
        logits = logits_for(kind, rows, batch, vocab, seed=batch + vocab)
        seqs = sequences(params, batch)
        times: dict[str, list[float]] = {impl: [] for impl in samplers}
        for impl, sampler in samplers.items():  # warm-up, and a first measure of the cost
            times[impl].append(time_step(sampler, logits, seqs))
        for _ in range(repeats):
            for impl, sampler in samplers.items():
                if sum(times[impl]) < 3000:  # steps of seconds: fewer repeats
                    times[impl].append(time_step(sampler, logits, seqs))
        for impl, measured in times.items():
            warm = measured[1:] or measured
            result = {
                "threads": num_threads,
                "vocab": vocab,
                "batch": batch,
                "config": name,
                "impl": impl,
                "median_ms": round(statistics.median(warm), 3),
                "min_ms": round(min(warm), 3),
                "runs": len(warm),
            }
            results.append(result)
            print(json.dumps(result), flush=True)
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["threads"], r["vocab"]) for r in results})
    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, axes = plt.subplots(
        len(panels), len(CONFIGS), figsize=(4 * len(CONFIGS), 3.4 * len(panels)), squeeze=False
    )
    for row, (threads, vocab) in enumerate(panels):
        for col, config in enumerate(CONFIGS):
            ax = axes[row][col]
            found = {
                (r["batch"], r["impl"]): r["median_ms"]
                for r in results
                if (r["threads"], r["vocab"], r["config"]) == (threads, vocab, config)
            }
            batches = sorted({b for b, _ in found})
            width = 0.8 / len(impls)
            for i, impl in enumerate(impls):
                values = [found.get((b, impl), float("nan")) for b in batches]
                ax.bar([x + i * width for x in range(len(batches))], values, width, label=impl)
            ax.axhline(20, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(batches))], batches)
            ax.set_yscale("log")
            ax.set_title(f"{config}, vocab {vocab:,}, {threads} thread(s)", fontsize=9)
            ax.set_xlabel("batch")
            ax.set_ylabel("ms per step (median)")
            ax.legend(fontsize=7)
    fig.suptitle("Sampling time per engine step (dashed: 20 ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--skip-old", action="store_true", help="only the batched sampler")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    results = run(args.batches, args.vocabs, args.threads, args.repeats, args.skip_old)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"cpu": cpu_model(), "old_commit": OLD_COMMIT, "results": results}
    (args.out / "sampler.json").write_text(json.dumps(summary, indent=2))
    plot(results, args.out / "sampler.png")
    print(f"wrote {args.out / 'sampler.json'} and {args.out / 'sampler.png'}")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.machine()


if __name__ == "__main__":
    main()
