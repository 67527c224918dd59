"""Bulk jobs at engine speed: a Celery job's output tokens/s against the same documents, template and sampling
parameters through `LLM.chat` in this process (the reference: the engine with nothing in between), and the
time to first token (TTFT) of interactive chat requests on an idle engine and while a bulk job runs.

Starts a private stack (redis-server, one engine process, daphne, a prefork Celery worker, PostgreSQL when it
answers on the loopback: see tests/database.py). The reference engine has the stack engine's settings (one
torch thread, ``--max-num-seqs``, float32, 512-token context, 128 MiB of KV cache) and runs while the stack is
idle. Targets: job tokens/s >= 0.9x the reference; TTFT p50 during the job <= 2x idle.

``--large N`` adds a job of N short documents (max_tokens 16) that checks what a long job does to the worker:
every item stored once, the pool processes' RSS from start to end, and how long the admin's job page takes to
render while the job runs.

Writes ``benchmarks/results/bulk.json`` and ``bulk.png``.

    .venv/bin/python -m benchmarks.bulk --documents 200 2000 --max-tokens 64 --large 10000
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


def documents(count: int, seed: int) -> list[dict[str, str]]:
    return [
        {
            "document": f"Report {seed}-{i}: the north gate was repaired on day {i % 28 + 1}; crews used "
            f"{i % 7 + 2} cranes and finished {i % 5} days early."
        }
        for i in range(count)
    ]


def machine_load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def reference(llm: Any, docs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The same chat requests through `LLM.chat`, all submitted at once."""
    from inference_engine import SamplingParams

    conversations = [[{"role": "user", "content": TEMPLATE.format_map(doc)}] for doc in docs]
    started = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "items": len(docs),
        "seconds": seconds,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "texts": [o.outputs[0].text for o in outputs],
    }


def run_job(model: str, docs: list[dict[str, str]], max_tokens: int, watch: Any = None) -> dict[str, Any]:
    """A Celery job over ``docs``; ``watch(job)`` is called every half second while it runs."""
    from llmserve.bulk import services
    from llmserve.bulk.models import BulkJob

    started = time.perf_counter()
    job = services.create_job(model, TEMPLATE, docs, {"temperature": 0, "max_tokens": max_tokens})
    while BulkJob.objects.get(pk=job.pk).is_active:
        if watch is not None:
            watch(job)
        time.sleep(0.5)
    wall = time.perf_counter() - started
    job.refresh_from_db()
    p = services.progress(job)
    return {
        "job": job.pk,
        "status": job.status,
        "items": p.total,
        "done": p.done,
        "failed": p.failed,
        "seconds": p.elapsed_s,  # first task start to completion, as the admin shows it
        "wall_seconds": wall,  # from creating the job to seeing it complete
        "completion_tokens": p.completion_tokens,
        "tokens_per_s": p.completion_tokens / p.elapsed_s,
        "wall_tokens_per_s": p.completion_tokens / wall,
        "texts": list(job.items.order_by("index").values_list("output", flat=True)),
    }


def ttft(client: Any, model: str, i: int, max_tokens: int) -> float:
    """Seconds from sending a streaming chat request to its first content token."""
    started = time.perf_counter()
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
            first = time.perf_counter() - started
    return first if first is not None else float("nan")


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "mean": statistics.fmean(ordered),
    }


def engine_step_s(stack: Any) -> float | None:
    """Seconds per engine step now, from the replica's heartbeat: sequences running / tokens per second."""
    from inference_engine.bus.client import EngineClient

    client = EngineClient(stack.redis.url)
    try:
        for info in client.list_models():
            for replica in info.replicas:
                running, rate = replica.data["stats"]["num_running"], replica.data.get("tokens_per_s", 0)
                if running and rate:
                    return running / rate
    finally:
        client.close()
    return None


