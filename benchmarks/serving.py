"""Serving benchmark through HTTP: Poisson arrivals over the mixed workload, as an OpenAI client sees it.

Workload: 32 requests (by default), 20% short answers of 48 tokens and 80% long generations of 192 tokens,
greedy with ``ignore_eos`` so every request generates exactly its budget; arrival gaps are exponential
(a Poisson process) at ``--rate`` requests per second. Every request streams, so the client observes
time to first token (TTFT), time per output token after the first (TPOT) and end-to-end latency;
throughput is output tokens over the whole run's wall time.

Without ``--url`` it starts its own stack like tests/web do (private redis-server, one engine process with
``--threads`` torch threads, SQLite, daphne) and stops it afterwards. Results: JSON (``--out``) and a PNG
beside it.

    python benchmarks/serving.py --rate 2 --out benchmarks/results/serving.json
    python benchmarks/serving.py --url http://127.0.0.1:8000 --api-key sk-llm-... --model smol

Concurrency sweep (``--sweep 1,10,100,1000``): at each level N, N clients at once, each sending streamed chat
requests (16 tokens, greedy, EOS ignored) back to back until the level's requests (``max(N, 20)``) are done:
throughput, TTFT p50/p99 and the number of requests that did not complete, per level. It starts the stack
exactly as ``scripts/run`` does (tests/faults/stack.py: two daphne workers, an engine with up to 64 sequences
per batch), and measures once the engine's standby spare has loaded, unless ``--url`` names a server.
Results: ``serving_sweep.json`` and ``.png``.

    python benchmarks/serving.py --sweep 1,10,100,1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python benchmarks/serving.py` works without an install

SHORT, LONG = 48, 192
TOPICS = ["the sea", "a lighthouse", "bread", "mountains", "a robot", "the moon", "rivers", "libraries"]


@dataclass
class Result:
    index: int
    max_tokens: int
    arrival: float  # seconds after the run started
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(1, self.output_tokens - 1)


def workload(num_requests: int, short_share: float, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    num_short = round(num_requests * short_share)
    budgets = [SHORT] * num_short + [LONG] * (num_requests - num_short)
    rng.shuffle(budgets)
    return [(f"Write a story about {rng.choice(TOPICS)} (#{i}).", b) for i, b in enumerate(budgets)]


async def one_request(
    client: openai.AsyncOpenAI,
    model: str,
    index: int,
    prompt: str,
    max_tokens: int,
    arrival: float,
    start: float,
) -> Result:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return Result(index, max_tokens, arrival, (first or done) - sent, done - sent, tokens)


async def run(
    base_url: str, api_key: str, model: str, rate: float, requests: list[tuple[str, int]], seed: int
) -> tuple[list[Result], float]:
    rng = random.Random(seed + 1)
    arrivals, t = [], 0.0
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(rate)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    # Warm-up: the first request pays one-off costs (connections, allocator) that are not serving latency.
    await client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            one_request(client, model, i, p, m, a, start)
            for i, ((p, m), a) in enumerate(zip(requests, arrivals, strict=True))
        )
    )
    wall = time.perf_counter() - start
    await client.close()
    return list(results), wall


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "p50": pick(0.50), "p99": pick(0.99)}


def summarize(results: list[Result], wall: float, config: dict[str, Any]) -> dict[str, Any]:
    tokens = sum(r.output_tokens for r in results)
    return {
        "config": config,
        "wall_s": wall,
        "requests": len(results),
        "output_tokens": tokens,
        "request_throughput_per_s": len(results) / wall,
        "output_throughput_tok_per_s": tokens / wall,
        "ttft_s": percentiles([r.ttft for r in results]),
        "tpot_s": percentiles([r.tpot for r in results]),
        "e2e_s": percentiles([r.e2e for r in results]),
        "per_request": [{**asdict(r), "tpot": r.tpot} for r in results],
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["per_request"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in (
        (axes[0], "ttft", "time to first token (s)"),
        (axes[1], "tpot", "time per output token (s)"),
    ):
        for budget, colour in ((SHORT, "tab:orange"), (LONG, "tab:blue")):
            values = sorted(r[key] for r in rows if r["max_tokens"] == budget)
            if values:
                ax.plot(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    drawstyle="steps-post",
                    color=colour,
                    label=f"{budget}-token requests",
                )
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[2]
    for r in rows:
        colour = "tab:orange" if r["max_tokens"] == SHORT else "tab:blue"
        ax.plot([r["arrival"], r["arrival"] + r["ttft"]], [r["index"]] * 2, color="0.7", linewidth=3)
        ax.plot(
            [r["arrival"] + r["ttft"], r["arrival"] + r["e2e"]], [r["index"]] * 2, color=colour, linewidth=3
        )
    ax.set_xlabel("seconds since start (grey: waiting for the first token)")
    ax.set_ylabel("request")
    ax.grid(alpha=0.3)
    cfg = summary["config"]
    fig.suptitle(
        f"llmserve over HTTP: {summary['requests']} requests, Poisson {cfg['rate']}/s -> "
        f"{summary['output_throughput_tok_per_s']:.1f} output tok/s, "
        f"TTFT p50 {summary['ttft_s']['p50']:.2f}s, "
        f"TPOT p50 {1000 * summary['tpot_s']['p50']:.0f}ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ concurrency sweep

SWEEP_PARAMS = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


async def sweep_level(port: int, api_key: str, model: str, clients: int) -> dict[str, Any]:
    """`clients` closed-loop clients sharing `max(clients, 20)` streamed chat requests."""
    from tests.faults.load import chat

    total = max(clients, 20)
    remaining = iter(range(total))
    outcomes: list = []

    async def client() -> None:
        for i in remaining:
            outcomes.append(
                await chat(
                    port,
                    api_key,
                    model,
                    f"Tell me about {TOPICS[i % len(TOPICS)]}.",
                    timeout=600,
                    **SWEEP_PARAMS,
                )
            )

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    complete = [o for o in outcomes if o.complete]
    ttfts = sorted(o.ttft for o in complete if o.ttft is not None)
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.complete:
            kind = (
                f"{o.status} {(o.error or {}).get('message')}"
                if o.status
                else ("timeout" if o.timed_out else "cut")
            )
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "clients": clients,
        "requests": total,
        "wall_s": wall,
        "completed": len(complete),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "request_throughput_per_s": len(complete) / wall,
        "output_throughput_tok_per_s": len(complete) * SWEEP_PARAMS["max_tokens"] / wall,
        "ttft_s": percentiles(ttfts) if ttfts else None,
        "e2e_s": percentiles([o.elapsed for o in complete]) if complete else None,
    }


def plot_sweep(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = summary["levels"]
    x = [row["clients"] for row in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    left.plot(x, [row["output_throughput_tok_per_s"] for row in levels], "o-", label="output tokens/s")
    for row in levels:
        left.annotate(
            f"{row['errors']} errors", (row["clients"], row["output_throughput_tok_per_s"]), fontsize=8
        )
    left.set_xscale("log")
    left.set_xlabel("concurrent clients")
    left.set_ylabel("output tokens / s")
    left.grid(alpha=0.3)
    for key, style in (("p50", "o-"), ("p99", "s--")):
        right.plot(x, [(row["ttft_s"] or {}).get(key) for row in levels], style, label=f"TTFT {key}")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("concurrent clients")
    right.set_ylabel("time to first token (s)")
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle(f"llmserve concurrency sweep ({summary['config']['stack']}; 16-token streamed chats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per client
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stack = None
    if args.url:
        port, api_key = int(args.url.rstrip("/").rsplit(":", 1)[1]), args.api_key
        model, label = args.model, args.url
    else:
        from tests.faults.stack import MODEL, LauncherStack

        stack = LauncherStack().start()
        print(f"the stack's logs: {stack.log_dir}", flush=True)
        deadline = time.monotonic() + 600
        while "standing by" not in stack.log("engine") and time.monotonic() < deadline:
            time.sleep(1)  # the engine's spare loads the model: not while measuring
        port, api_key, model = stack.port, stack.api_key, MODEL
        label = "scripts/run's stack, 2 web workers, engine max 64 seqs, fp32, 1 thread"
    levels = []
    try:
        for clients in (int(c) for c in args.sweep.split(",")):
            row = asyncio.run(sweep_level(port, api_key, model, clients))
            print(
                json.dumps(
                    {
                        k: row[k]
                        for k in ("clients", "wall_s", "output_throughput_tok_per_s", "ttft_s", "errors")
                    }
                ),
                flush=True,
            )
            levels.append(row)
    finally:
        if stack is not None:
            stack.stop(keep_logs=args.keep_logs)
    summary = {"config": {"stack": label, "params": SWEEP_PARAMS}, "levels": levels}
    out = args.out.with_name("serving_sweep.json") if args.out.name == "serving.json" else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    plot_sweep(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--short-share", type=float, default=0.2, help="share of 48-token requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an llmserve server to measure (default: start a private stack)")
    parser.add_argument("--api-key", default="", help="API key for --url")
    parser.add_argument("--model", default="smol")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine this starts")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="batch size of the engine this starts")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "serving.json")
    parser.add_argument("--sweep", help="concurrency levels, e.g. 1,10,100,1000 (see the module docstring)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs of the stack it starts")
    args = parser.parse_args(argv)
    if args.sweep:
        return run_sweep(args)

    stack = None
    if args.url:
        base_url, api_key = args.url.rstrip("/"), args.api_key
    else:
        from tests.web.stack import Stack, engine_flags

        stack = Stack(model=args.model, engine_flags=engine_flags(args.threads, args.max_num_seqs)).start()
        base_url, api_key = stack.base_url, stack.api_key
    try:
        requests = workload(args.num_requests, args.short_share, args.seed)
        results, wall = asyncio.run(run(base_url, api_key, args.model, args.rate, requests, args.seed))
    finally:
        if stack is not None:
            stack.stop()
    config = {
        "rate": args.rate,
        "num_requests": args.num_requests,
        "short_share": args.short_share,
        "short_tokens": SHORT,
        "long_tokens": LONG,
        "seed": args.seed,
        "url": args.url or "private stack",
        "engine_threads": None if args.url else args.threads,
        "max_num_seqs": None if args.url else args.max_num_seqs,
    }
    summary = summarize(results, wall, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    plot(summary, args.out.with_suffix(".png"))
    brief = {
        k: summary[k]
        for k in (
            "wall_s",
            "output_throughput_tok_per_s",
            "request_throughput_per_s",
            "ttft_s",
            "tpot_s",
            "e2e_s",
        )
    }
    print(json.dumps(brief, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return summary


if __name__ == "__main__":
    main()
