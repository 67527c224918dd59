"""One user at a time: time per output token at batch 1, 2, 4 and 8 and time to first token, our engine and
llama.cpp's server taking turns on the same bf16 GGUF file (the bundled model's weights, dequantized once).

    .venv/bin/python -m benchmarks.latency [--threads 2] [--repeats 3] [--quantized] [--num-scheduler-steps 8]

Both sides generate 128 tokens per request (ignore_eos, greedy). Time per output token is the time from a
request's first token to its last over 127, for our engine both step by step and with `--num-scheduler-steps`
decode steps a call (default 8; the same engine, switched between runs); time to first token is measured for a
30-token and a 1,000-token prompt, offline (in-process `LLM`) and through the whole HTTP stack (daphne, bus,
engine: a streamed `/v1/completions`) against llama.cpp's streamed `/completion`, and beside them, in the same
turns, the round trip of a one-line file from Python's http.server: what any server pays here before it does
any work (on a virtual machine whose idle cores wake slowly, milliseconds). The weights floor is the
time to read the model's weights once at the bandwidth measured in the same run: before the runs and again
before each batch-1 run, since a shared machine's bandwidth drifts from one minute to the next. The floor
reported is the fastest of those reads, and batch 1 is given both as its best time over that floor and as each
run over the floor read just before it. Likewise for the first token, the prefill floor is the time its
arithmetic takes at the fastest dense matmul PyTorch reaches here in the same run (MKL in fp32, oneDNN in
bf16: AMX tiles where the CPU has them): every linear layer on every prompt token, causal attention, the LM
head on the last token. `--quantized` runs both sides on the bundled Q4_1 file instead. JSON and a PNG plot
under benchmarks/results/; where llama.cpp cannot be built that half is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import torch

from benchmarks.gguf_files import rewritten
from benchmarks.offline_throughput import measure_read_bandwidth, step_read_bytes
from inference_engine import LLM, SamplingParams
from inference_engine.bus.redis_server import free_port
from inference_engine.engine_loop import on_a_thread_that_ends
from inference_engine.model_loader import ModelConfig, default_model_path

BATCHES = (1, 2, 4, 8)
TOKENS = 128
SENTENCE = "The committee reviewed the proposal and asked for a revised budget before the next meeting. "


def prefill_flops(config: ModelConfig, tokens: int) -> dict[str, float]:
    """Floating-point operations (a multiply-add counts two) of a prompt's prefill up to its first token:
    the linear layers on every token, attention's scores and weighted sums over each token's causal prefix,
    and the LM head on the last token alone."""
    q = config.num_attention_heads * config.head_dim
    return {
        "linear": 2.0 * config.num_hidden_layers * tokens * config.layer_linear_parameters,
        "attention": 2.0 * config.num_hidden_layers * 2 * q * tokens * (tokens + 1) / 2,
        "head": 2.0 * config.vocab_size * config.hidden_size,
    }


def measure_matmul_rate(size: int = 2048) -> float:
    """FLOP/s of the fastest [size, size] matmul PyTorch runs here on this thread's torch thread count, in
    fp32 or in bf16, best of five each. Measured on a thread that ends (see measure_read_bandwidth)."""

    def best_rate() -> float:
        best = 0.0
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            a @ b
            for _ in range(5):
                start = time.perf_counter()
                a @ b
                best = max(best, 2 * size**3 / (time.perf_counter() - start))
        return best

    return on_a_thread_that_ends(best_rate)


def prompt_of(tokens: int, tokenizer) -> str:
    text = SENTENCE * (tokens // 10 + 1)
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


# ------------------------------------------------------------------------------------------- our engine


def engine_tpot(llm: LLM, batch: int, steps: int = 1) -> float:
    """`steps`: the engine's num_scheduler_steps for this run (read by every engine step)."""
    llm.llm_engine.config.num_scheduler_steps = steps
    prompts = [f"{i}. " + SENTENCE for i in range(batch)]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False
    )
    return statistics.mean(
        (o.metrics.finished_time - o.metrics.first_token_time) / (TOKENS - 1) for o in outputs
    )


def engine_ttft(llm: LLM, prompt: str) -> float:
    llm.reset_prefix_cache()
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return output.metrics.first_token_time - output.metrics.arrival_time


def json_request(url: str, body: dict, headers: dict) -> urllib.request.Request:
    headers = {"Content-Type": "application/json", **headers}
    return urllib.request.Request(url, json.dumps(body).encode(), headers)


def streamed_first_token(url: str, body: dict, headers: dict) -> tuple[float, float]:
    """Wall-clock times of sending a streamed completion and of its first token's bytes."""
    return first_data_line(json_request(url, body, headers))


