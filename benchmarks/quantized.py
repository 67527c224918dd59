"""The bundled Q4_1 GGUF file in our engine (kept quantized) and in llama.cpp's server, in one run.

    .venv/bin/python -m benchmarks.quantized [--threads 2] [--repeats 3] [--decode-tokens 128]

Both read the same file with the same number of threads, and the two take turns (A, B, A, B ...), so a
busy neighbour slows both alike; the median run of each is reported. Measured:

- decode time per token at batch 1: one request generating `--decode-tokens` tokens (ignore_eos). Ours
  is the median engine step after the prefill; llama.cpp's is its own `predicted_per_token_ms`.
- tokens/s on the mixed workload of `benchmarks/offline_throughput.py` (`benchmarks/workload.py`): every
  request arrives at once; llama.cpp's server gets one slot per request, so it batches them all too.
- resident weight bytes of our engine against the model's bf16 size and the file's, and the engine
  process's RSS; and the resident weight bytes of the same model with every tensor in Q4_0 (the bundled
  file keeps its tied embedding / LM head, a fifth of the weights, in Q8_0), quantized by `gguf`.

llama.cpp's server is built once from llama-cpp-python's source distribution (`benchmarks/llamacpp.py`);
where it cannot be built the llama.cpp half is skipped and the JSON says why. Writes
`benchmarks/results/quantized.json` and `quantized.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import torch

from benchmarks.gguf_files import rewritten
from benchmarks.llamacpp import LlamaCppUnavailable, LlamaServer, build_server
from benchmarks.offline_throughput import median_run, run_engine
from benchmarks.workload import Request, mixed_workload
from inference_engine import LLM, SamplingParams
from inference_engine.engine_loop import on_a_thread_that_ends
from inference_engine.model_loader import default_model_path

DECODE_PROMPT = "Tell me a long story about the sea."


def engine_decode(llm: LLM, tokens: int) -> dict:
    engine = llm.engine
    assert llm.reset_prefix_cache()
    engine.add_request(
        "solo", DECODE_PROMPT, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    )
    engine.step()  # prefill and the first token
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return {
        "ms_per_token": 1000 * statistics.median(steps),
        "mean_ms_per_token": 1000 * statistics.mean(steps),
    }


def llamacpp_decode(server: LlamaServer, tokens: int) -> dict:
    timings = server.complete(DECODE_PROMPT, tokens)["timings"]
    return {"ms_per_token": timings["predicted_per_token_ms"], "predicted_n": timings["predicted_n"]}


def llamacpp_workload(server: LlamaServer, requests: list[Request]) -> dict:
    start = time.time()
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: server.complete(r.prompt, r.max_tokens), requests))
    elapsed = time.time() - start
    tokens = sum(a["tokens_predicted"] for a in answers)
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, theirs = result["engine"], result.get("llama_cpp", {})
    have_theirs = "decode" in theirs
    names = ["llmserve (Q4_1)", "llama.cpp (Q4_1)"] if have_theirs else ["llmserve (Q4_1)"]
    colors = ["tab:blue", "tab:orange"][: len(names)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    decode = [ours["decode"]["ms_per_token"]] + ([theirs["decode"]["ms_per_token"]] if have_theirs else [])
    axes[0].bar(names, decode, color=colors)
    axes[0].set_title("decode ms/token at batch 1 (lower is better)")
    mixed = [ours["workload"]["tokens_per_s"]] + ([theirs["workload"]["tokens_per_s"]] if have_theirs else [])
    axes[1].bar(names, mixed, color=colors)
    axes[1].set_title("mixed workload tokens/s")
    memory = result["memory"]
    labels = ["bf16 size", "GGUF file", "engine weights", "all-Q4_0 file", "engine weights\n(all-Q4_0)"]
    pure = memory["all_q4_0"]
    values = [
        memory["bf16_bytes"],
        memory["file_bytes"],
        memory["engine_weight_bytes"],
        pure["file_bytes"],
        pure["engine_weight_bytes"],
    ]
    colors = ["tab:gray", "tab:orange", "tab:blue", "tab:orange", "tab:blue"]
    axes[2].bar(labels, [v / 2**20 for v in values], color=colors)
    axes[2].tick_params(axis="x", labelsize=7)
    axes[2].set_title("weights (MiB)")
    note = "" if have_theirs else f" — llama.cpp skipped: {theirs.get('skipped', '')[:60]}"
    fig.suptitle(f"{result['model']}, {result['threads']} threads, median of {result['repeats']} runs{note}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads, ours and llama.cpp's")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, taking turns")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32, help="requests in the mixed workload")
    parser.add_argument("--dtype", default="auto", help="our engine's activation dtype")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model = default_model_path()
    requests = mixed_workload(args.requests)

    started = time.perf_counter()
    llm = LLM(dtype=args.dtype, log_stats_interval=0)  # the file's own quantization: kept as Q4_1 / Q8_0
    load_seconds = time.perf_counter() - started
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    try:
        binary = build_server()
        skipped = None
    except LlamaCppUnavailable as exc:
        binary, skipped = None, str(exc)
        print(f"llama.cpp half skipped: {skipped}")

    runs: dict[str, list[dict]] = {
        "engine_decode": [],
        "engine_workload": [],
        "llama_decode": [],
        "llama_workload": [],
    }
    ctx_per_slot = 1024  # the longest workload request: a ~500-token prompt and 192 tokens
    for _ in range(args.repeats):
        runs["engine_decode"].append(engine_decode(llm, args.decode_tokens))
        if binary is not None:
            with LlamaServer(
                model, parallel=1, ctx_per_slot=ctx_per_slot, threads=args.threads, binary=binary
            ) as s:
                s.complete("warm up", 4)
                runs["llama_decode"].append({**llamacpp_decode(s, args.decode_tokens), "repack": s.repack})
        runs["engine_workload"].append(run_engine(llm, requests))
        if binary is not None:
            with LlamaServer(
                model, parallel=len(requests), ctx_per_slot=ctx_per_slot, threads=args.threads, binary=binary
            ) as s:
                s.complete("warm up", 4)
                runs["llama_workload"].append({**llamacpp_workload(s, requests), "repack": s.repack})

    dtype = str(llm.engine.runner.dtype)
    memory = {
        "engine_weight_bytes": llm.engine.runner.weight_bytes,
        "bf16_bytes": 2 * llm.engine.runner.model_config.num_parameters,
        "file_bytes": model.stat().st_size,
        "engine_rss_bytes": _rss_bytes(),
    }
    memory["weights_vs_bf16"] = memory["engine_weight_bytes"] / memory["bf16_bytes"]
    del llm
    pure = on_a_thread_that_ends(lambda: rewritten(gguf.GGMLQuantizationType.Q4_0))
    memory["all_q4_0"] = {
        "file_bytes": pure.stat().st_size,
        "engine_weight_bytes": LLM(model=str(pure), dtype=args.dtype).engine.runner.weight_bytes,
    }
    memory["all_q4_0"]["weights_vs_bf16"] = memory["all_q4_0"]["engine_weight_bytes"] / memory["bf16_bytes"]
    result = {
        "model": model.name,
        "dtype": dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
        "workload": f"{len(requests)} requests, {sum(r.is_short for r in requests)} short",
        "engine_load_seconds": load_seconds,
        # Other processes' load during the run (1, 5, 15-minute averages before and after it).
        "machine_load_average": {"before": load_before, "after": os.getloadavg()},
        "engine": {
            "decode": median_run(runs["engine_decode"], "ms_per_token"),
            "workload": median_run(runs["engine_workload"], "tokens_per_s"),
        },
        "memory": memory,
        "all_runs": runs,
    }
    if binary is None:
        result["llama_cpp"] = {"skipped": skipped}
    else:
        theirs = {
            "binary": str(binary),
            "decode": median_run(runs["llama_decode"], "ms_per_token"),
            "workload": median_run(runs["llama_workload"], "tokens_per_s"),
        }
        result["llama_cpp"] = theirs
        ours = result["engine"]
        result["decode_ratio_ours_over_llama_cpp"] = (
            ours["decode"]["ms_per_token"] / theirs["decode"]["ms_per_token"]
        )
        result["workload_speedup_over_llama_cpp"] = (
            ours["workload"]["tokens_per_s"] / theirs["workload"]["tokens_per_s"]
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantized.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "quantized.png")
    print(json.dumps({k: v for k, v in result.items() if k != "all_runs"}, indent=2))


if __name__ == "__main__":
    main()
