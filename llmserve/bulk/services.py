"""The Python API of bulk jobs, for host projects, the admin and the Batch API.

from llmserve.bulk import services
job = services.create_job("smol", "Summarise the following document:\\n\\n{document}",
                          [{"document": text} for text in documents],
                          {"temperature": 0, "max_tokens": 64})
services.progress(job)   # done / failed / total, tokens/s, ETA
services.cancel_job(job)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from inference_engine.bus.client import EngineClient
from llmserve import bus, conf
from llmserve.bulk import requests
from llmserve.bulk.models import BulkItem, BulkJob


def create_job(
    model: str,
    template: str,
    items: Iterable[dict[str, Any]],
    params: dict[str, Any] | None = None,
    priority: int | None = None,
    *,
    kind: str = BulkJob.Kind.CHAT,
    name: str = "",
    custom_ids: Iterable[str] | None = None,
    start: bool = True,
) -> BulkJob:
    """Create a job over ``items`` and (once the transaction commits) queue it on Celery.

    ``template`` is a format string over each item's fields; an empty one makes each item a whole OpenAI
    request body (what the Batch API does). Invalid ``params`` raise `llmserve.api.errors.BadRequest` here
    rather than failing every item later. ``priority`` defaults to ``LLMSERVE["BULK_PRIORITY"]``.
    """
    params = params or {}
    if template:
        requests.job_params(params)
    ids = list(custom_ids) if custom_ids is not None else None
    with transaction.atomic():
        job = BulkJob.objects.create(
            model=model,
            template=template,
            params=params,
            kind=kind,
            name=name,
            priority=conf.get("BULK_PRIORITY") if priority is None else priority,
        )
        BulkItem.objects.bulk_create(
            (
                BulkItem(job=job, index=i, input=item, custom_id=ids[i] if ids else "")
                for i, item in enumerate(items)
            ),
            batch_size=500,
        )
        if start:
            transaction.on_commit(lambda: start_job(job))
    return job


def start_job(job: BulkJob) -> None:
    """Queue (or re-queue: it is idempotent) the task that runs ``job``."""
    from llmserve.bulk.tasks import run_bulk_job

    run_bulk_job.delay(job.pk)


def cancel_job(job: BulkJob, client: EngineClient | None = None) -> bool:
    """Stop ``job``: no new item starts and the in-flight requests are aborted in the engine.

    The requests are aborted here by their deterministic ids, so cancelling works without reaching the worker
    that runs them. Returns False when the job had already finished.
    """
    now = timezone.now()
    cancellable = BulkJob.objects.filter(
        pk=job.pk, status__in=(BulkJob.Status.QUEUED, BulkJob.Status.RUNNING)
    )
    if not cancellable.update(status=BulkJob.Status.CANCELLING, cancelled_at=now):
        return False
    client = client or bus.client()
    in_flight = job.items.filter(status=BulkItem.Status.PENDING, lease_until__gt=now, attempts__gt=0)
    leased = False
    for index, attempt in in_flight.values_list("index", "attempts"):
        leased = True
        client.abort(job.model, job.request_id(index, attempt))
    if not leased:  # no runner holds an item, so none will notice the cancel: finish it here
        finalize(job, BulkJob.Status.CANCELLED)
    return True


def finalize(job: BulkJob, status: str) -> bool:
    """Move an active job to its final ``status`` (once: concurrent runners race here) and, for a Batch API
    job, write its output and error files."""
    from llmserve.bulk import batches

    with transaction.atomic():
        if not BulkJob.objects.filter(pk=job.pk, status__in=BulkJob.ACTIVE).update(
            status=status, finished_at=timezone.now()
        ):
            return False
        batch = batches.Batch.objects.filter(job_id=job.pk).first()
        if batch is not None:
            batches.write_result_files(batch)
    return True


@dataclass
class Progress:
    total: int
    done: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    tokens_per_s: float  # generated tokens per second since the job started
    items_per_s: float
    eta_s: float | None  # None until an item has finished, or once the job has

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed


def progress(job: BulkJob) -> Progress:
    counts = job.items.aggregate(
        total=Count("pk"),
        done=Count("pk", filter=Q(status=BulkItem.Status.DONE)),
        failed=Count("pk", filter=Q(status=BulkItem.Status.FAILED)),
        prompt_tokens=Sum("prompt_tokens", default=0),
        completion_tokens=Sum("completion_tokens", default=0),
    )
    end = job.finished_at or timezone.now()
    elapsed = (end - job.started_at).total_seconds() if job.started_at else 0.0
    finished = counts["done"] + counts["failed"]
    items_per_s = finished / elapsed if elapsed > 0 else 0.0
    pending = counts["total"] - finished
    eta = pending / items_per_s if items_per_s > 0 and job.is_active else None
    return Progress(
        counts["total"],
        counts["done"],
        counts["failed"],
        counts["prompt_tokens"],
        counts["completion_tokens"],
        elapsed,
        counts["completion_tokens"] / elapsed if elapsed > 0 else 0.0,
        items_per_s,
        eta,
    )