def with_chat(
    stack: Any, client: Any, docs: list[dict[str, str]], args: argparse.Namespace
) -> dict[str, Any]:
    """A job beside one interactive client asking a question every 0.2 s; their TTFTs and the engine's step
    time meanwhile."""
    during: list[float] = []
    steps: list[float] = []
    stop = threading.Event()

    def chat() -> None:
        i = 0
        while not stop.is_set():
            during.append(ttft(client, stack.model, 1000 + i, args.chat_max_tokens))
            i += 1
            time.sleep(0.2)

    def watch(job: Any) -> None:
        step = engine_step_s(stack)
        if step is not None:
            steps.append(step)

    chatter = threading.Thread(target=chat)
    chatter.start()
    try:
        mixed = run_job(stack.model, docs, args.max_tokens, watch)
    finally:
        stop.set()
        chatter.join()
    mixed.pop("texts")
    return {"job": mixed, "ttft_s": summary(during), "engine_step_s": summary(steps) if steps else None}


def large_job(stack: Any, count: int) -> dict[str, Any]:
    """A long job of short documents: stored once each, pool RSS start to end, admin page render times."""
    import psutil
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    from llmserve.bulk.models import BulkItem

    admin, _ = User.objects.get_or_create(username="bench", defaults={"is_staff": True, "is_superuser": True})
    browser = Client()
    browser.force_login(admin)
    pools = {pid: psutil.Process(pid) for pid in stack.pool_processes()}
    rss_start = {pid: p.memory_info().rss for pid, p in pools.items()}
    rss_peak = dict(rss_start)
    renders: list[float] = []

    def watch(job: Any) -> None:
        for pid, p in pools.items():
            rss_peak[pid] = max(rss_peak[pid], p.memory_info().rss)
        started = time.perf_counter()
        page = browser.get(reverse("admin:llmserve_bulkjob_change", args=[job.pk]))
        renders.append(time.perf_counter() - started)
        assert page.status_code == 200

    result = run_job(stack.model, documents(count, seed=9), 16, watch)
    rss_end = {pid: p.memory_info().rss for pid, p in pools.items()}
    texts = result.pop("texts")
    stored = BulkItem.objects.filter(job_id=result["job"])
    result.update(
        stored_done=stored.filter(status="done").count(),
        distinct_indexes=stored.values("index").distinct().count(),
        empty_outputs=sum(1 for t in texts if not t),
        pool_rss_mb_start={str(k): v / 2**20 for k, v in rss_start.items()},
        pool_rss_mb_end={str(k): v / 2**20 for k, v in rss_end.items()},
        pool_rss_growth_mb=max((rss_end[pid] - rss_start[pid]) / 2**20 for pid in pools),
        pool_rss_peak_growth_mb=max((rss_peak[pid] - rss_start[pid]) / 2**20 for pid in pools),
        admin_page_s=summary(renders),
        admin_page_max_s=max(renders),
    )
    return result


