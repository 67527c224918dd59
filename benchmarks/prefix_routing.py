"""Prefix-aware routing against the shared stream: two engine replicas of the bundled model (one torch thread
each) and a multi-turn chat workload over a long shared system prompt, in one run.

Each policy gets a fresh pair of replicas (empty prefix caches) and the same workload: `--conversations`
conversations of `--turns` turns, run concurrently (each sends its next turn when the previous answer is
complete, so the turns arrive interleaved), greedy, every answer fed back into its conversation. Each user
turn carries `--order-lines` lines of an order history (what a customer pastes) and each answer is
`--max-tokens` tokens long (``min_tokens`` holds it there), so a conversation's history grows by a realistic
amount per turn rather than by a one-line question and whatever length a 135M model happens to stop at.
Reported per policy: the replicas' prefix cache hit rate and prefilled tokens (from their heartbeats),
client-side TTFT p50/p90, output tokens/s over the workload's wall time, the routing decisions; and whether
the two policies gave identical answers. Writes ``benchmarks/results/prefix_routing.json`` and
``prefix_routing.png``.

    .venv/bin/python -m benchmarks.prefix_routing [--conversations 16] [--turns 6] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inference_engine.bus import routing
from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smol"
FLAGS = [
    "--threads",
    "1",
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "16",
    "--kv-cache-memory-bytes",
    str(512 * 2**20),
    "--heartbeat-interval",
    "0.5",
    "--heartbeat-ttl",
    "2.5",
    "--log-level",
    "WARNING",
]


def system_prompt(sentences: int) -> str:
    """A long, varied house style guide (about 13 tokens a sentence)."""
    topics = ["invoices", "refunds", "shipping", "warranties", "accounts", "returns", "coupons", "privacy"]
    return "You are the support assistant of a hardware shop. House rules follow.\n" + "\n".join(
        f"Rule {i}: when a customer asks about {topics[i % len(topics)]}, answer in at most {i % 5 + 2} "
        f"sentences and cite section {i * 7 % 31}."
        for i in range(sentences)
    )


def start_replicas(url: str, prefix: str) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "inference_engine", "serve", "--served-model-name", MODEL]
    return [subprocess.Popen([*cmd, "--redis-url", url, "--prefix", prefix, *FLAGS]) for _ in range(2)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(60)


def wait_live(client: EngineClient, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 300
    while len(client.live_replicas(MODEL)) < 2:
        assert all(p.poll() is None for p in procs), "an engine process exited"
        assert time.monotonic() < deadline, "replicas not live within 300 s"
        time.sleep(0.2)


def user_turn(c: int, t: int, order_lines: int) -> str:
    """Customer `c`'s question `t`, with the order lines they paste (about 12 tokens a line)."""
    orders = "\n".join(
        f"order {c * 1000 + t * 50 + i}: {(c + i) % 7 + 1} x part {(c * 31 + t * 7 + i * 13) % 997}, "
        f"shipped {(i * 3 + t) % 28 + 1} March"
        for i in range(order_lines)
    )
    return f"Customer {c}, question {t}: what about item {c * 10 + t}? My orders:\n{orders}"


def converse(client: EngineClient, system: str, c: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system}]
    records = []
    params = {"temperature": 0.0, "max_tokens": args.max_tokens, "min_tokens": args.max_tokens}
    for t in range(args.turns):
        messages.append({"role": "user", "content": user_turn(c, t, args.order_lines)})
        sent = time.perf_counter()
        stream = client.generate(MODEL, messages=messages, params=params)
        first, text, tokens = None, "", 0
        for delta in stream:
            for out in delta.outputs:
                if out.token_ids and first is None:
                    first = time.perf_counter() - sent
                text += out.text
                tokens += len(out.token_ids)
        records.append({"conversation": c, "turn": t, "ttft_s": first, "tokens": tokens, "text": text})
        messages.append({"role": "assistant", "content": text})
    return records


def cache_stats(client: EngineClient) -> dict[str, int]:
    totals: collections.Counter[str] = collections.Counter()
    for model in client.list_models():
        for replica in model.replicas:
            stats = replica.data["stats"]
            totals["query"] += stats["prefix_cache_query_tokens"]
            totals["hit"] += stats["prefix_cache_hit_tokens"]
    return dict(totals)


