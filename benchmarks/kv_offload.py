"""The prefix cache's second tier (--kv-offload-gib) against recompute, in one run: prefixes that overflow the
KV pool come back.

    .venv/bin/python -m benchmarks.kv_offload [--prefixes 6] [--prefix-tokens 768] [--device-blocks 120]

`--prefixes` distinct documents of `--prefix-tokens` tokens each, on the bundled model, with a KV pool of
`--device-blocks` blocks (about two documents): each document is asked one question (the first pass), then,
once every other document has gone through the pool, a second one (the return). Requests run one at a time,
so a TTFT is its own prefill. Each mode gets a fresh engine and the same requests: "recompute" (no tier: a
returning document is prefilled again), "tier" (evicted blocks are kept in host memory and copied back) and,
for reference, "device" (a pool that holds every document: the return is a plain prefix-cache hit).
Reported per mode and pass: TTFT p50 / mean; for the tier, the prompt tokens it served, the blocks it stored
and restored and the seconds their copies took; and whether the returns' greedy tokens agree between modes
(the tier's must equal the device cache's: the same K/V; recompute prefills the whole prompt in one long
step, whose attention kernel rounds otherwise than the short step after a cached prefix, so in bf16 it may
part from both at a near-tie, as a prefix-cache hit may). Writes ``benchmarks/results/kv_offload.json`` and
``kv_offload.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from inference_engine import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ["invoice", "refund", "shipping", "warranty", "battery", "screen", "keyboard", "cable", "charger"]
WORDS += ["router", "printer", "monitor", "speaker", "camera", "license", "driver", "backup", "server"]


def documents(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """Distinct documents of exactly `tokens` token ids (from their first sentence on, so no two share a
    block)."""
    docs = []
    for i in range(count):
        rng = random.Random(i)
        text = f"Document {i}. " + " ".join(
            f"Part {j}: the {rng.choice(WORDS)} of the {rng.choice(WORDS)} takes {rng.randrange(99)} steps."
            for j in range(tokens // 6)
        )
        ids = tokenizer.encode(text)
        assert len(ids) >= tokens, "a document came out short"
        docs.append(ids[:tokens])
    return docs


def run(mode: str, args: argparse.Namespace, block_bytes: int) -> dict:
    tier = args.tier_gib if mode == "tier" else 0.0
    blocks = args.device_blocks
    if mode == "device":  # every document and its questions
        blocks = args.prefixes * (args.prefix_tokens // 16 + 16) + 16
    llm = LLM(
        kv_cache_memory_bytes=blocks * block_bytes,
        kv_offload_gib=tier,
        max_model_len=args.prefix_tokens + 256,
        max_num_batched_tokens=max(2048, args.prefix_tokens + 64),
        max_num_seqs=4,
        log_stats_interval=0,
    )
    tokenizer = llm.get_tokenizer()
    docs = documents(tokenizer, args.prefixes, args.prefix_tokens)
    questions = [tokenizer.encode(f"\nQuestion {q}: which item is checked most? Answer:") for q in (1, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([docs[0][:64]], params, use_tqdm=False)  # warm-up, a prefix of its own
    passes, tokens = {}, {}
    for name, question in zip(("first", "return"), questions, strict=True):
        ttft, restored_ms = [], []
        for doc in docs:
            before = llm.engine.stats().get("kv_offload_restore_seconds", 0.0)
            out = llm.generate([{"prompt_token_ids": doc + question}], params, use_tqdm=False)[0]
            ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
            restored_ms.append(1000 * (llm.engine.stats().get("kv_offload_restore_seconds", 0.0) - before))
            tokens.setdefault(name, []).append(out.outputs[0].token_ids)
        passes[name] = {
            "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_mean_ms": 1000 * statistics.fmean(ttft),
            "ttft_ms": [round(1000 * t, 1) for t in ttft],
            "copy_back_ms": [round(ms, 2) for ms in restored_ms],
        }
    stats = llm.engine.stats()
    result = {
        "kv_blocks": stats["num_blocks"],
        "block_bytes": llm.engine.runner.kv_bytes_per_block,
        "dtype": str(llm.engine.runner.dtype),
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
        "passes": passes,
        "tokens": tokens,
    }
    result.update({k: v for k, v in stats.items() if k.startswith("kv_offload_")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=768)
    parser.add_argument("--device-blocks", type=int, default=120, help="KV pool size (a block: 16 tokens)")
    parser.add_argument("--tier-gib", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    # One thread: on shared cores a thread pool's copies and prefills stall whenever one of its threads waits.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    probe = LLM(kv_cache_memory_bytes=1 << 24, log_stats_interval=0)
    block_bytes = probe.engine.runner.kv_bytes_per_block
    del probe
    modes = {mode: run(mode, args, block_bytes) for mode in ("recompute", "tier", "device")}
    returns = {mode: r.pop("tokens")["return"] for mode, r in modes.items()}
    recompute, tier = modes["recompute"]["passes"]["return"], modes["tier"]["passes"]["return"]
    result = {
        "workload": {
            "prefixes": args.prefixes,
            "prefix_tokens": args.prefix_tokens,
            "device_blocks": args.device_blocks,
            "tier_gib": args.tier_gib,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
        },
        "modes": modes,
        "return_ttft_speedup_p50": recompute["ttft_p50_ms"] / tier["ttft_p50_ms"],
        "returns_identical_tier_device": returns["tier"] == returns["device"],
        "returns_differing_tier_recompute": sum(
            a != b for a, b in zip(returns["tier"], returns["recompute"], strict=True)
        ),
    }
    (args.out / "kv_offload.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "kv_offload.png")
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}, indent=2))
    for mode, r in modes.items():
        print(mode, {k: v for k, v in r.items() if k != "passes"})
        for name, p in r["passes"].items():
            print(f"  {name}: TTFT p50 {p['ttft_p50_ms']:.1f} ms, mean {p['ttft_mean_ms']:.1f} ms")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (mode, r) in enumerate(modes.items()):
        for j, name in enumerate(("first", "return")):
            value = r["passes"][name]["ttft_p50_ms"]
            left.bar(j * 4 + i, value, color=f"C{i}", label=mode if j == 0 else None)
            left.text(j * 4 + i, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
    left.set_xticks([1, 5], ["first pass", "return"])
    left.set_ylabel("TTFT p50 (ms)")
    left.legend(fontsize=8)
    w = result["workload"]
    left.set_title(f"{w['prefixes']} prefixes x {w['prefix_tokens']} tokens, {w['device_blocks']}-block pool")
    tier = modes["tier"]["passes"]["return"]
    x = range(len(tier["ttft_ms"]))
    right.plot(x, modes["recompute"]["passes"]["return"]["ttft_ms"], "o-", label="recompute: TTFT")
    right.plot(x, tier["ttft_ms"], "o-", label="tier: TTFT")
    right.plot(x, tier["copy_back_ms"], "s--", label="tier: copy-back")
    right.set_xlabel("returning request")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.legend(fontsize=8)
    right.set_title(f"restored {modes['tier'].get('kv_offload_restored_blocks', 0)} blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
