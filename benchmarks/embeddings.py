"""Embedding throughput: `LLM.embed` (runner "pooling", last-token pooling, normalised) against the way
sentence-transformers embeds, on the same model, texts, dtype and threads, in one run.

    .venv/bin/python -m benchmarks.embeddings [--texts 256] [--dtype bfloat16] [--threads 2] [--batch 32]

The reference is sentence-transformers itself where it is installed (`SentenceTransformer` over the bundled
model's transformers folder with a last-token Pooling and a Normalize module); otherwise transformers run as
sentence-transformers runs it: texts sorted by length, batches of `--batch`, right-padded with an attention
mask, the last real token's hidden state, normalised. Reports texts/s and prompt tokens/s of each, their
ratio, and the smallest cosine between the two vectors of a text.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from inference_engine import LLM

SENTENCE = (
    "the engine batches prompts of every length into one step while a chat streams beside them and each "
    "document of the table gets its vector for search over the rows of a database"
)
WORDS = SENTENCE.split(" ")


def texts(count: int, seed: int = 0) -> list[str]:
    """`count` texts of 5 to about 300 tokens."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 250))) for _ in range(count)]


def run_ours(llm: LLM, items: list[str]) -> tuple[float, list[list[float]], int]:
    start = time.perf_counter()
    outs = llm.embed(items, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs.embedding for o in outs], sum(len(o.prompt_token_ids) for o in outs)


def run_reference(
    folder: str, items: list[str], dtype: torch.dtype, batch: int
) -> tuple[float, torch.Tensor, str]:
    try:
        from sentence_transformers import SentenceTransformer, models
    except ImportError:
        return (
            *_transformers_like_st(folder, items, dtype, batch),
            "transformers as sentence-transformers runs",
        )
    body = models.Transformer(folder, model_args={"dtype": dtype})
    pooling = models.Pooling(body.get_word_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu")
    start = time.perf_counter()
    vectors = model.encode(items, batch_size=batch, convert_to_tensor=True)
    return time.perf_counter() - start, vectors.float(), "sentence-transformers"


def _transformers_like_st(folder: str, items: list[str], dtype: torch.dtype, batch: int):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = transformers.AutoModel.from_pretrained(folder, dtype=dtype).eval()
    order = sorted(range(len(items)), key=lambda i: -len(items[i]))
    vectors = torch.empty(len(items), model.config.hidden_size)
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(order), batch):
            chosen = order[lo : lo + batch]
            enc = tokenizer([items[i] for i in chosen], padding=True, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            last = enc["attention_mask"].sum(1) - 1
            pooled = hidden[torch.arange(len(chosen)), last].float()
            vectors[chosen] = torch.nn.functional.normalize(pooled, dim=-1)
    return time.perf_counter() - start, vectors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tests.engine.quant_checkpoints import dense_folder

    folder = str(dense_folder())
    items = texts(args.texts)
    llm = LLM(folder, dtype=args.dtype, runner="pooling", kv_cache_memory_bytes=256 << 20)
    run_ours(llm, items[:8])  # warm-up: the first steps time the CPU's kernels
    ours_s, ours, tokens = run_ours(llm, items)
    ref_s, ref, name = run_reference(folder, items, getattr(torch, args.dtype), args.batch)
    cosines = (torch.tensor(ours) * ref).sum(-1)
    print(
        json.dumps(
            {
                "texts": len(items),
                "prompt_tokens": tokens,
                "dtype": args.dtype,
                "threads": args.threads,
                "ours": {
                    "seconds": round(ours_s, 2),
                    "texts_per_s": round(len(items) / ours_s, 1),
                    "tokens_per_s": round(tokens / ours_s),
                },
                "reference": {
                    "name": name,
                    "batch": args.batch,
                    "seconds": round(ref_s, 2),
                    "texts_per_s": round(len(items) / ref_s, 1),
                    "tokens_per_s": round(tokens / ref_s),
                },
                "speedup": round(ref_s / ours_s, 2),
                "min_cosine": round(float(cosines.min()), 6),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