def measure(stack: Any, llm: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills ``result``, saving it after each phase (a long run cut short keeps what it measured)."""
    import openai

    result["sizes"] = []
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    reference(llm, documents(8, seed=0), 4)  # warm-up, both sides
    run_job(stack.model, documents(8, seed=0), 4)
    ttft(client, stack.model, -1, 4)
    for count in args.documents:
        docs = documents(count, seed=count)
        print(f"{count} documents: reference ...", flush=True)
        ref = reference(llm, docs, args.max_tokens)
        print(f"{count} documents: Celery job ...", flush=True)
        job = run_job(stack.model, docs, args.max_tokens)
        same = sum(a == b for a, b in zip(ref.pop("texts"), job.pop("texts"), strict=True))
        size = {
            "documents": count,
            "reference": ref,
            "job": job,
            "ratio": job["tokens_per_s"] / ref["tokens_per_s"],
            "wall_ratio": job["wall_tokens_per_s"] / ref["tokens_per_s"],
            "identical_outputs": same,
            "load_average": machine_load(),
        }
        result["sizes"].append(size)
        save(result)
        print(json.dumps(size, indent=2), flush=True)
        if count == args.documents[0]:  # the shorter phases first: a run cut short keeps them
            ttft_phase(stack, client, documents(count, seed=count + 1), args, result)
            if args.large:
                print(f"{args.large}-document job ...", flush=True)
                result["large"] = large_job(stack, args.large)
                save(result)


def ttft_phase(
    stack: Any, client: Any, docs: list[dict[str, str]], args: argparse.Namespace, result: dict
) -> None:
    print("interactive TTFT ...", flush=True)
    idle = [ttft(client, stack.model, i, args.chat_max_tokens) for i in range(args.idle_requests)]
    mixed = with_chat(stack, client, docs, args)
    result["ttft_idle_s"] = summary(idle)
    result["with_chat"] = mixed
    result["ttft_ratio_p50"] = mixed["ttft_s"]["p50"] / result["ttft_idle_s"]["p50"]
    save(result)


def save(result: dict[str, Any]) -> None:
    result["load_average_now"] = machine_load()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bulk.json").write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, nargs="+", default=[200])
    parser.add_argument("--max-tokens", type=int, default=64, help="bulk items' max_tokens")
    parser.add_argument("--chat-max-tokens", type=int, default=16)
    parser.add_argument("--idle-requests", type=int, default=10)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--large", type=int, default=0, help="documents of the long job (0: skip it)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from inference_engine import LLM
    from tests.bulk.stack import BulkStack
    from tests.web.stack import engine_flags

    result: dict[str, Any] = {"config": vars(args), "load_average_start": machine_load()}
    llm = LLM(
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_model_len=512,
        kv_cache_memory_bytes=128 * 2**20,
        log_stats_interval=0,
    )
    stack = BulkStack(engine_flags=engine_flags(args.threads, args.max_num_seqs)).start()
    try:
        # This process reads the stack's database and Redis as its worker does.
        names = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "LLMSERVE_REDIS_URL")
        os.environ.update({name: stack.env[name] for name in names})
        os.environ["DJANGO_SECRET_KEY"] = "benchmark-only"
        import django

        django.setup()
        from django.test.utils import setup_test_environment

        setup_test_environment()  # the admin page is fetched with Django's test client
        from hostproject.celery import app as celery_app

        celery_app.conf.broker_url = stack.redis.url
        measure(stack, llm, args, result)
    finally:
        stack.stop()
    save(result)
    plot(result, RESULTS / "bulk.png")
    print(json.dumps(result, indent=2))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = result["sizes"]
    xs = range(len(sizes))
    left.bar([x - 0.2 for x in xs], [s["reference"]["tokens_per_s"] for s in sizes], 0.4, label="LLM.chat")
    left.bar([x + 0.2 for x in xs], [s["job"]["tokens_per_s"] for s in sizes], 0.4, label="Celery job")
    for x, s in zip(xs, sizes, strict=True):
        left.text(x + 0.2, s["job"]["tokens_per_s"], f"{s['ratio']:.2f}x", ha="center", va="bottom")
    left.set_xticks(list(xs), [f"{s['documents']} documents" for s in sizes])
    left.set_ylabel("output tokens/s")
    left.set_title("Bulk throughput (target: job >= 0.9x LLM.chat)")
    left.legend()
    idle, during = result["ttft_idle_s"], result["with_chat"]["ttft_s"]
    for offset, key in ((-0.2, "p50"), (0.2, "p90")):
        right.bar([offset, 1 + offset], [1000 * idle[key], 1000 * during[key]], 0.4, label=key)
    right.set_xticks([0, 1], ["idle engine", "during bulk job"])
    right.set_ylabel("interactive TTFT (ms)")
    right.set_title(f"TTFT p50 ratio {result['ttft_ratio_p50']:.2f}x (target <= 2x)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
