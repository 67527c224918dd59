"""Structured outputs: the mixed workload with every request held to a JSON schema, against the same workload
unconstrained, in one run.

    .venv/bin/python -m benchmarks.structured [--dtype bfloat16] [--threads 2] [--repeats 3]

The workload is benchmarks/workload.py's (20 % short answers of 48 tokens, 80 % long summaries of 192, all
arriving at once, greedy). Constrained, each request answers as ``{"title", "topics", "summary"}`` (one of
four schemas, so the grammar cache holds a few), and the summary's ``minLength`` keeps every answer going to
its max_tokens, so both runs generate exactly the same number of tokens. The two take turns, and the
median run of each is compared. Also reported: per step, the time the mask thread spent filling the
constrained rows' masks (it overlaps the model's forward pass), the part of it the step still waited for
after the forward pass, and the time to apply a step's masks to the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.offline_throughput import median_run
from benchmarks.workload import Request, mixed_workload
from inference_engine import LLM, SamplingParams
from inference_engine.sampler import TokenBitmask, apply_token_bitmask

TOPICS = ["transport", "budget", "cycling", "noise", "consultation", "funding", "repairs", "business"]


def schema(variant: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40 + 10 * variant},
            "topics": {"type": "array", "items": {"enum": TOPICS}, "maxItems": 1 + variant},
            "summary": {"type": "string", "minLength": 4000},  # longer than any max_tokens here
        },
        "required": ["title", "topics", "summary"],
        "additionalProperties": False,
    }


def run(llm: LLM, requests: list[Request], constrained: bool) -> dict:
    engine = llm.engine
    structured = engine.structured
    assert llm.reset_prefix_cache()
    filled, waited, rows = structured.mask_seconds, structured.mask_wait_seconds, structured.mask_rows
    start = time.perf_counter()
    for i, req in enumerate(requests):
        params = SamplingParams(
            temperature=0,
            max_tokens=req.max_tokens,
            ignore_eos=True,
            structured_outputs={"json": schema(i % 4)} if constrained else None,
        )
        engine.add_request(str(i), req.prompt, params)
    steps, tokens = 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    elapsed = time.perf_counter() - start
    result = {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed, "steps": steps}
    if constrained:
        result |= {
            "mask_fill_ms_per_step": 1e3 * (structured.mask_seconds - filled) / steps,
            "mask_wait_ms_per_step": 1e3 * (structured.mask_wait_seconds - waited) / steps,
            "masks_per_step": (structured.mask_rows - rows) / steps,
        }
    return result


def mask_apply_ms(vocab: int, rows: int, repeats: int = 50) -> float:
    """Time to apply `rows` masks to [rows, vocab] fp32 logits, as the sampler does each step."""
    logits = torch.randn(rows, vocab)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    mask = TokenBitmask(list(range(rows)), bits)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        apply_token_bitmask(logits, mask)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain, constrained = result["unconstrained"], result["constrained"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(["unconstrained", "JSON schema"], [plain["tokens_per_s"], constrained["tokens_per_s"]])
    axes[0].set_title(f"generated tokens/s (ratio {result['ratio']:.2f})")
    parts = {
        "mask fill (overlapped)": constrained["mask_fill_ms_per_step"],
        "wait after forward": constrained["mask_wait_ms_per_step"],
        "apply to logits": result["mask_apply_ms_per_step"],
        "whole step": 1e3 * constrained["seconds"] / constrained["steps"],
    }
    axes[1].bar(list(parts), list(parts.values()), color=["tab:orange", "tab:red", "tab:purple", "tab:gray"])
    axes[1].set_title("ms per step (constrained run)")
    axes[1].tick_params(axis="x", labelrotation=20)
    setup = f"{result['dtype']}, {result['threads']} threads, median of {result['repeats']}"
    fig.suptitle(f"{result['workload']} — {setup}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, taking turns")
    parser.add_argument("--quantization", default="none", help="default: dense weights")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    requests = mixed_workload(args.requests)
    llm = LLM(dtype=args.dtype, quantization=args.quantization, log_stats_interval=0)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)

    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for repeat in range(args.repeats):
        order = ("unconstrained", "constrained") if repeat % 2 == 0 else ("constrained", "unconstrained")
        for name in order:
            runs[name].append(run(llm, requests, constrained=name == "constrained"))
    median = {name: median_run(results) for name, results in runs.items()}
    assert median["constrained"]["tokens"] == median["unconstrained"]["tokens"]
    batch = round(median["constrained"]["masks_per_step"])
    result = {
        "workload": f"{len(requests)} requests, {sum(r.is_short for r in requests)} short",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "threads": args.threads,
        "repeats": args.repeats,
        "unconstrained": median["unconstrained"],
        "constrained": median["constrained"],
        "ratio": median["constrained"]["tokens_per_s"] / median["unconstrained"]["tokens_per_s"],
        "mask_apply_ms_per_step": mask_apply_ms(llm.engine.structured.vocab_size, max(1, batch)),
        "all_runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "structured.png")
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}, indent=2))


if __name__ == "__main__":
    main()
