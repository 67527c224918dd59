"""Bulk jobs beside live traffic: bulk throughput alone and with interactive chat, and the interactive
requests' time to first token (TTFT) on an idle engine vs while a bulk job runs (target: within 2x).

Starts a private stack (redis-server, one engine process, daphne, a Celery worker; see tests/bulk/stack.py)
and writes ``benchmarks/results/bulk.json`` and ``bulk.png``.

    .venv/bin/python -m benchmarks.bulk --documents 120 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TEMPLATE = "Summarise the following document:\n\n{document}"


def ttft(client: Any, model: str, i: int, max_tokens: int) -> float:
    """Seconds from sending a streaming chat request to its first content token."""
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        stream=True,
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "user", "content": f"Give me one tip about tidy desks ({i})."}],
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    return first if first is not None else float("nan")


def run_job(model: str, docs: int, max_tokens: int, seed: int) -> dict[str, float]:
    from llmserve.bulk import services
    from llmserve.bulk.models import BulkJob

    items = [
        {
            "document": f"Report {seed}-{i}: the north gate was repaired on day {i % 28 + 1}; crews used "
            f"{i % 7 + 2} cranes and finished {i % 5} days early."
        }
        for i in range(docs)
    ]
    job = services.create_job(model, TEMPLATE, items, {"temperature": 0, "max_tokens": max_tokens})
    while BulkJob.objects.get(pk=job.pk).is_active:
        time.sleep(0.5)
    job.refresh_from_db()
    p = services.progress(job)
    return {
        "items": p.total,
        "failed": p.failed,
        "seconds": p.elapsed_s,
        "items_per_s": p.items_per_s,
        "tokens_per_s": p.tokens_per_s,
        "completion_tokens": p.completion_tokens,
    }


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "mean": statistics.fmean(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=16, help="bulk items' max_tokens")
    parser.add_argument("--chat-max-tokens", type=int, default=16)
    parser.add_argument("--idle-requests", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from tests.bulk.stack import BulkStack
    from tests.web.stack import engine_flags

    stack = BulkStack(engine_flags=engine_flags(args.threads, args.max_num_seqs)).start()
    try:
        os.environ.update(
            DJANGO_SETTINGS_MODULE="tests.bulk.settings",
            DATABASE_URL=stack.database.url,
            LLMSERVE_REDIS_URL=stack.redis.url,
            DJANGO_SECRET_KEY="benchmark-only",
        )
        import django
        import openai

        django.setup()
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
        ttft(client, stack.model, -1, 4)  # warm-up
        idle = [ttft(client, stack.model, i, args.chat_max_tokens) for i in range(args.idle_requests)]
        alone = run_job(stack.model, args.documents, args.max_tokens, seed=1)

        during: list[float] = []
        stop = threading.Event()

        def chat() -> None:
            i = 0
            while not stop.is_set():
                during.append(ttft(client, stack.model, 1000 + i, args.chat_max_tokens))
                i += 1
                time.sleep(0.2)

        chatter = threading.Thread(target=chat)
        chatter.start()
        time.sleep(0.5)
        try:
            mixed = run_job(stack.model, args.documents, args.max_tokens, seed=2)
        finally:
            stop.set()
            chatter.join()
    finally:
        stack.stop()

    result = {
        "config": vars(args),
        "bulk_alone": alone,
        "bulk_with_chat": mixed,
        "ttft_idle_s": summary(idle),
        "ttft_during_bulk_s": summary(during),
    }
    result["ttft_ratio_p50"] = result["ttft_during_bulk_s"]["p50"] / result["ttft_idle_s"]["p50"]
    result["within_2x"] = result["ttft_ratio_p50"] <= 2.0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bulk.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "bulk.png")
    print(json.dumps(result, indent=2))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["bulk alone", "bulk + chat"]
    left.bar(labels, [result["bulk_alone"]["tokens_per_s"], result["bulk_with_chat"]["tokens_per_s"]])
    left.set_ylabel("bulk generated tokens/s")
    left.set_title("Bulk throughput")
    for name, key in (("p50", "p50"), ("p90", "p90")):
        values = [1000 * result["ttft_idle_s"][key], 1000 * result["ttft_during_bulk_s"][key]]
        offset = -0.2 if name == "p50" else 0.2
        right.bar([x + offset for x in (0, 1)], values, width=0.4, label=name)
    right.set_xticks([0, 1], ["idle engine", "during bulk job"])
    right.set_ylabel("interactive TTFT (ms)")
    right.set_title(f"TTFT ratio p50: {result['ttft_ratio_p50']:.2f}x (target <= 2x)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
