"""Decode step time of every architecture family against the Llama path's, at the same shapes, on the CPU.

    python -m benchmarks.families [--layers 30] [--batches 1 16] [--rounds 3] [--out DIR]

Each family's random checkpoint (`benchmarks.random_families`, the bundled model's layer shape by default:
hidden 576, 9 query / 3 KV heads of 64, MLP 1536, a window of 4,096 tokens for the sliding families) is
written once under ~/.cache/llmserve/bench-families. Every family then decodes `batch` sequences of a
64-token prompt in bf16, the median step time of a run kept (with `--threads 1`, the CPU time of the
thread that runs the step, which other processes on the machine do not inflate); each family and the
Llama checkpoint (loaded once) take turns `--rounds` times and the fastest run of each counts, since this
machine's speed drifts within minutes. Writes families.json and families.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks import random_families
from inference_engine import LLM, SamplingParams

CACHE = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve")) / "bench-families"
BASELINE = "llama3"
PROMPT_TOKENS = 64


def checkpoint(family: str, layers: int) -> Path:
    from tests.engine.quant_checkpoints import TOKENIZER_FILES, dense_folder

    folder = CACHE / f"{family}-{layers}"
    if not (folder / "config.json").exists():
        shape = dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
        )
        random_families.write_family(folder, family, shape, window=4096, original_context=4096)
        for name in TOKENIZER_FILES:
            (folder / name).write_bytes((dense_folder() / name).read_bytes())
    return folder


def step_ms(llm: LLM, batch: int, steps: int) -> float:
    """Median time of a decode step with `batch` sequences: the CPU time of the calling thread where torch
    runs on it alone (one thread: what the step costs, whoever else shares the machine), else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, prompt, params)
    for _ in range(4):  # the prompts, then warm decode steps
        engine.step()
    times = []
    for _ in range(steps):
        start = clock()
        engine.step()
        times.append(clock() - start)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * statistics.median(times)


def build(family: str, layers: int, batches: list[int]) -> LLM:
    llm = LLM(model=str(checkpoint(family, layers)), dtype="bfloat16", max_num_seqs=max(batches), seed=0)
    native = llm.llm_engine.runner.model.model.native is not None
    print(f"{family:12s} native decoder {'yes' if native else 'no'}")
    return llm


def compare(base: LLM, other: LLM, batches: list[int], steps: int, rounds: int) -> tuple[dict, dict]:
    """The fastest step time of each engine at each batch over `rounds` turns taken in alternation: the
    least disturbed run of each, on a machine whose other work comes and goes."""
    best_base = {b: float("inf") for b in batches}
    best_other = dict(best_base)
    for _ in range(rounds):
        for batch in batches:
            best_base[batch] = min(best_base[batch], step_ms(base, batch, steps))
            best_other[batch] = min(best_other[batch], step_ms(other, batch, steps))
    return best_base, best_other


def plot(rows: list[dict], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["ratio"][str(batch)] for r in rows], width, label=f"batch {batch}")
    ax.axhline(1.15, color="red", linestyle="--", label="1.15x")
    ax.set_xticks([j + width * (len(batches) - 1) / 2 for j in range(len(rows))], [r["family"] for r in rows])
    ax.set_ylabel("step time / Llama's")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating turns; the fastest counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--families", nargs="+", default=None, help="default: every family but the baseline")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.families or [f for f in random_families.families(4096, 4096) if f != BASELINE]
    base = build(BASELINE, args.layers, args.batches)
    rows = []
    for family in names:
        other = build(family, args.layers, args.batches)
        llama, ours = compare(base, other, args.batches, args.steps, args.rounds)
        rows.append(
            {
                "family": family,
                "native_decoder": other.llm_engine.runner.model.model.native is not None,
                "step_ms": {str(b): ours[b] for b in args.batches},
                "llama_step_ms": {str(b): llama[b] for b in args.batches},
                "ratio": {str(b): ours[b] / llama[b] for b in args.batches},
            }
        )
        del other
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "layers": args.layers,
        "threads": args.threads,
        "rounds": args.rounds,
        "baseline": BASELINE,
        "families": rows,
    }
    (args.out / "families.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.batches, args.out / "families.png")
    print(f"{'family':12s} " + " ".join(f"{'batch ' + str(b):>22s}" for b in args.batches))
    for row in rows:
        cells = [
            f"{row['step_ms'][str(b)]:6.2f}/{row['llama_step_ms'][str(b)]:6.2f} {row['ratio'][str(b)]:5.2f}x"
            for b in args.batches
        ]
        print(f"{row['family']:12s} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
