"""Embeddings under a streaming chat, through a real stack (redis-server, one engine, daphne): `--texts`
texts sent to ``/v1/embeddings`` in batches of `--batch`, one batch after another, while a chat streams from
the same engine (its embedding prompts share the batch with the chat's decode steps).

    .venv/bin/python -m benchmarks.embeddings_under_chat [--texts 1000] [--batch 64] [--max-words 60]

First each text is embedded alone (one input per request, nothing else running) and the chat streams alone:
its time per output token (TPOT) without load. Then the load runs while a second chat streams: every vector
must equal the one computed alone (cosine >= 0.9999), and the chat's TPOT while the load ran is reported
beside its TPOT alone. Writes benchmarks/results/embeddings_under_chat.json and .png (the chat's gaps between
tokens over time, the load's span shaded). tests/web/test_embeddings_under_chat.py runs `measure` on a few
texts against the test stack.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai

from benchmarks.embeddings import texts

CHAT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


@dataclass
class ChatStream:
    """A chat streamed on a thread until `stop` is set or `max_tokens` are out: each chunk's arrival time."""

    client: openai.OpenAI
    model: str
    max_tokens: int
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)

    def start(self) -> ChatStream:
        self._thread = threading.Thread(target=self._run, name="chat-stream", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=self.model,
                messages=CHAT,
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with stream:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        self.times.append(time.perf_counter())
                        self.started.set()
                    if self.stop.is_set():
                        break
        except BaseException as exc:  # reported by `join`
            self.error = exc
        finally:
            self.started.set()

    def join(self) -> list[float]:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.times


def tpot_ms(times: list[float], start: float = -np.inf, end: float = np.inf) -> dict:
    """The gaps between consecutive chunks that arrived in [start, end]: mean (the TPOT), median, p90, ms."""
    inside = [t for t in times if start <= t <= end]
    gaps = np.diff(inside) * 1000
    if len(gaps) == 0:
        return {"tokens": len(inside), "mean": None, "median": None, "p90": None}
    return {
        "tokens": len(inside),
        "mean": round(float(gaps.mean()), 2),
        "median": round(float(np.median(gaps)), 2),
        "p90": round(float(np.percentile(gaps, 90)), 2),
    }


def embed(client: openai.OpenAI, model: str, inputs: list[str]):
    return client.embeddings.create(model=model, input=inputs, encoding_format="base64")


def _vectors(answer) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in answer.data])


def measure(
    base_url: str, api_key: str, model: str, items: list[str], batch: int, chat_tokens: int, quiet_tokens: int
) -> dict:
    """The run the module describes, against the stack at `base_url`. The chat alone streams `quiet_tokens`;
    the one under load at most `chat_tokens`, stopped once the load is done."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    start = time.perf_counter()
    alone = np.concatenate([_vectors(embed(client, model, [text])) for text in items])
    alone_s = time.perf_counter() - start
    quiet = ChatStream(client, model, quiet_tokens).start().join()

    chat = ChatStream(client, model, chat_tokens).start()
    chat.started.wait()
    load_start = time.perf_counter()
    loaded, tokens = [], 0
    for lo in range(0, len(items), batch):
        answer = embed(client, model, items[lo : lo + batch])
        loaded.append(_vectors(answer))
        tokens += answer.usage.prompt_tokens
    load_end = time.perf_counter()
    chat.stop.set()
    busy = chat.join()
    vectors = np.concatenate(loaded)
    cosines = (vectors * alone).sum(-1) / (np.linalg.norm(vectors, axis=-1) * np.linalg.norm(alone, axis=-1))
    load_s = load_end - load_start
    return {
        "texts": len(items),
        "batch": batch,
        "prompt_tokens": tokens,
        "alone_seconds": round(alone_s, 2),
        "load_seconds": round(load_s, 2),
        "load_texts_per_s": round(len(items) / load_s, 1),
        "load_tokens_per_s": round(tokens / load_s),
        "min_cosine_to_alone": round(float(cosines.min()), 6),
        "below_0.9999": int((cosines < 0.9999).sum()),
        "chat_tpot_ms_alone": tpot_ms(quiet),
        "chat_tpot_ms_during_load": tpot_ms(busy, load_start, load_end),
        "chat_tokens_during_load": sum(load_start <= t <= load_end for t in busy),
        "_chat_times": [t - load_start for t in busy],
        "_quiet_times": [t - quiet[0] for t in quiet] if quiet else [],
        "_load_span": [0.0, load_s],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for key, label in (("_quiet_times", "chat alone"), ("_chat_times", "chat under the embedding load")):
        times = result[key]
        ax.plot(times[1:], np.diff(times) * 1000, ".", markersize=3, label=label)
    load = f"{result['texts']} texts, batches of {result['batch']}"
    ax.axvspan(*result["_load_span"], color="C1", alpha=0.12, label=load)
    alone, busy = result["chat_tpot_ms_alone"]["mean"], result["chat_tpot_ms_during_load"]["mean"]
    ax.set_title(f"chat TPOT {alone} ms alone, {busy} ms during the load")
    ax.set_xlabel("seconds from the load's start (the chat alone: from its first token)")
    ax.set_ylabel("gap between chat tokens (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--max-words", type=int, default=60, help="texts of 4 to this many words")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--chat-tokens", type=int, default=3500, help="the loaded chat's length at most")
    parser.add_argument("--quiet-tokens", type=int, default=256, help="the chat alone's length")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="the engine's token budget per step (its default if unset)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    from tests.web.stack import Stack, engine_flags

    flags = engine_flags(threads=args.threads, max_num_seqs=args.batch + 1)
    flags[flags.index("--dtype") + 1] = args.dtype
    flags[flags.index("--max-model-len") + 1] = "4096"  # room for a chat that outlasts the load
    flags[flags.index("--kv-cache-memory-bytes") + 1] = str(1 << 30)  # the chat and a whole batch
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    stack = Stack(engine_flags=flags).start()
    try:
        result = measure(
            stack.base_url,
            stack.api_key,
            stack.model,
            texts(args.texts, max_words=args.max_words),
            args.batch,
            args.chat_tokens,
            args.quiet_tokens,
        )
    finally:
        stack.stop()
    result.update(
        threads=args.threads,
        dtype=args.dtype,
        max_words=args.max_words,
        max_num_batched_tokens=args.max_num_batched_tokens or "default",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.max_num_batched_tokens
    name = "embeddings_under_chat" + (f"-{budget}" if budget else "")
    plot(result, args.out / f"{name}.png")
    shown = {k: v for k, v in result.items() if not k.startswith("_")}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(shown, indent=2))
    if shown["below_0.9999"]:
        raise SystemExit(f"{shown['below_0.9999']} vectors differ from the ones computed alone")


if __name__ == "__main__":
    main()