def first_data_line(request: urllib.request.Request) -> tuple[float, float]:
    """Wall-clock times of sending `request` and of the first `data:` line of its reply."""
    sent = time.time()
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if line.startswith(b"data:"):  # the first streamed chunk carries the first token
                first = time.time()
                break
        else:
            raise RuntimeError("no token streamed")
        for _ in reply:  # drain
            pass
    return sent, first


def http_ttft(url: str, body: dict, headers: dict) -> float:
    """Seconds from sending a streamed completion to its first token's bytes."""
    sent, first = streamed_first_token(url, body, headers)
    return first - sent


@contextmanager
def trivial_http_server() -> Iterator[str]:
    """The URL of a file holding one `data:` line, served by Python's http.server in a process of its own:
    what any HTTP round trip costs here (a new connection, two processes woken), none of it ours."""
    with tempfile.TemporaryDirectory() as root:
        Path(root, "event").write_text("data: {}\n")
        port = free_port()
        command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", root]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/event"
        try:
            for _ in range(100):
                try:
                    first_data_line(urllib.request.Request(url))
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                raise RuntimeError("Python's http.server did not answer within 5 s")
            yield url
        finally:
            process.terminate()
            process.wait()


# ------------------------------------------------------------------------------------------- llama.cpp


def llamacpp_tpot(server, batch: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"{i}. " + SENTENCE for i in range(batch)]
    with ThreadPoolExecutor(batch) as pool:
        answers = list(pool.map(lambda p: server.complete(p, TOKENS), prompts))
    return statistics.mean(a["timings"]["predicted_per_token_ms"] / 1000 for a in answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantized", action="store_true", help="both sides on the bundled Q4_1 file")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument(
        "--num-scheduler-steps", type=int, default=8, help="our multi-step runs' steps a call"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    # Written on a thread that ends: torch's conversions would leave this thread an OpenMP pool beside the
    # engine's, which halves the engine's speed (see inference_engine/engine_loop.py).
    model = (
        default_model_path()
        if args.quantized
        else on_a_thread_that_ends(lambda: rewritten(gguf.GGMLQuantizationType.BF16))
    )
    label = "q4_1" if args.quantized else "bf16"

    llm = LLM(model=str(model), dtype="bfloat16", max_num_seqs=8, max_model_len=2048, log_stats_interval=0)
    weights = step_read_bytes(llm.llm_engine.runner)
    bandwidth = measure_read_bandwidth(torch.device("cpu"))
    tokenizer = llm.get_tokenizer()
    prompts = {n: prompt_of(n, tokenizer) for n in (30, 1000)}
    flops = {n: prefill_flops(llm.llm_engine.runner.model_config, n) for n in prompts}
    result: dict = {
        "model": label,
        "threads": args.threads,
        "weights_bytes": weights,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "weights_floor_ms": 1000 * weights / bandwidth,
        "prefill_gflop": {n: {part: f / 1e9 for part, f in parts.items()} for n, parts in flops.items()},
        "ours": {"tpot_ms": {}, "ttft_offline_ms": {}, "ttft_http_ms": {}},
        "ours_multi_step": {"num_scheduler_steps": args.num_scheduler_steps, "tpot_ms": {}},
        "llamacpp": {"tpot_ms": {}, "ttft_http_ms": {}},
    }
    try:
        from benchmarks.llamacpp import LlamaCppUnavailable, LlamaServer

        server = LlamaServer(model, parallel=8, threads=args.threads).__enter__()
    except (ImportError, LlamaCppUnavailable) as exc:
        print(f"llama.cpp half skipped: {exc}", flush=True)
        server, result["llamacpp"] = None, {"skipped": str(exc)}
    try:
        llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
        # batch 1: each of our runs' (time per token, the floor read just before it), both ways
        paired: dict[str, list[tuple[float, float]]] = {"ours": [], "ours_multi_step": []}
        for batch in BATCHES:  # alternating, best of the repeats for each side
            times: dict[str, list[float]] = {"ours": [], "ours_multi_step": [], "llamacpp": []}
            for _ in range(args.repeats):
                for name, steps in (("ours", 1), ("ours_multi_step", args.num_scheduler_steps)):
                    floor_now = weights / measure_read_bandwidth(torch.device("cpu")) if batch == 1 else None
                    times[name].append(engine_tpot(llm, batch, steps))
                    if batch == 1:
                        paired[name].append((times[name][-1], floor_now))
                if server is not None:
                    times["llamacpp"].append(llamacpp_tpot(server, batch))
            for name, runs in times.items():
                if runs:
                    result[name]["tpot_ms"][batch] = 1000 * min(runs)
            print(
                f"batch {batch}: " + ", ".join(f"{n} {1000 * min(t):.2f}" for n, t in times.items() if t),
                flush=True,
            )
        llm.llm_engine.config.num_scheduler_steps = 1
        # the fastest read of the run
        floor = min([weights / bandwidth] + [f for runs in paired.values() for _, f in runs])
        result["weights_floor_ms"], result["read_bandwidth_gbs"] = 1000 * floor, weights / floor / 1e9
        result["b1_over_floor"] = {
            name: {
                "best_over_fastest_floor": min(t for t, _ in runs) / floor,
                "each_over_the_floor_read_before_it": [t / f for t, f in runs],
            }
            for name, runs in paired.items()
        }
        print(f"batch 1 over the weights floor: {json.dumps(result['b1_over_floor'])}", flush=True)
        # Read just before the first tokens it is the floor of, as the weights floor is before batch 1.
        matmul_rate = measure_matmul_rate()
        result["matmul_gflops"] = matmul_rate / 1e9
        result["prefill_floor_ms"] = {
            n: 1000 * sum(parts.values()) / matmul_rate for n, parts in flops.items()
        }
        for n, prompt in prompts.items():
            result["ours"]["ttft_offline_ms"][n] = 1000 * min(
                engine_ttft(llm, prompt) for _ in range(args.repeats)
            )
        print(
            f"first token offline: {json.dumps(result['ours']['ttft_offline_ms'])} ms; prefill floor "
            f"{json.dumps(result['prefill_floor_ms'])} ms at {result['matmul_gflops']:.0f} GFLOP/s",
            flush=True,
        )
        llm.llm_engine.shutdown()
        del llm
        if not args.skip_http:
            result["ours"]["ttft_http_ms"] = http_ttfts(model, args, prompts, server, result)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    (args.out / f"latency_{label}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"latency_{label}.png")
    print(json.dumps(result, indent=2))


def http_ttfts(model: Path, args, prompts: dict[int, str], server, result: dict) -> dict:
    """Through daphne, the bus and an engine process, against llama.cpp's server, taking turns."""
    from tests.web.stack import Stack

    flags = [
        "--model",
        str(model),
        "--dtype",
        "bfloat16",
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        "8",
    ]
    flags += ["--max-model-len", "2048", "--log-level", "WARNING"]
    ours: dict[int, float] = {}
    result["http_round_trip_ms"] = {}
    stack = Stack(model="bench", engine_flags=flags).start()
    try:
        headers = {"Authorization": f"Bearer {stack.api_key}"}
        url = f"{stack.base_url}/v1/completions"
        with trivial_http_server() as trivial:
            for n, prompt in prompts.items():
                body = {"model": "bench", "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
                times, theirs, round_trips = [], [], []
                for i in range(args.repeats + 1):  # the first of each side warms up
                    times.append(http_ttft(url, {**body, "prompt": f"{i} {prompt}"}, headers))
                    if server is not None:
                        llama_body = {
                            "prompt": f"{i} {prompt}",
                            "n_predict": 4,
                            "stream": True,
                            "cache_prompt": False,
                        }
                        theirs.append(http_ttft(f"{server.url}/completion", llama_body, {}))
                    sent, first = first_data_line(urllib.request.Request(trivial))
                    round_trips.append(first - sent)
                ours[n] = 1000 * min(times[1:])
                result["http_round_trip_ms"][n] = 1000 * min(round_trips[1:])
                if server is not None:
                    result["llamacpp"]["ttft_http_ms"][n] = 1000 * min(theirs[1:])
    finally:
        stack.stop()
    return ours


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = result["ours_multi_step"]["num_scheduler_steps"]
    for name, style, label in (
        ("ours", "o-", "ours"),
        ("ours_multi_step", "^-", f"ours, {steps} steps a call"),
        ("llamacpp", "s--", "llama.cpp"),
    ):
        tpot = result[name].get("tpot_ms") or {}
        if tpot:
            left.plot(list(map(int, tpot)), list(tpot.values()), style, label=label)
    left.axhline(result["weights_floor_ms"], color="grey", linestyle=":", label="weights read once")
    left.set(
        xlabel="batch",
        ylabel="ms per output token",
        title=f"Decode ({result['model']}, {result['threads']} threads)",
    )
    left.legend()
    labels, values = [], []
    for name in ("ours", "llamacpp"):
        for kind in ("ttft_offline_ms", "ttft_http_ms"):
            for n, ms in (result[name].get(kind) or {}).items():
                labels.append(f"{name}\n{kind[5:-3]} {n}")
                values.append(ms)
    for n, ms in result.get("http_round_trip_ms", {}).items():
        labels.append(f"trivial\nserver {n}")
        values.append(ms)
    for n, ms in result["prefill_floor_ms"].items():
        labels.append(f"prefill\nfloor {n}")
        values.append(ms)
    right.bar(range(len(values)), values)
    right.set_xticks(range(len(values)), labels, fontsize=7)
    right.set_yscale("log")  # a trivial server's few milliseconds beside a long prompt's seconds
    right.set(ylabel="ms to first token", title="Time to first token (30 / 1,000-token prompts)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