def run_policy(url: str, policy: str, args: argparse.Namespace, system: str) -> dict[str, Any]:
    prefix = f"bench-routing-{policy}-{int(time.time())}"
    procs = start_replicas(url, prefix)
    client = EngineClient(url, prefix=prefix, routing=policy, ack_timeout=600, stream_timeout=600)
    decisions: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def count(model: str, chosen: str) -> None:
        with lock:
            decisions[chosen] += 1

    routing.on_route(count)
    try:
        wait_live(client, procs)
        system_tokens = len(client.tokenize(MODEL, system).token_ids)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            futures = [pool.submit(converse, client, system, c, args) for c in range(args.conversations)]
            records = [r for f in futures for r in f.result()]
        wall = time.perf_counter() - started
        time.sleep(1.5)  # the last heartbeats carry the final counters
        stats = cache_stats(client)
    finally:
        client.close()
        stop(procs)
    ttfts = sorted(r["ttft_s"] for r in records if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in records)
    print(f"{policy}: {wall:.1f} s, {tokens} tokens, cache {stats}, decisions {dict(decisions)}", flush=True)
    return {
        "policy": policy,
        "system_prompt_tokens": system_tokens,
        "requests": len(records),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "prompt_tokens_looked_up": stats["query"],
        "prefix_cache_hit_tokens": stats["hit"],
        "prefix_cache_hit_rate": stats["hit"] / stats["query"] if stats["query"] else 0.0,
        "prefilled_tokens": stats["query"] - stats["hit"],
        "routing_decisions": dict(decisions),
        "texts": [r["text"] for r in sorted(records, key=lambda r: (r["conversation"], r["turn"]))],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["policies"]
    names = [r["policy"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [r["prefilled_tokens"] for r in runs])
    axes[0].set_title("prefilled tokens")
    for offset, key in ((-0.2, "ttft_p50_s"), (0.2, "ttft_p90_s")):
        axes[1].bar(
            [i + offset for i in range(len(runs))], [1000 * r[key] for r in runs], 0.4, label=key[5:8]
        )
    axes[1].set_xticks(range(len(runs)), names)
    axes[1].set_ylabel("ms")
    axes[1].set_title("time to first token")
    axes[1].legend()
    axes[2].bar(names, [r["tokens_per_s"] for r in runs])
    axes[2].set_title("output tokens/s")
    w = result["workload"]
    fig.suptitle(
        f"2 replicas x 1 thread, {w['conversations']} conversations x {w['turns']} turns, "
        f"~{w['system_prompt_tokens']}-token system prompt; identical outputs: {result['identical_outputs']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96, help="each answer's length")
    parser.add_argument(
        "--order-lines", type=int, default=8, help="order lines per user turn (~12 tokens each)"
    )
    parser.add_argument("--system-sentences", type=int, default=36, help="36: about 1,000 tokens")
    args = parser.parse_args()
    system = system_prompt(args.system_sentences)
    with RedisServer().start() as server:
        runs = [run_policy(server.url, policy, args, system) for policy in (routing.SHARED, routing.PREFIX)]
    shared, prefix = runs
    result = {
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "order_lines": args.order_lines,
            "system_prompt_chars": len(system),
            "system_prompt_tokens": shared["system_prompt_tokens"],
            "mean_prompt_tokens": shared["prompt_tokens_looked_up"] / shared["requests"],
        },
        "identical_outputs": shared["texts"] == prefix["texts"],
        "differing_answers": sum(a != b for a, b in zip(shared["texts"], prefix["texts"], strict=True)),
        "prefilled_ratio": prefix["prefilled_tokens"] / max(1, shared["prefilled_tokens"]),
        "ttft_p50_ratio": prefix["ttft_p50_s"] / shared["ttft_p50_s"],
        "tokens_per_s_ratio": prefix["tokens_per_s"] / shared["tokens_per_s"],
        "policies": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_routing.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "prefix_routing.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
