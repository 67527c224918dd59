"""The bulk admin on the real stack: pause, resume and cancel mid-job; live progress; result downloads; a
large upload read a line at a time; a long job that keeps the worker's memory flat."""

from __future__ import annotations

import csv
import io
import json
import statistics
import time
import tracemalloc

import psutil
import pytest
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile, TemporaryUploadedFile
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from inference_engine.bus.client import EngineClient
from llmserve.bulk import services, uploads
from llmserve.bulk.models import BulkItem, BulkJob, BulkRunner

from .conftest import PARAMS, TEMPLATE, BulkStack, wait_until
from .test_jobs import documents, wait_finished

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def browser(bulk_stack: BulkStack) -> Client:
    admin, _ = User.objects.get_or_create(
        username="bulk-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(admin)
    return client


def control_url(job: BulkJob, action: str) -> str:
    return reverse("admin:llmserve_bulkjob_control", args=[job.pk, action])


def control(browser: Client, job: BulkJob, action: str) -> None:
    assert browser.post(control_url(job, action)).status_code == 302


def counts(job: BulkJob) -> tuple[int, int, int]:
    job.refresh_from_db()
    return job.done, job.failed, job.total


def bulk_in_flight(client: EngineClient, model: str) -> int:
    (info,) = [m for m in client.list_models() if m.name == model]
    return sum(r.data.get("inflight", 0) for r in info.replicas)


def test_pause_resume_cancel_mid_job(
    bulk_stack: BulkStack, browser: Client, bus_client: EngineClient
) -> None:
    job = services.create_job(
        bulk_stack.model, TEMPLATE, documents(64, seed=5), {**PARAMS, "max_tokens": 16}, name="controls"
    )
    page = reverse("admin:llmserve_bulkjob_change", args=[job.pk])
    wait_until(lambda: counts(job)[0] >= 4, 240, "4 items done")

    control(browser, job, "pause")
    assert BulkJob.objects.get(pk=job.pk).status == BulkJob.Status.PAUSED
    # The runners abort their requests, put the items back and leave: the engine is free within seconds.
    wait_until(lambda: not BulkRunner.objects.filter(job=job).exists(), 30, "the runners to leave")
    wait_until(lambda: bulk_in_flight(bus_client, bulk_stack.model) == 0, 30, "the engine to drop the job")
    paused = counts(job)
    assert paused[0] < 64
    assert not job.items.filter(runner__isnull=False).exists()
    html = browser.get(page).content.decode()
    assert control_url(job, "resume") in html and control_url(job, "pause") not in html
    time.sleep(2)
    assert counts(job) == paused  # nothing ran while paused
    assert services.progress(BulkJob.objects.get(pk=job.pk)).eta_s is None

    control(browser, job, "resume")
    wait_until(lambda: counts(job)[0] > paused[0], 120, "progress after resuming")
    html = browser.get(page).content.decode()
    assert control_url(job, "pause") in html and control_url(job, "cancel") in html

    control(browser, job, "cancel")
    job = wait_finished(job, timeout=60)
    assert job.status == BulkJob.Status.CANCELLED
    done = job.items.filter(status=BulkItem.Status.DONE).count()
    assert 0 < done < 64 and job.done == done
    assert job.completion_tokens == sum(job.items.values_list("completion_tokens", flat=True))
    wait_until(lambda: bulk_in_flight(bus_client, bulk_stack.model) == 0, 30, "the engine to drop the job")
    time.sleep(1)
    assert counts(job)[0] == done  # nothing stored after the cancel
    progress = browser.get(reverse("admin:llmserve_bulkjob_progress", args=[job.pk])).json()
    assert (progress["status"], progress["done"], progress["total"], progress["active"]) == (
        "cancelled",
        done,
        64,
        False,
    )


def test_results_download(bulk_stack: BulkStack, browser: Client) -> None:
    docs = documents(6, seed=6)
    job = services.create_job(
        bulk_stack.model, TEMPLATE, [*docs, {"title": "no document"}], PARAMS, name="downloads"
    )
    job = wait_finished(job)
    stored = {i.index: i for i in job.items.all()}

    response = browser.get(reverse("admin:llmserve_bulkjob_results", args=[job.pk, "jsonl"]))
    assert response.status_code == 200 and response["Content-Type"] == "application/jsonl"
    assert f"bulk-job-{job.pk}.jsonl" in response["Content-Disposition"]
    lines = [json.loads(line) for line in b"".join(response.streaming_content).decode().splitlines()]
    assert [line["index"] for line in lines] == list(range(7))
    for line in lines[:6]:
        item = stored[line["index"]]
        assert line["status"] == "done" and line["output"] == item.output and line["output"]
        assert line["input"] == docs[line["index"]]
        assert (line["prompt_tokens"], line["completion_tokens"]) == (
            item.prompt_tokens,
            item.completion_tokens,
        )
    assert lines[6]["status"] == "failed" and "document" in lines[6]["error"]["message"]

    response = browser.get(reverse("admin:llmserve_bulkjob_results", args=[job.pk, "csv"]))
    assert response.status_code == 200 and response["Content-Type"] == "text/csv"
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [int(row["index"]) for row in rows] == list(range(7))
    for row in rows[:6]:
        item = stored[int(row["index"])]
        assert row["status"] == "done" and row["output"] == item.output
        assert json.loads(row["input"]) == docs[int(row["index"])]
        assert int(row["completion_tokens"]) == item.completion_tokens
    assert rows[6]["status"] == "failed" and "document" in rows[6]["error"]
    assert browser.get(reverse("admin:llmserve_bulkjob_results", args=[job.pk, "xml"])).status_code == 404


def test_upload_is_read_a_line_at_a_time(bulk_stack: BulkStack) -> None:
    """10,000 CSV rows through the upload path: validated and inserted while read, so the memory it takes is a
    fraction of the file's size (holding the file, or its items, would take more than all of it)."""
    upload = TemporaryUploadedFile("docs.csv", "text/csv", 0, "utf-8")
    upload.write(b"document,topic\n")
    filler = "The tide came in over the old stones, and the harbour master wrote it down. " * 16
    for i in range(10_000):
        upload.write(f'"Report {i}: {filler}held {i % 40} ships.",ships\n'.encode())
    upload.size = upload.tell()
    tracemalloc.start()
    try:
        assert uploads.count_items(upload) == 10_000
        job = services.create_job(bulk_stack.model, TEMPLATE, uploads.iter_items(upload), PARAMS, start=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        upload.close()
    print(f"upload of {upload.size} bytes: peak {peak} bytes allocated")
    assert peak < upload.size / 2
    assert (job.total, job.items.count()) == (10_000, 10_000)
    assert job.items.get(index=9_999).input == {
        "document": f"Report 9999: {filler}held 39 ships.",
        "topic": "ships",
    }


def test_upload_refuses_bad_files(bulk_stack: BulkStack, browser: Client) -> None:
    for name, content, message in (
        ("docs.jsonl", b'{"document": "a"}\n[1, 2]\n', "Line 2 is not a JSON object."),
        ("docs.jsonl", b'{"document": "a"}\n{oops\n', "Line 2 is not valid JSON."),
        ("docs.csv", b"document\na,b\n", "Line 2 has more fields than the header."),
        ("docs.csv", b"document\n", "The file holds no items."),
        ("docs.jsonl", b"\xff\xfe", "The file is not UTF-8 text."),
    ):
        response = browser.post(
            reverse("admin:llmserve_bulkjob_add"),
            {
                "name": "bad upload",
                "model": bulk_stack.model,
                "kind": "chat",
                "template": TEMPLATE,
                "params": json.dumps(PARAMS),
                "priority": "10",
                "file": SimpleUploadedFile(name, content),
            },
        )
        assert response.status_code == 200 and message in response.content.decode(), name
    assert not BulkJob.objects.filter(name="bad upload").exists()


def test_long_job_keeps_the_worker_flat_and_the_admin_page_constant(
    bulk_stack: BulkStack, browser: Client
) -> None:
    """A smaller version of benchmarks/bulk.py's 10,000-document job: every item stored once, the pool
    processes' memory flat, and the job page costing the same queries at 60 items as at 1 (progress is read
    from the job's counters), so its render time does not grow with the job."""
    small = wait_finished(services.create_job(bulk_stack.model, TEMPLATE, documents(1, seed=7), PARAMS))
    job = services.create_job(
        bulk_stack.model,
        "Say yes: {document}",
        ({"document": f"note {i}"} for i in range(60)),
        {"temperature": 0, "max_tokens": 2},
        name="long",
    )
    pools = [psutil.Process(pid) for pid in bulk_stack.pool_processes()]
    start = [p.memory_info().rss for p in pools]
    # A first render fills this process's caches (the admin's content type), which the counts leave out.
    assert browser.get(reverse("admin:llmserve_bulkjob_change", args=[small.pk])).status_code == 200
    renders, queries = [], set()
    while BulkJob.objects.get(pk=job.pk).is_active:
        for shown in (job, small):
            with CaptureQueriesContext(connection) as captured:
                started = time.perf_counter()
                assert (
                    browser.get(reverse("admin:llmserve_bulkjob_change", args=[shown.pk])).status_code == 200
                )
                if shown is job:
                    renders.append(time.perf_counter() - started)
            queries.add((shown is job, len(captured)))
        time.sleep(1)
    growth = max(p.memory_info().rss - rss for p, rss in zip(pools, start, strict=True)) / 2**20
    print(f"pool RSS growth {growth:.1f} MB; job page {1000 * statistics.median(renders):.0f} ms median")
    job.refresh_from_db()
    assert (job.status, job.done, job.total) == ("completed", 60, 60)
    assert job.items.filter(status=BulkItem.Status.DONE).count() == 60
    assert growth < 50
    assert len({count for _, count in queries}) == 1, queries
