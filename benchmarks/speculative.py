"""N-gram speculative decoding on a summarisation workload: tokens/s with and without it, by batch size.

    .venv/bin/python -m benchmarks.speculative [--batches 1 2 4 8] [--threads 2] [--repeats 2] [-k 6]
        [--quantization none]

The bundled model's weights as it declares them (Q4_1), or with `--quantization none` dequantized to bf16.

Documents of 300-600 tokens, summaries of 96 tokens, greedy. The outputs of every run are compared with
those of plain decoding: they must be identical where the steps verifying proposals have at most
`SAME_BITS_ROWS` (20) rows, within which the CPU kernels give a row the bits it gets alone; beyond, a sum
may round otherwise in its last bit (AMX, oneDNN), a near-tie may flip, and the summaries that differ are
counted. Three engines take turns on each batch size: without speculation, with it at every batch
size (the acceptance rate and the ratio per batch size say where it stops paying), and with it as configured
by default (on a CPU the engine stops proposing above `speculative.CPU_BATCH_LIMIT` running sequences, above
`CPU_AMX_BATCH_LIMIT` for bf16 weights where AMX takes every step, above `CPU_QUANTIZED_BATCH_LIMIT` for
quantized weights, shortens proposals where a decode step would verify more than `SAME_BITS_ROWS` rows, and
proposes nothing for quantized weights on a CPU without AVX512-VNNI).
They take turns on every batch of documents, in an order that rotates, and each engine's rate is its tokens
over its seconds summed over all batches and repeats: on a shared machine whose speed drifts by tens of
percent within a minute, every engine then meets the same drift.
Beside each acceptance rate, `steps_with_proposals` (the share of the speculating engine's decode steps, a
sequence each, that had proposals to verify; the others run as plain decoding does) and
`mean_acceptance_length` (tokens a verification gives, its own included) say how much of the decoding
speculation reached. Rates count the whole job, prompts' prefill included (the same work with and without
speculation), and, as `decode_*`, only the decoding, from the batch's last first token on.
`speedup_ceiling` is what the whole job would gain were decoding free: the plain engine's job time over its
time up to the last first token, which speculation cannot shorten. Prefix caching is off, so that every
repeat prefills every document as a bulk job of new documents would.
JSON and a PNG plot under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_engine import LLM, SamplingParams
from llmserve_kernels.cpu.linear import SAME_BITS_ROWS

SUMMARY_TOKENS = 96
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
_FACTS = [
    "The plant in Leeds produced {n} tonnes of steel in the third quarter, up from {m} a year earlier.",
    "Its new furnace, commissioned in {y}, cut energy use per tonne by {p} percent.",
    "The company employs {n} people at the site and plans to hire {m} apprentices next year.",
    "Orders from the automotive sector fell by {p} percent, while construction orders rose.",
    "The board approved an investment of {n} million pounds in a rolling mill to open in {y}.",
    "Union representatives said the night shift will keep its current pay and hours.",
    "Exports to the Netherlands and Germany made up {p} percent of sales in the quarter.",
    "The chief executive, Maria Okafor, said margins would recover once energy prices settle.",
]


def documents(count: int, tokenizer, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        target = rng.randint(300, 600)
        sentences = []
        while len(tokenizer.encode(" ".join(sentences))) < target:
            fact = rng.choice(_FACTS)
            numbers = {"n": rng.randint(100, 9000), "m": rng.randint(10, 900), "y": rng.randint(2019, 2027)}
            sentences.append(fact.format(p=rng.randint(2, 40), **numbers))
        docs.append(f"Report {i}:\n{' '.join(sentences)}\n\nSummarise the report, quoting its figures:")
    return docs


@dataclass
class Turn:
    seconds: float  # the whole call: prefill and decoding
    decode_seconds: float  # from the last sequence's first token to the end
    tokens: int
    outputs: list[list[int]]


def timed(llm: LLM, prompts: list[str]) -> Turn:
    """The prompts generated together."""
    params = SamplingParams(temperature=0, max_tokens=SUMMARY_TOKENS, ignore_eos=True)
    start = time.time()
    results = llm.generate(prompts, params, use_tqdm=False)
    end = time.time()
    outputs = [out.outputs[0].token_ids for out in results]
    prefilled = max(out.metrics.first_token_time for out in results)
    return Turn(end - start, end - prefilled, sum(map(len, outputs)), outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=6)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="our engine's (default: as the model declares)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = args.num_speculative_tokens
    ngram = {**NGRAM, "num_speculative_tokens": k}
    # Every document is new to the engines, as in a bulk job: no repeat finds its prompt in the prefix cache.
    common = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "max_num_seqs": max(args.batches),
        "enable_prefix_caching": False,
    }
    engines = {
        "plain": LLM(**common),
        "ngram": LLM(**common, speculative_config={**ngram, "disable_by_batch_size": None}),
        "ngram_default": LLM(**common, speculative_config=ngram),
    }
    prompts = documents(max(args.documents, max(args.batches)), engines["plain"].get_tokenizer())
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    result = {"threads": args.threads, "dtype": args.dtype, "speculative_config": ngram, "batches": {}}
    for batch in args.batches:
        proposer = engines["ngram"].llm_engine.proposer
        before = proposer.totals()
        seconds, decode_seconds = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0.0)
        tokens, decode_tokens = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0)
        differing = dict.fromkeys(engines, 0)
        for repeat in range(args.repeats):
            outputs = {name: [] for name in engines}
            for turn, start in enumerate(range(0, len(prompts), batch)):
                names = list(engines)
                shift = (turn + repeat) % len(names)
                chunk = prompts[start : start + batch]
                for name in names[shift:] + names[:shift]:
                    took = timed(engines[name], chunk)
                    seconds[name] += took.seconds
                    decode_seconds[name] += took.decode_seconds
                    tokens[name] += took.tokens
                    decode_tokens[name] += took.tokens - len(chunk)  # each first token comes from its prefill
                    outputs[name] += took.outputs
            for name, got in outputs.items():
                differing[name] = max(
                    differing[name], sum(a != b for a, b in zip(got, outputs["plain"], strict=True))
                )
            if batch * (k + 1) <= SAME_BITS_ROWS:
                assert not any(differing.values()), "speculation changed greedy outputs"
        rate = {name: tokens[name] / seconds[name] for name in engines}
        decode_rate = {name: decode_tokens[name] / decode_seconds[name] for name in engines}
        drafts, drafted, accepted = (now - then for now, then in zip(proposer.totals(), before, strict=True))
        # Each sequence's decode step gives one token of its own plus the proposals it accepted.
        steps = decode_tokens["ngram"] - accepted
        result["batches"][batch] = {
            "plain_tokens_per_s": rate["plain"],
            "ngram_tokens_per_s": rate["ngram"],
            "speedup": rate["ngram"] / rate["plain"],
            "acceptance_rate": accepted / max(drafted, 1),
            "steps_with_proposals": drafts / steps,
            "mean_acceptance_length": 1 + accepted / max(drafts, 1),
            "default_tokens_per_s": rate["ngram_default"],
            "default_speedup": rate["ngram_default"] / rate["plain"],
            "decode_tokens_per_s": decode_rate,
            "decode_speedup": decode_rate["ngram"] / decode_rate["plain"],
            "default_decode_speedup": decode_rate["ngram_default"] / decode_rate["plain"],
            "summaries_differing": {"ngram": differing["ngram"], "ngram_default": differing["ngram_default"]},
            "speedup_ceiling": seconds["plain"] / (seconds["plain"] - decode_seconds["plain"]),
        }
        print(batch, json.dumps(result["batches"][batch]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "speculative.png")


def plot(result: dict, path: Path) -> None:
    """Tokens/s of the whole job (solid) and of decoding alone (dashed), by batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = result["speculative_config"]["num_speculative_tokens"]
    rows = list(result["batches"].values())
    batches = [int(b) for b in result["batches"]]  # JSON keeps them as strings
    fig, ax = plt.subplots(figsize=(7, 4.5))
    engines = (  # engine, its whole-job key, label
        ("plain", "plain_tokens_per_s", "without speculation"),
        ("ngram", "ngram_tokens_per_s", f"n-gram, k={k}, every batch size"),
        ("ngram_default", "default_tokens_per_s", f"n-gram, k={k}, default batch limit"),
    )
    for color, (name, job_key, label) in enumerate(engines):
        ax.plot(batches, [row[job_key] for row in rows], "o-", color=f"C{color}", label=f"{label}, whole job")
        decode = [row["decode_tokens_per_s"][name] for row in rows]
        ax.plot(batches, decode, "s--", color=f"C{color}", label=f"{label}, decoding")
    ax.set(xlabel="batch size", ylabel="output tokens/s", title="Summaries of 300-600-token reports")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
