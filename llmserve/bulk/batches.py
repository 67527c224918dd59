"""The OpenAI Batch API over bulk jobs: input file -> job, job -> output and error files, and the JSON shapes.

Input lines are ``{"custom_id", "method": "POST", "url", "body"}``; a file that is not a valid batch is
refused when the batch is created (400, naming the line), so a created batch only fails item by item. Output
lines are ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`` with the
body the REST endpoint would have returned; requests the API refused (status 4xx) go to the error file in the
same shape.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.db import transaction

from llmserve.api import schema
from llmserve.api.errors import BadRequest
from llmserve.auth import model_refused
from llmserve.bulk import services
from llmserve.bulk.models import Batch, BatchFile, BulkJob
from llmserve.bulk.requests import ENDPOINT_KINDS
from llmserve.models import APIKey

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}

_STATUS = {
    BulkJob.Status.QUEUED: "validating",
    BulkJob.Status.RUNNING: "in_progress",
    BulkJob.Status.PAUSED: "in_progress",
    BulkJob.Status.CANCELLING: "cancelling",
    BulkJob.Status.CANCELLED: "cancelled",
    BulkJob.Status.COMPLETED: "completed",
    BulkJob.Status.FAILED: "failed",
}


def parse_input(content: bytes, endpoint: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(model, custom id, body) of each request of a batch input file, read line by line (the file is never
    decoded or split whole); `BadRequest` names the first bad line."""
    model, seen = None, set()
    param = "input_file_id"
    for number, raw in enumerate(io.BytesIO(content), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            raise BadRequest(f"Line {number} of the input file is not valid JSON.", param=param) from None
        if not isinstance(line, dict):
            raise BadRequest(f"Line {number} of the input file is not a JSON object.", param=param)
        try:
            line = schema.validate(schema.BatchRequestLine, line)
        except BadRequest as exc:
            raise BadRequest(f"Line {number}: {exc.message}", param=param) from None
        if line.custom_id in seen:
            raise BadRequest(f"Line {number}: duplicate custom_id {line.custom_id!r}.", param=param)
        if line.url != endpoint:
            raise BadRequest(f"Line {number}: every request must be `POST {endpoint}`.", param=param)
        body = line.body
        if not isinstance(body.get("model"), str):
            raise BadRequest(f"Line {number}: `body` must be a request object with a `model`.", param=param)
        if model is not None and body["model"] != model:
            raise BadRequest(f"Line {number}: all requests of a batch must use the same model.", param=param)
        model = body["model"]
        seen.add(line.custom_id)
        yield model, line.custom_id, _storable(body)
    if model is None:
        raise BadRequest("The input file holds no requests.", param=param)


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _storable(body: dict[str, Any]) -> dict[str, Any] | services.RefusedItem:
    """`body`, or where it holds a lone surrogate (no database stores one as text) the line's error, with the
    body kept with U+FFFD in its place."""
    where = schema.lone_surrogate(body)
    if where is None:
        return body
    error = BadRequest(
        f"`body.{where}` holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not text.",
        param=f"body.{where}",
        code="invalid_value",
    )
    kept = json.loads(LONE_SURROGATE.sub("\ufffd", json.dumps(body, ensure_ascii=False)))
    return services.RefusedItem(kept, {"status_code": error.status, **error.body()["error"]})


def create_batch(
    input_file: BatchFile,
    endpoint: str,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    owner: APIKey | None = None,
) -> Batch:
    """A batch over ``input_file``'s requests. The job's items are created while the file is parsed, in one
    transaction that a bad line rolls back whole."""
    if endpoint not in ENDPOINT_KINDS:
        raise BadRequest(f"`endpoint` must be one of {', '.join(ENDPOINT_KINDS)}.", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise BadRequest('`completion_window` must be "24h".', param="completion_window")
    if input_file.purpose != BatchFile.Purpose.BATCH:
        raise BadRequest('The input file\'s purpose must be "batch".', param="input_file_id")
    content = input_file.content
    parsed = parse_input(content if isinstance(content, bytes) else bytes(content), endpoint)
    first = next(parsed)  # raises for an empty or bad first request
    if owner is not None and not owner.may_use(first[0]):  # every line has the first line's model
        raise model_refused(first[0])
    requests = itertools.chain([first], parsed)
    # create_job reads a body, then its custom id: tee holds at most one request between the two.
    for_bodies, for_ids = itertools.tee(requests)
    with transaction.atomic():
        job = services.create_job(
            first[0],
            "",
            (body for _, _, body in for_bodies),
            kind=ENDPOINT_KINDS[endpoint],
            custom_ids=(custom_id for _, custom_id, _ in for_ids),
            name=f"batch {input_file.filename}",
            owner=owner,
        )
        return Batch.objects.create(
            job=job,
            endpoint=endpoint,
            input_file=input_file,
            owner=owner,
            completion_window=completion_window,
            metadata=metadata,
        )


def as_openai(batch: Batch) -> dict[str, Any]:
    job = batch.job
    counts = services.progress(job)

    def ts(value: Any) -> int | None:
        return int(value.timestamp()) if value else None

    ended = job.finished_at
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": _STATUS[job.status],
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": ts(batch.created_at),
        "in_progress_at": ts(job.started_at),
        "expires_at": ts(batch.created_at + COMPLETION_WINDOWS.get(batch.completion_window, timedelta(0))),
        "finalizing_at": ts(ended) if job.status == BulkJob.Status.COMPLETED else None,
        "completed_at": ts(ended) if job.status == BulkJob.Status.COMPLETED else None,
        "failed_at": ts(ended) if job.status == BulkJob.Status.FAILED else None,
        "expired_at": None,
        "cancelling_at": ts(job.cancelled_at),
        "cancelled_at": ts(ended) if job.status == BulkJob.Status.CANCELLED else None,
        "request_counts": {"total": counts.total, "completed": counts.done, "failed": counts.failed},
        "metadata": batch.metadata,
    }
