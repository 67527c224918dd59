"""A mixture-of-experts model in our engine and in llama.cpp's server, on the same GGUF file, in one run.

    .venv/bin/python -m benchmarks.moe [--threads 2] [--repeats 3] [--decode-tokens 96] [--requests 32]

The file is a random Qwen3-MoE-shaped model (`benchmarks/random_moe.py`: 64 experts of 384 features, top-8,
12 layers of width 2048; 1.9 GB of Q8_0 experts, so they cannot sit in the cache), written once under
~/.cache/llmserve. Our engine reads it as it is (Q8_0 kept int8, experts in the fused CPU kernel), greedy;
llama.cpp's server reads the same file with the same threads. The two take turns (A, B, A, B ...) so a busy
neighbour slows both alike; the median run of each is reported. Measured:

- decode time per token at batch 1 (`--decode-tokens` tokens, ignore_eos): ours the median engine step after
  the prefill, llama.cpp's its own `predicted_per_token_ms`.
- tokens/s on the mixed workload (`benchmarks/workload.py`), every request arriving at once; llama.cpp's
  server gets a slot per request, so it batches them all too.
- the active-parameter floor: the bytes a decode step must read (every tensor of the file but the expert
  stacks and the embedding, plus top-k / experts of each expert stack) over the machine's read bandwidth,
  measured before each of our batch-1 runs; the fastest read of the run gives the floor.

Targets (issue 58): batch-1 time at most llama.cpp's, the mixed workload at least 2x llama.cpp's tokens/s,
and batch-1 time within 1.3x of the floor. Writes `benchmarks/results/moe.json` and `moe.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import gguf
import torch

from benchmarks.llamacpp import LlamaCppUnavailable, LlamaServer, build_server
from benchmarks.offline_throughput import measure_read_bandwidth, median_run, run_engine
from benchmarks.quantized import engine_decode, llamacpp_decode, llamacpp_workload
from benchmarks.random_moe import MoeShape, random_qwen3_moe
from benchmarks.workload import mixed_workload
from inference_engine import LLM, SamplingParams
from inference_engine.engine_loop import on_a_thread_that_ends

CTX_PER_SLOT = 1024  # the longest workload request: a ~500-token prompt and 192 tokens


def active_bytes(path: Path, top_k: int) -> dict[str, int]:
    """Bytes of the file a decode step reads, by kind: the expert stacks' top-k share, the rest but the
    embedding (of which a step reads one row)."""
    experts = other = 0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if "_exps" in tensor.name:
            experts += int(tensor.n_bytes) * top_k // int(tensor.shape[-1])  # shape[-1]: the expert count
        elif tensor.name != "token_embd.weight":
            other += int(tensor.n_bytes)
    return {"experts": experts, "other": other, "total": experts + other}


def decode_with_experts_share(llm: LLM, tokens: int) -> dict:
    """`engine_decode`, with the mean time per token spent in the fused expert kernel (prefill's included)."""
    model = llm.engine.runner.model
    before = model.moe_seconds
    decode = engine_decode(llm, tokens)
    return {**decode, "experts_ms_per_token": 1000 * (model.moe_seconds - before) / tokens}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, theirs = result["engine"], result.get("llama_cpp", {})
    have_theirs = "decode" in theirs
    names = ["llmserve", "llama.cpp"] if have_theirs else ["llmserve"]
    colors = ["tab:blue", "tab:orange"][: len(names)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    decode = [ours["decode"]["ms_per_token"]] + ([theirs["decode"]["ms_per_token"]] if have_theirs else [])
    axes[0].bar(names, decode, color=colors)
    floor = result["active_floor_ms"]
    axes[0].axhline(floor, color="k", linestyle="--", label=f"active-parameter floor {floor:.1f} ms")
    axes[0].axhline(1.3 * floor, color="gray", linestyle=":", label="1.3x the floor")
    axes[0].legend(fontsize=8)
    axes[0].set_title("decode ms/token at batch 1 (lower is better)")
    mixed = [ours["workload"]["tokens_per_s"]] + ([theirs["workload"]["tokens_per_s"]] if have_theirs else [])
    axes[1].bar(names, mixed, color=colors)
    axes[1].set_title(f"mixed workload tokens/s ({result['workload']})")
    note = "" if have_theirs else f" — llama.cpp skipped: {theirs.get('skipped', '')[:60]}"
    fig.suptitle(
        f"{result['model']}, {result['threads']} threads, median of {result['repeats']} runs{note}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads, ours and llama.cpp's")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, taking turns")
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, default=32, help="requests in the mixed workload")
    parser.add_argument("--skip-workload", action="store_true", help="batch 1 and the floor only")
    parser.add_argument("--skip-llamacpp", action="store_true", help="our engine and the floor only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    shape = MoeShape()
    # Written on a thread that ends, so that this thread keeps no OpenMP pool beside the engine's.
    model = on_a_thread_that_ends(lambda: random_qwen3_moe(shape))
    read = active_bytes(model, shape.top_k)
    requests = mixed_workload(args.requests)

    started = time.perf_counter()
    llm = LLM(model=str(model), log_stats_interval=0)  # Q8_0 kept int8
    load_seconds = time.perf_counter() - started
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    try:
        if args.skip_llamacpp:
            raise LlamaCppUnavailable("--skip-llamacpp")
        binary, skipped = build_server(), None
    except LlamaCppUnavailable as exc:
        binary, skipped = None, str(exc)
        print(f"llama.cpp half skipped: {skipped}", flush=True)

    runs: dict[str, list[dict]] = {
        k: [] for k in ("engine_decode", "engine_workload", "llama_decode", "llama_workload")
    }
    bandwidths = []
    for _ in range(args.repeats):
        bandwidths.append(measure_read_bandwidth(torch.device("cpu")))
        runs["engine_decode"].append(
            {
                **decode_with_experts_share(llm, args.decode_tokens),
                "floor_ms": 1000 * read["total"] / bandwidths[-1],
            }
        )
        print(f"ours decode: {runs['engine_decode'][-1]}", flush=True)
        if binary is not None:
            with LlamaServer(model, ctx_per_slot=CTX_PER_SLOT, threads=args.threads, binary=binary) as s:
                s.complete("warm up", 4)
                runs["llama_decode"].append({**llamacpp_decode(s, args.decode_tokens), "repack": s.repack})
            print(f"llama.cpp decode: {runs['llama_decode'][-1]}", flush=True)
        if args.skip_workload:
            continue
        runs["engine_workload"].append(run_engine(llm, requests))
        print(f"ours workload: {runs['engine_workload'][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
        if binary is not None:
            with LlamaServer(
                model, parallel=len(requests), ctx_per_slot=CTX_PER_SLOT, threads=args.threads, binary=binary
            ) as s:
                s.complete("warm up", 4)
                runs["llama_workload"].append({**llamacpp_workload(s, requests), "repack": s.repack})
            print(
                f"llama.cpp workload: {runs['llama_workload'][-1]['tokens_per_s']:.1f} tokens/s", flush=True
            )

    bandwidth = max(bandwidths)  # the fastest read of the run: the strictest floor
    ours = {"decode": median_run(runs["engine_decode"], "ms_per_token")}
    if runs["engine_workload"]:
        ours["workload"] = median_run(runs["engine_workload"], "tokens_per_s")
    floor_ms = 1000 * read["total"] / bandwidth
    result = {
        "model": model.name,
        "shape": dataclasses.asdict(shape),
        "file_bytes": model.stat().st_size,
        "dtype": str(llm.engine.runner.dtype),
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
        "workload": f"{len(requests)} requests, {sum(r.is_short for r in requests)} short",
        "engine_load_seconds": load_seconds,
        # Other processes' load during the run (1, 5, 15-minute averages before and after it).
        "machine_load_average": {"before": load_before, "after": os.getloadavg()},
        "active_bytes_per_token": read,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "active_floor_ms": floor_ms,
        "engine": ours,
        "decode_over_active_floor": ours["decode"]["ms_per_token"] / floor_ms,
        "all_runs": runs,
    }
    if binary is None:
        result["llama_cpp"] = {"skipped": skipped}
    else:
        theirs = {"binary": str(binary), "decode": median_run(runs["llama_decode"], "ms_per_token")}
        result["decode_ratio_ours_over_llama_cpp"] = (
            ours["decode"]["ms_per_token"] / theirs["decode"]["ms_per_token"]
        )
        if runs["llama_workload"]:
            theirs["workload"] = median_run(runs["llama_workload"], "tokens_per_s")
            result["workload_speedup_over_llama_cpp"] = (
                ours["workload"]["tokens_per_s"] / theirs["workload"]["tokens_per_s"]
            )
        result["llama_cpp"] = theirs
    result["targets_met"] = {
        "decode_at_most_llama_cpp": result.get("decode_ratio_ours_over_llama_cpp", float("inf")) <= 1.0,
        "workload_at_least_2x_llama_cpp": result.get("workload_speedup_over_llama_cpp", 0.0) >= 2.0,
        "decode_within_1_3x_active_floor": result["decode_over_active_floor"] <= 1.3,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps(result, indent=2))
    if "workload" in ours:
        plot(result, args.out / "moe.png")
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}, indent=2))


if __name__ == "__main__":
    main()
