"""Bulk jobs end to end: real Redis, engine, Celery worker and database; a pool process, a whole worker and an
engine killed mid-job; cancel."""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db.models import Sum

from inference_engine.bus.client import EngineClient
from llmserve.api.errors import BadRequest
from llmserve.bulk import services, uploads
from llmserve.bulk.models import BulkItem, BulkJob, BulkRunner

from .conftest import PARAMS, TEMPLATE, BulkStack, wait_until

pytestmark = pytest.mark.timeout(600)

_TOPICS = ["rivers", "bread", "comets", "bees", "trains", "glaciers", "violins", "tides", "maps", "copper"]


def documents(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Short, distinct documents (a few dozen tokens each)."""
    return [
        {
            "document": f"Report {seed}-{i}. This note is about {_TOPICS[i % 10]} and "
            f"{_TOPICS[(i * 7 + 3) % 10]}. It was written on day {i % 28 + 1} and lists "
            f"{i % 9 + 2} facts."
        }
        for i in range(count)
    ]


def wait_finished(job: BulkJob, timeout: float = 300) -> BulkJob:
    wait_until(lambda: not BulkJob.objects.get(pk=job.pk).is_active, timeout, f"job {job.pk} to finish")
    job.refresh_from_db()
    return job


def bus_outputs(client: EngineClient, model: str, docs: list[dict[str, str]]) -> list[str]:
    """The same greedy requests straight through the bus, a few at a time."""

    def one(doc: dict[str, str]) -> str:
        messages = [{"role": "user", "content": TEMPLATE.format_map(doc)}]
        with client.generate(model, params=PARAMS, messages=messages) as stream:
            return stream.result().outputs[0].text

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, docs))


def rest_output(stack: BulkStack, doc: dict[str, str]) -> str:
    messages = [{"role": "user", "content": TEMPLATE.format_map(doc)}]
    body = {"model": stack.model, "messages": messages, **PARAMS}
    request = urllib.request.Request(
        stack.base_url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["choices"][0]["message"]["content"]


def outputs_of(job: BulkJob) -> list[str]:
    return list(job.items.order_by("index").values_list("output", flat=True))


def engine_totals(client: EngineClient, model: str) -> tuple[int, int]:
    """(prompt, generated) tokens the model's engine has processed: every request counts its prompt once when
    first scheduled and each token it samples, so a request run twice shows in both."""
    (info,) = [m for m in client.list_models() if m.name == model]
    stats = [r.data["stats"] for r in info.replicas]
    return sum(s["prompt_tokens_total"] for s in stats), sum(s["generation_tokens_total"] for s in stats)


def settled_engine_totals(client: EngineClient, model: str) -> tuple[int, int]:
    """`engine_totals` once the engine is idle and its heartbeat has caught up."""

    def idle() -> bool:
        (info,) = [m for m in client.list_models() if m.name == model]
        return all(r.data.get("inflight") == 0 and r.data["stats"]["num_running"] == 0 for r in info.replicas)

    wait_until(idle, 60, "the engine to be idle")
    time.sleep(1)  # a few heartbeats
    return engine_totals(client, model)


def assert_generated_once(job: BulkJob, before: tuple[int, int], after: tuple[int, int]) -> None:
    """Every request the engine ran for ``job`` is one whose result was stored: nothing ran twice."""
    stored = job.items.filter(status=BulkItem.Status.DONE).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
    )
    assert (after[0] - before[0], after[1] - before[1]) == (stored["prompt"], stored["completion"])


def test_summarise_32_documents(bulk_stack: BulkStack, bus_client: EngineClient) -> None:
    docs = documents(32)
    started = time.monotonic()
    job = services.create_job(bulk_stack.model, TEMPLATE, docs, PARAMS, name="32 documents")
    job = wait_finished(job)
    elapsed = time.monotonic() - started
    progress = services.progress(job)
    print(
        f"32 documents in {elapsed:.1f}s: {progress.items_per_s:.2f} items/s, "
        f"{progress.tokens_per_s:.1f} tokens/s"
    )
    assert job.status == BulkJob.Status.COMPLETED
    assert (progress.total, progress.done, progress.failed) == (32, 32, 0)
    assert progress.completion_tokens > 0 and progress.eta_s is None
    stored = outputs_of(job)
    assert all(stored)
    for i in (0, 11, 21, 31):  # a sample through the REST API...
        assert stored[i] == rest_output(bulk_stack, docs[i]), i
    assert stored == bus_outputs(bus_client, bulk_stack.model, docs)  # ...and every one through the bus


def vector(encoded: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(encoded), dtype="<f4")


def test_embed_an_uploaded_file_of_texts(bulk_stack: BulkStack, bus_client: EngineClient) -> None:
    """An embed job over an uploaded JSONL file: one result line per text, its vector as base64 float32,
    equal to the engine's answer for the same text alone; a text the engine refuses fails alone."""
    texts = [d["document"] for d in documents(5, seed=5)]
    lines = [json.dumps({"text": text}) for text in texts] + [json.dumps({"text": "word " * 3000})]
    upload = SimpleUploadedFile("texts.jsonl", "\n".join(lines).encode())
    with pytest.raises(BadRequest, match="max_tokens"):  # sampling parameters mean nothing to an embed job
        services.create_job(bulk_stack.model, "{text}", [], {"max_tokens": 8}, kind=BulkJob.Kind.EMBED)
    job = services.create_job(
        bulk_stack.model, "{text}", uploads.iter_items(upload), kind=BulkJob.Kind.EMBED, name="embed 5 texts"
    )
    job = wait_finished(job, timeout=60)
    assert job.status == BulkJob.Status.COMPLETED and (job.done, job.failed, job.total) == (5, 1, 6)
    results = [json.loads(line) for line in uploads.jsonl_lines(services.iter_results(job))]
    assert [r["index"] for r in results] == list(range(6))
    assert results[5]["status"] == "failed" and results[5]["error"]["status_code"] == 400
    expected_tokens = 0
    for text, result in zip(texts, results, strict=False):
        assert result["status"] == "done" and result["input"] == {"text": text}
        alone = bus_client.embed(bulk_stack.model, text)
        ours, theirs = vector(result["output"]), vector(alone.embedding)
        assert ours.shape == theirs.shape and abs(np.linalg.norm(ours) - 1) < 1e-4
        assert float(ours @ theirs) / float(np.linalg.norm(theirs)) >= 0.9999
        assert result["prompt_tokens"] == alone.count and result["completion_tokens"] == 0
        expected_tokens += alone.count
    assert (job.prompt_tokens, job.completion_tokens) == (expected_tokens, 0)


def test_pool_process_killed_mid_job(bulk_stack: BulkStack, bus_client: EngineClient) -> None:
    """SIGKILL of the pool process running a job: the worker redelivers the task at once, the new run takes
    the dead run's items over within seconds and reads their requests' output instead of running them
    again."""
    docs = documents(32, seed=4)
    before = settled_engine_totals(bus_client, bulk_stack.model)
    job = services.create_job(
        bulk_stack.model, TEMPLATE, docs, {**PARAMS, "max_tokens": 24}, name="pool kill"
    )
    wait_until(lambda: BulkJob.objects.get(pk=job.pk).done >= 8, 240, "8 items done")
    runner = wait_until(lambda: BulkRunner.objects.filter(job=job).first(), 30, "a runner")
    in_flight = job.items.filter(runner=runner).count()
    done_at_kill = BulkJob.objects.get(pk=job.pk).done
    bulk_stack.kill_pool_process(int(runner.worker.rpartition(":")[2]))
    killed = time.monotonic()
    wait_until(lambda: BulkJob.objects.get(pk=job.pk).done > done_at_kill, 60, "progress after the kill")
    recovered = time.monotonic() - killed
    print(f"{in_flight} items in flight at the kill; the next result stored {recovered:.1f}s later")
    assert recovered < 15, recovered
    job = wait_finished(job)
    assert job.status == BulkJob.Status.COMPLETED and (job.done, job.failed) == (32, 0)
    assert_generated_once(job, before, settled_engine_totals(bus_client, bulk_stack.model))


def test_worker_killed_mid_job(bulk_stack: BulkStack, bus_client: EngineClient) -> None:
    """SIGKILL of the whole worker, then a new worker: the job completes, each item stored and run once."""
    docs = documents(32, seed=1)
    too_long = {"document": "word " * 3000}  # beyond the engine's 512-token context
    before = settled_engine_totals(bus_client, bulk_stack.model)
    job = services.create_job(
        bulk_stack.model,
        TEMPLATE,
        [*docs, too_long, {"title": "no document field"}],
        PARAMS,
        name="worker killed",
    )
    wait_until(lambda: job.items.filter(status=BulkItem.Status.DONE).count() >= 4, 240, "4 items done")
    bulk_stack.kill_worker()
    unfinished = job.items.filter(status=BulkItem.Status.PENDING).count()
    status = BulkJob.objects.get(pk=job.pk).status
    bulk_stack.start_worker()  # before asserting: the package's later tests need a worker
    assert unfinished and status == BulkJob.Status.RUNNING, (unfinished, status)
    job = wait_finished(job)
    assert job.status == BulkJob.Status.COMPLETED
    items = list(job.items.order_by("index"))
    assert [i.index for i in items] == list(range(34))
    assert all(i.status == BulkItem.Status.DONE for i in items[:32])
    assert items[32].status == items[33].status == BulkItem.Status.FAILED
    assert items[32].error["status_code"] == 400 and "document" in items[33].error["message"]
    assert (job.done, job.failed, job.total) == (32, 2, 34)
    after = settled_engine_totals(bus_client, bulk_stack.model)
    assert [i.output for i in items[:32]] == bus_outputs(bus_client, bulk_stack.model, docs)
    assert_generated_once(job, before, after)


def test_engine_killed_mid_job(bulk_stack: BulkStack, bus_client: EngineClient) -> None:
    docs = documents(32, seed=2)
    job = services.create_job(bulk_stack.model, TEMPLATE, docs, PARAMS, name="engine killed")
    wait_until(lambda: job.items.filter(status=BulkItem.Status.DONE).count() >= 10, 240, "10 items done")
    bulk_stack.kill_engine()
    done_before = job.items.filter(status=BulkItem.Status.DONE).count()
    time.sleep(3)  # the worker notices the engine is gone and backs off
    bulk_stack.start_engine()
    job = wait_finished(job)
    assert job.status == BulkJob.Status.COMPLETED
    assert done_before < 32
    assert job.items.filter(status=BulkItem.Status.DONE).count() == 32
    assert outputs_of(job) == bus_outputs(bus_client, bulk_stack.model, docs)


def test_cancel_aborts_in_flight_requests(bulk_stack: BulkStack, bus_client: EngineClient) -> None:
    job = services.create_job(
        bulk_stack.model,
        TEMPLATE,
        documents(80, seed=3),
        {"temperature": 0.0, "max_tokens": 32},
        name="cancelled",
    )
    wait_until(lambda: job.items.filter(status=BulkItem.Status.DONE).exists(), 240, "an item done")
    assert services.cancel_job(job)
    job = wait_finished(job, timeout=60)
    assert job.status == BulkJob.Status.CANCELLED and job.cancelled_at is not None
    progress = services.progress(job)
    assert progress.pending > 0
    assert not services.cancel_job(job)

    def engine_idle() -> bool:
        (info,) = [m for m in bus_client.list_models() if m.name == bulk_stack.model]
        return all(r.data.get("inflight") == 0 for r in info.replicas)

    wait_until(engine_idle, 20, "the engine to drop the job's requests")
    time.sleep(2)
    assert services.progress(job).done == progress.done  # nothing ran after the cancel
