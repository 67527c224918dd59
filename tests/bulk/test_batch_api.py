"""The OpenAI Batch API through the official openai client against daphne, and the admin's upload form."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from llmserve.bulk import batches, services
from llmserve.bulk.models import BatchFile, BulkJob
from llmserve.models import APIKey
from tests.rate_window import early_in_a_rate_window

from .conftest import PARAMS, TEMPLATE, BulkStack, wait_until

pytestmark = pytest.mark.timeout(300)


def batch_file(model: str, count: int, max_tokens: int = 8) -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "temperature": 0,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Name a colour, number {i}."}],
            },
        }
        for i in range(count)
    ]
    lines.append(
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x " * 3000}]},
        }
    )
    return "\n".join(json.dumps(line) for line in lines).encode()


@pytest.fixture
def client(bulk_stack: BulkStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=bulk_stack.base_url + "/v1", api_key=bulk_stack.api_key, max_retries=0)


def test_openai_batch_end_to_end(bulk_stack: BulkStack, client: openai.OpenAI) -> None:
    uploaded = client.files.create(
        file=("requests.jsonl", io.BytesIO(batch_file(bulk_stack.model, 6))), purpose="batch"
    )
    assert uploaded.purpose == "batch" and uploaded.filename == "requests.jsonl"
    assert client.files.retrieve(uploaded.id).bytes == uploaded.bytes
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"purpose": "test"},
    )
    assert batch.request_counts.total == 7 and batch.metadata == {"purpose": "test"}
    batch = wait_until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        180,
        "the batch to complete",
    )
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 1)
    assert batch.completed_at and batch.in_progress_at
    assert batch.id in [b.id for b in client.batches.list(limit=10).data]

    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"req-{i}" for i in range(6)]
    for line in lines[:2]:  # each body is what the REST endpoint answers for the same request
        i = int(line["custom_id"].split("-")[1])
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        direct = client.chat.completions.create(
            model=bulk_stack.model,
            temperature=0,
            max_tokens=8,
            messages=[{"role": "user", "content": f"Name a colour, number {i}."}],
        )
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["message"]


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_openai_batch_of_embeddings(bulk_stack: BulkStack, client: openai.OpenAI) -> None:
    """``/v1/embeddings`` lines: each output line carries the answer ``/v1/embeddings`` gives for the same
    body; a line the endpoint refuses goes to the error file and the others run."""
    texts = {"one": "The river floods every spring.", "two": ["Bread rises.", "Comets have tails."]}
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": bulk_stack.model, "input": text},
        }
        for custom_id, text in texts.items()
    ]
    lines.insert(
        1,
        {
            "custom_id": "no-input",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": bulk_stack.model},
        },
    )
    content = "\n".join(json.dumps(line) for line in lines).encode()
    uploaded = client.files.create(file=("embed.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.endpoint == "/v1/embeddings" and batch.request_counts.total == 3
    batch = wait_until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        60,
        "the batch to complete",
    )
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)

    output = {
        line["custom_id"]: line["response"]
        for line in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    assert sorted(output) == ["one", "two"]
    for custom_id, text in texts.items():
        response = output[custom_id]
        assert response["status_code"] == 200
        body = response["body"]
        direct = client.embeddings.create(model=bulk_stack.model, input=text, encoding_format="float")
        assert body["object"] == "list" and body["model"] == bulk_stack.model
        assert [item["index"] for item in body["data"]] == list(range(len(direct.data)))
        assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens > 0
        for ours, theirs in zip(body["data"], direct.data, strict=True):
            assert ours["object"] == "embedding" and len(ours["embedding"]) == len(theirs.embedding)
            assert cosine(ours["embedding"], theirs.embedding) >= 0.9999
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "no-input" and error["response"]["status_code"] == 400
    assert "input" in error["response"]["body"]["error"]["message"]


def test_a_batch_line_with_a_lone_surrogate_fails_alone(bulk_stack: BulkStack, client: openai.OpenAI) -> None:
    """``"\\ud800"`` is valid JSON but no text (PostgreSQL refuses to store it): that line's error is recorded
    in the error file, naming the field, and the other lines run."""
    good = batch_file(bulk_stack.model, 2).splitlines()[:2]
    bad = (
        '{"custom_id": "surrogate", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
        f'"{bulk_stack.model}", "max_tokens": 4, "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}}}'
    ).encode()
    uploaded = client.files.create(
        file=("s.jsonl", io.BytesIO(b"\n".join([good[0], bad, good[1]]))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.request_counts.total == 3
    batch = wait_until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        180,
        "the batch to complete",
    )
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "surrogate" and error["response"]["status_code"] == 400
    body = error["response"]["body"]["error"]
    assert body["param"] == "body.messages[0].content" and "surrogate" in body["message"], body


def test_openai_batch_cancel(bulk_stack: BulkStack, client: openai.OpenAI) -> None:
    uploaded = client.files.create(
        file=("many.jsonl", io.BytesIO(batch_file(bulk_stack.model, 60, 48))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0, 180, "a request done")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    final = wait_until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b,
        60,
        "the batch to be cancelled",
    )
    assert 0 < final.request_counts.completed < 60 and final.cancelled_at
    done = client.files.content(final.output_file_id).text.splitlines()
    assert len(done) == final.request_counts.completed


def test_batch_api_refusals(bulk_stack: BulkStack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    content = b'{"custom_id": "a", "url": "/v1/embeddings"}\n'
    bad = client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="Line 1"):
        client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = openai.OpenAI(base_url=bulk_stack.base_url + "/v1", api_key="sk-llm-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        other.batches.list()


def test_parse_input_names_the_bad_line() -> None:
    ok = (
        b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        b'"body": {"model": "m", "prompt": "x"}}'
    )
    parsed = list(batches.parse_input(ok + b"\n\n", "/v1/completions"))
    assert parsed == [("m", "a", {"model": "m", "prompt": "x"})]
    for content, message in (
        (b"nope", "Line 1"),
        (ok + b"\n" + ok, "duplicate"),
        (ok.replace(b'"m"', b'"n"') + b"\n" + ok.replace(b'"a"', b'"b"'), "same model"),
        (b"", "no requests"),
    ):
        with pytest.raises(batches.BadRequest, match=message):
            list(batches.parse_input(content, "/v1/completions"))


def test_admin_upload_progress_and_cancel(bulk_stack: BulkStack) -> None:
    admin, _ = User.objects.get_or_create(
        username="bulk-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    browser = Client()
    browser.force_login(admin)
    rows = "document\n" + "".join(f"Note {i}: the harbour opened at dawn.\n" for i in range(40))
    upload = io.BytesIO(rows.encode())
    upload.name = "docs.csv"
    response = browser.post(
        reverse("admin:llmserve_bulkjob_add"),
        {
            "name": "admin upload",
            "model": bulk_stack.model,
            "kind": "chat",
            "template": TEMPLATE,
            "params": json.dumps({**PARAMS, "max_tokens": 32}),
            "priority": "10",
            "file": upload,
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = BulkJob.objects.get(name="admin upload")
    assert job.items.count() == 40
    assert job.items.first().input == {"document": "Note 0: the harbour opened at dawn."}
    wait_until(lambda: job.items.filter(status="done").exists(), 120, "an item done")
    page = browser.get(reverse("admin:llmserve_bulkjob_change", args=[job.pk])).content.decode()
    assert "/ 0 / 40" in page and "Tokens/s" in page and "ETA" in page
    listing = browser.get(reverse("admin:llmserve_bulkjob_changelist")).content.decode()
    assert "admin upload" in listing
    browser.post(
        reverse("admin:llmserve_bulkjob_changelist"), {"action": "cancel_jobs", "_selected_action": [job.pk]}
    )
    wait_until(lambda: BulkJob.objects.get(pk=job.pk).status == "cancelled", 60, "the job to be cancelled")
    items = browser.get(reverse("admin:llmserve_bulkitem_changelist") + f"?job__id__exact={job.pk}")
    assert items.status_code == 200 and "40 bulk items" in items.content.decode()


def models_status(stack: BulkStack, raw_key: str) -> int:
    request = urllib.request.Request(
        stack.base_url + "/v1/models", headers={"Authorization": f"Bearer {raw_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_batch_tokens_per_key_and_its_rate_limit(bulk_stack: BulkStack) -> None:
    """A Batch API job's requests count against its key's requests-per-minute limit, as the same requests
    through the REST API would (the job waits for the next minute rather than fail), each request once; and
    its tokens are accounted to the job and to the key."""
    key, _ = APIKey.objects.create_key("batch owner", rate_limit=3)
    content = batch_file(bulk_stack.model, 5)
    content = b"\n".join(content.splitlines()[:5])  # without the too-long request
    upload = BatchFile.objects.create(owner=key, purpose="batch", filename="five.jsonl", content=content)
    roomy, roomy_secret = APIKey.objects.create_key("roomy batch owner", rate_limit=6)
    four = b"\n".join(content.splitlines()[:4])
    roomy_upload = BatchFile.objects.create(owner=roomy, purpose="batch", filename="four.jsonl", content=four)
    # Start early in a rate-limit window, so that the jobs cannot reach the next one.
    early_in_a_rate_window(40)
    window = time.time() // 60
    batch = batches.create_batch(upload, "/v1/chat/completions", owner=key)
    roomy_job = batches.create_batch(roomy_upload, "/v1/chat/completions", owner=roomy).job
    job = batch.job
    assert job.owner == key
    wait_until(lambda: BulkJob.objects.get(pk=job.pk).done == 3, 45, "three requests done")
    # The roomy key's four requests left it two of its six: the job counted nothing it did not send.
    wait_until(lambda: not BulkJob.objects.get(pk=roomy_job.pk).is_active, 45, "the roomy batch to complete")
    assert [models_status(bulk_stack, roomy_secret) for _ in range(3)] == [200, 200, 429]
    assert time.time() // 60 == window, "the rate-limit window turned during the test: too slow to tell"
    time.sleep(3)
    job.refresh_from_db()
    assert (job.done, job.status) == (3, BulkJob.Status.RUNNING)  # the other two wait for the next minute
    done = job.items.filter(status="done")
    assert (job.prompt_tokens, job.completion_tokens) == (
        sum(done.values_list("prompt_tokens", flat=True)),
        sum(done.values_list("completion_tokens", flat=True)),
    )
    assert job.completion_tokens > 0
    assert services.key_usage(key) == {
        "jobs": 1,
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
    }
    admin, _ = User.objects.get_or_create(
        username="bulk-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    browser = Client()
    browser.force_login(admin)
    usage = browser.get(reverse("admin:llmserve_keyusage_changelist")).content.decode()
    assert "batch owner" in usage and f">{job.completion_tokens}<" in usage
    assert services.cancel_job(job)
    wait_until(lambda: BulkJob.objects.get(pk=job.pk).status == "cancelled", 30, "the batch to be cancelled")
