"""Offline throughput: our engine against Hugging Face transformers static batching, in one run.

    .venv/bin/python -m benchmarks.offline_throughput [--dtype bfloat16] [--threads 2] [--repeats 3]

The mixed workload (benchmarks/workload.py) arrives all at once. Our engine batches it continuously;
transformers runs it in submission order in static batches of 8, left-padded, each batch running until
its longest request ends (the "collective wait" of the case study). Both use the same model file and
dtype. Reports generated tokens/s, mean latency of short and of long requests, peak KV usage and KV
waste (allocated but unused token slots as a share of allocated, over all steps), and the decode step
time at batch 1 against the floor of reading every weight once per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.workload import Request, mixed_workload
from inference_engine import LLM, SamplingParams
from inference_engine.engine_loop import on_a_thread_that_ends
from inference_engine.model_loader import default_model_path
from llmserve_kernels.cpu.huge_pages import on_huge_pages

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 0}


def run_engine(llm: LLM, requests: list[Request], sampling: dict | None = None) -> dict:
    """Greedy unless `sampling` gives SamplingParams fields (every request still runs to its max_tokens)."""
    engine = llm.engine
    bm = engine.block_manager
    assert llm.reset_prefix_cache()  # a repeat must not find the previous run's prompts cached
    start = time.time()
    for i, req in enumerate(requests):
        engine.add_request(
            str(i),
            req.prompt,
            SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, **(sampling or {"temperature": 0})),
        )
    finished, allocated, unused, peak = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        # Slots held by running sequences versus slots holding a computed token (or the next one).
        seqs = engine.scheduler.running
        held = sum(len(s.block_table) for s in seqs) * bm.block_size
        allocated += held
        unused += held - sum(min(len(s), len(s.block_table) * bm.block_size) for s in seqs)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    elapsed = time.time() - start
    latencies = {i: out.metrics.finished_time - start for i, out in finished.items()}
    tokens = sum(len(out.outputs[0].token_ids) for out in finished.values())
    return {
        "seconds": elapsed,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        **_latency_summary(requests, latencies),
        "peak_kv_blocks": peak,
        "peak_kv_usage": peak / bm.num_blocks,
        "peak_kv_tokens": peak * bm.block_size,
        "kv_waste": unused / allocated,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_static(model, tokenizer, requests: list[Request], batch_size: int) -> dict:
    start = time.time()
    latencies, tokens, allocated, used = {}, 0, 0, 0
    pad = tokenizer.eos_token_id
    for first in range(0, len(requests), batch_size):
        batch = list(enumerate(requests))[first : first + batch_size]
        ids = [tokenizer.encode(req.prompt) for _, req in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=model.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
        new = max(req.max_tokens for _, req in batch)
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        done = time.time() - start
        for (i, req), x in zip(batch, ids, strict=True):
            latencies[i] = done
            tokens += req.max_tokens
            used += len(x) + req.max_tokens
        allocated += len(batch) * (
            width + new
        )  # every row's cache spans the padded prompt plus the longest answer
    elapsed = time.time() - start
    return {
        "seconds": elapsed,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        **_latency_summary(requests, latencies),
        "kv_waste": 1 - used / allocated,
    }


def median_run(runs: list[dict], key: str = "tokens_per_s") -> dict:
    """The run with the median `key` (a real run, so its numbers stay consistent with each other)."""
    return sorted(runs, key=lambda run: run[key])[len(runs) // 2]


def _latency_summary(requests: list[Request], latencies: dict[int, float]) -> dict:
    short = [latencies[i] for i, r in enumerate(requests) if r.is_short]
    long = [latencies[i] for i, r in enumerate(requests) if not r.is_short]
    return {"mean_latency_short_s": statistics.mean(short), "mean_latency_long_s": statistics.mean(long)}


def decode_step_vs_floor(llm: LLM) -> dict:
    """Median decode step at batch 1, and the time to read every weight once at measured bandwidth."""
    engine = llm.engine
    engine.add_request(
        "solo", "Tell me a long story about the sea.", SamplingParams(max_tokens=64, ignore_eos=True)
    )
    engine.step()  # prefill
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    weights = step_read_bytes(engine.runner)
    bandwidth = measure_read_bandwidth(engine.runner.device)
    return {
        "decode_step_ms": 1000 * statistics.median(steps),
        "weight_bytes": weights,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "weight_read_floor_ms": 1000 * weights / bandwidth,
    }


def step_read_bytes(runner) -> int:
    """Weight bytes one decode step reads: each weight once. Less than the resident bytes where the kernels
    keep a second copy for prompts (oneDNN's layout, on CPUs where it runs long prompts faster)."""
    return min(runner.weight_bytes, runner.dtype.itemsize * runner.model_config.num_parameters)


def measure_read_bandwidth(device: torch.device, size: int = 1 << 30) -> float:
    """Bytes/s of reading a 1 GiB tensor once (a reduction), best of five. Measured on a thread that ends,
    so that this thread keeps no OpenMP pool beside the engine's (see inference_engine/engine_loop.py). On
    a CPU the tensor lies on huge pages, as the engine's packed weights do: they read faster there, so the
    floor is the stricter for it."""

    def best_read() -> float:
        data = torch.ones(size // 4, dtype=torch.float32, device=device)
        if device.type == "cpu":
            data = on_huge_pages(data)
        times = []
        for _ in range(6):
            t = time.perf_counter()
            float(data.sum())  # float() waits for the device
            times.append(time.perf_counter() - t)
        return min(times)

    return size / on_a_thread_that_ends(best_read)


def dense_hf_model(dtype: torch.dtype, folder: str | None = None):
    """transformers' Llama with the same dequantized weights, dense, in `dtype` (a Hugging Face folder
    loads as it is).

    transformers' own GGUF loading keeps the weights packed and dequantizes inside every matmul, which
    would make the baseline slower than a plain dense model; we compare against the dense one.
    """
    import transformers

    from inference_engine.model_loader import load_model

    if folder is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    path = default_model_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict(dict(load_model(None, "none").weights), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, static = result["engine"], result["static_batching"]
    names = ["llmserve", "HF static (batch 8)"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [ours["tokens_per_s"], static["tokens_per_s"]], color=["tab:blue", "tab:gray"])
    axes[0].set_title("generated tokens/s")
    x = range(2)
    axes[1].bar(
        [i - 0.2 for i in x],
        [ours["mean_latency_short_s"], static["mean_latency_short_s"]],
        0.4,
        label="short",
    )
    axes[1].bar(
        [i + 0.2 for i in x], [ours["mean_latency_long_s"], static["mean_latency_long_s"]], 0.4, label="long"
    )
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("mean latency (s)")
    axes[1].legend()
    axes[2].bar(names, [100 * ours["kv_waste"], 100 * static["kv_waste"]], color=["tab:blue", "tab:gray"])
    axes[2].set_title("KV waste (% of allocated slots)")
    setup = f"{result['dtype']}, {result['threads']} threads, median of {result['repeats']} runs"
    fig.suptitle(f"{result['workload']} — {setup}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, taking turns")
    parser.add_argument("--model", help="a Hugging Face folder (default: the bundled model)")
    parser.add_argument(
        "--quantization", default="none", help="our engine's (default: dense, like the baseline)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    requests = mixed_workload(args.requests)

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        log_stats_interval=0,
    )
    device = llm.llm_engine.runner.device
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    model = dense_hf_model(getattr(torch, args.dtype), args.model).to(device)
    model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2)  # warm up

    # The two systems take turns, so a noisy neighbour on a shared machine slows both alike; the
    # median run of each is reported and compared.
    runs: dict[str, list[dict]] = {"engine": [], "engine_sampled": [], "static_batching": []}
    for _ in range(args.repeats):
        runs["engine"].append(run_engine(llm, requests))
        runs["engine_sampled"].append(run_engine(llm, requests, SAMPLED))
        runs["static_batching"].append(run_static(model, llm.get_tokenizer(), requests, args.batch_size))
    ours, sampled, static = (
        median_run(runs[name]) for name in ("engine", "engine_sampled", "static_batching")
    )
    step = decode_step_vs_floor(llm)

    result = {
        "workload": f"{len(requests)} requests, {sum(r.is_short for r in requests)} short",
        "model": args.model or "bundled",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": str(device),
        "threads": args.threads,
        "repeats": args.repeats,
        "engine": ours,
        "static_batching": static,
        "speedup_tokens_per_s": ours["tokens_per_s"] / static["tokens_per_s"],
        "engine_sampled": {"sampling": SAMPLED, **sampled},
        "sampled_vs_greedy": sampled["tokens_per_s"] / ours["tokens_per_s"],
        "short_latency_ratio": ours["mean_latency_short_s"] / static["mean_latency_short_s"],
        "decode_step_batch1": step,
        "all_runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_throughput.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "offline_throughput.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
