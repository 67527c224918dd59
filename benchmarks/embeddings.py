"""Embedding throughput: `LLM.embed` (runner "pooling") against sentence-transformers' own
`SentenceTransformer.encode`, on one model folder, the same texts, dtype and threads, in one run.

    .venv/bin/python -m benchmarks.embeddings [--texts 256] [--dtype bfloat16] [--threads 2] [--batch 32]

The model folder is the bundled model's fp32 weights saved by sentence-transformers itself (`save`: a
last-token Pooling module and a Normalize module, plain-text input), built once per machine; both sides load
that folder, in `--dtype`. Each side embeds the texts once to warm up, then `--rounds` times in turns (the
fastest counts). Reports texts/s and prompt tokens/s of each, their ratio (target: at least 2x) and the
smallest cosine between the two vectors of a text; writes benchmarks/results/embeddings.json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from inference_engine import LLM

SENTENCE = (
    "the engine batches prompts of every length into one step while a chat streams beside them and each "
    "document of the table gets its vector for search over the rows of a database"
)
WORDS = SENTENCE.split(" ")


def texts(count: int, seed: int = 0, max_words: int = 250) -> list[str]:
    """`count` texts of 4 to `max_words` words (5 to about 300 tokens by default)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, max_words))) for _ in range(count)]


def save_sentence_transformer(source: Path, target: Path, mode: str, normalize: bool):
    """A SentenceTransformer over the Hugging Face folder `source` (`mode` pooling: "lasttoken", "mean", ...;
    then a Normalize module if asked) saved by its own `save` to `target`; returns the model. It gets the
    plain-text modality: sentence-transformers would render texts through a chat model's chat template."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    body = Transformer(
        str(source),
        model_kwargs={"dtype": torch.float32},
        modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        module_output_name="token_embeddings",
    )
    body.tokenizer.pad_token = body.tokenizer.eos_token  # batches are padded (on the right)
    modules = [body, Pooling(body.get_embedding_dimension(), pooling_mode=mode)]
    model = SentenceTransformer(modules=[*modules, Normalize()] if normalize else modules, device="cpu")
    model.save(str(target))
    return model


def model_folder() -> Path:
    """The bundled model as a sentence-transformers folder (LAST pooling, normalised), once per machine."""
    import sentence_transformers

    from tests.engine.quant_checkpoints import _cached, _version, dense_folder

    source = dense_folder()
    key = f"st-embed-{sentence_transformers.__version__}-transformers{_version('transformers')}"
    return _cached(key, lambda target: save_sentence_transformer(source, target, "lasttoken", True))


def run_ours(llm: LLM, items: list[str]) -> tuple[float, list[list[float]], int]:
    start = time.perf_counter()
    outs = llm.embed(items, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs.embedding for o in outs], sum(len(o.prompt_token_ids) for o in outs)


def run_theirs(model, items: list[str], batch: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    vectors = model.encode(items, batch_size=batch, convert_to_tensor=True)
    return time.perf_counter() - start, vectors.float()


def side(seconds: float, count: int, tokens: int) -> dict:
    return {
        "seconds": round(seconds, 2),
        "texts_per_s": round(count / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["llmserve LLM.embed", "sentence-transformers encode"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in zip(
        axes, ("texts_per_s", "tokens_per_s"), ("texts/s", "prompt tokens/s"), strict=True
    ):
        ax.bar(names, [result["ours"][key], result["sentence_transformers"][key]], color=["C0", "C1"])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"{result['texts']} texts, {result['dtype']}, {result['threads']} threads: "
        f"{result['speedup']}x (target 2x)"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="sentence-transformers' batch size")
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed runs of each, in turns; the fastest counts"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    folder = model_folder()
    dtype = getattr(torch, args.dtype)
    items = texts(args.texts)
    llm = LLM(str(folder), dtype=args.dtype, runner="pooling", kv_cache_memory_bytes=256 << 20)
    st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
    run_ours(llm, items[:16])  # warm-up: the first steps time the CPU's kernels
    run_theirs(st, items[:16], args.batch)
    ours_s = theirs_s = float("inf")
    for _ in range(args.rounds):
        seconds, ours, tokens = run_ours(llm, items)
        ours_s = min(ours_s, seconds)
        seconds, theirs = run_theirs(st, items, args.batch)
        theirs_s = min(theirs_s, seconds)
    cosines = torch.nn.functional.normalize(torch.tensor(ours), dim=-1) @ theirs.T
    result = {
        "texts": len(items),
        "prompt_tokens": tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "rounds": args.rounds,
        "ours": side(ours_s, len(items), tokens),
        "sentence_transformers": {
            "version": __import__("sentence_transformers").__version__,
            "batch": args.batch,
            **side(theirs_s, len(items), tokens),
        },
        "speedup": round(theirs_s / ours_s, 2),
        "min_cosine": round(float(cosines.diagonal().min()), 6),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embeddings.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "embeddings.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
