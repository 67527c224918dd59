"""The Python API of bulk jobs, for host projects, the admin and the Batch API.

from llmserve.bulk import services
job = services.create_job("smol", "Summarise the following document:\\n\\n{document}",
                          ({"document": text} for text in documents),
                          {"temperature": 0, "max_tokens": 64})
services.progress(job)   # done / failed / total, tokens/s, ETA
services.pause_job(job); services.resume_job(job); services.cancel_job(job)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from typing import Any

from celery import current_app
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from inference_engine.bus.client import EngineClient
from llmserve import bus, conf, engines
from llmserve.bulk import requests, uploads
from llmserve.bulk.models import Batch, BulkItem, BulkJob, BulkRunner
from llmserve.models import APIKey

CREATE_BATCH = 1000  # items per INSERT when a job is created
RUN_BULK_JOB = "llmserve.bulk.tasks.run_bulk_job"


@dataclass
class RefusedItem:
    """An item known to be bad when its job is created (a Batch API line whose body cannot be stored as
    sent): stored as failed with `error` (an OpenAI error object), so the rest of the job runs."""

    input: dict[str, Any]
    error: dict[str, Any]


def _item(job: BulkJob, index: int, item: Any, custom_id: str, now: Any) -> BulkItem:
    if isinstance(item, RefusedItem):
        return BulkItem(
            job=job,
            index=index,
            input=item.input,
            custom_id=custom_id,
            status=BulkItem.Status.FAILED,
            error=item.error,
            finished_at=now,
        )
    return BulkItem(job=job, index=index, input=item, custom_id=custom_id)


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
    owner: APIKey | None = None,
    start: bool = True,
) -> BulkJob:
    """Create a job over ``items`` and (once the transaction commits) queue it on Celery.

    ``template`` is a format string over each item's fields; an empty one makes each item a whole OpenAI
    request body (what the Batch API does). ``items`` (and ``custom_ids``) may be generators: they are read
    once, a thousand rows per INSERT, so a large upload is never held whole. Invalid ``params`` raise
    `llmserve.api.errors.BadRequest` here rather than failing every item later. ``priority`` defaults to
    ``LLMSERVE["BULK_PRIORITY"]``; ``owner`` is the API key the job's requests count against.
    """
    params = params or {}
    if template:
        requests.check_job_params(kind, params)
    ids = iter(custom_ids) if custom_ids is not None else None
    with transaction.atomic():
        job = BulkJob.objects.create(
            model=model,
            template=template,
            params=params,
            kind=kind,
            name=name,
            owner=owner,
            priority=conf.get("BULK_PRIORITY") if priority is None else priority,
        )
        now = timezone.now()
        rows = (_item(job, i, item, next(ids) if ids else "", now) for i, item in enumerate(items))
        while batch := list(islice(rows, CREATE_BATCH)):
            BulkItem.objects.bulk_create(batch)
            job.total += len(batch)
            job.failed += sum(1 for row in batch if row.status == BulkItem.Status.FAILED)
        BulkJob.objects.filter(pk=job.pk).update(total=job.total, failed=job.failed)
        if start:
            transaction.on_commit(lambda: start_job(job))
    return job


def start_job(job: BulkJob) -> None:
    """Queue (or re-queue: it is idempotent) the task that runs ``job`` (`llmserve.bulk.tasks`, which
    imports this module: the task goes by its name)."""
    current_app.signature(RUN_BULK_JOB, args=(job.pk,)).delay()


def pause_job(job: BulkJob) -> bool:
    """Stop feeding ``job`` to the engines: its runners abort their requests (the items go back to pending)
    and leave; `resume_job` carries on. False if the job was not queued or running."""
    return bool(
        BulkJob.objects.filter(pk=job.pk, status__in=(BulkJob.Status.QUEUED, BulkJob.Status.RUNNING)).update(
            status=BulkJob.Status.PAUSED, paused_at=timezone.now()
        )
    )


def resume_job(job: BulkJob) -> bool:
    """Carry on with a paused job. False if it was not paused."""
    with transaction.atomic():
        paused = BulkJob.objects.select_for_update().filter(pk=job.pk, status=BulkJob.Status.PAUSED).first()
        if paused is None:
            return False
        now = timezone.now()
        if paused.paused_at is not None:
            paused.paused_seconds += (now - paused.paused_at).total_seconds()
        paused.status = BulkJob.Status.RUNNING if paused.started_at else BulkJob.Status.QUEUED
        paused.paused_at = None
        paused.save(update_fields=["status", "paused_at", "paused_seconds"])
        transaction.on_commit(lambda: start_job(paused))
    return True


def cancel_job(job: BulkJob, client: EngineClient | None = None) -> bool:
    """Stop ``job``: no new item starts and the in-flight requests are aborted in the engine.

    The requests are aborted here by their deterministic ids, so cancelling works without reaching the worker
    that runs them. Returns False when the job had already finished.
    """
    cancellable = (BulkJob.Status.QUEUED, BulkJob.Status.RUNNING, BulkJob.Status.PAUSED)
    now = timezone.now()
    if not BulkJob.objects.filter(pk=job.pk, status__in=cancellable).update(
        status=BulkJob.Status.CANCELLING, cancelled_at=now
    ):
        return False
    client = client or bus.client()
    held = BulkItem.objects.filter(job=job, status=BulkItem.Status.PENDING, runner__isnull=False)
    leased = False
    model = job.model
    for index, attempt in held.values_list("index", "attempts").iterator():
        if not leased and job.kind != BulkJob.Kind.EMBED:  # a LoRA adapter's requests run on its base model
            model = engines.engine_target(job.model, list(engines.live_models().values()))[0]
        leased = True
        client.abort(model, job.request_id(index, attempt))
    if not leased:  # no runner holds an item, so none may be left to notice the cancel: finish it here
        finalize(job, BulkJob.Status.CANCELLED)
    return True


def finalize(job: BulkJob, status: str) -> bool:
    """Move an active job to its final ``status`` (once: concurrent runners race here), dismiss its runners
    (so no result is stored after the counts are final) and, for a Batch API job, write its output and error
    files."""
    with transaction.atomic():
        if not BulkJob.objects.filter(pk=job.pk, status__in=BulkJob.ACTIVE).update(
            status=status, finished_at=timezone.now()
        ):
            return False
        BulkRunner.objects.filter(job_id=job.pk).delete()
        batch = Batch.objects.filter(job_id=job.pk).first()
        if batch is not None:
            uploads.write_result_files(batch)
    return True


# ------------------------------------------------------------------------------------------------ runners


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def reap_runners() -> None:
    """Dismiss the runners known to be dead, which frees their items at once, and queue a task for every
    running job they leave without a runner.

    Dead: no heartbeat for ``BULK_RUNNER_TIMEOUT`` seconds, or (checked on the same host, so without waiting
    for the timeout) their process no longer exists.
    """
    now = timezone.now()
    alive_since = now - timedelta(seconds=float(conf.get("BULK_RUNNER_TIMEOUT")))
    host = socket.gethostname()
    gone = [
        pk
        for pk, worker in BulkRunner.objects.filter(worker__startswith=f"{host}:").values_list("pk", "worker")
        if _process_gone(int(worker.rpartition(":")[2]))
    ]
    dead = BulkRunner.objects.filter(Q(heartbeat_at__lt=alive_since) | Q(pk__in=gone))
    jobs = set(dead.values_list("job_id", flat=True))
    if not jobs:
        return
    dead.delete()
    orphans = (
        BulkJob.objects.filter(pk__in=jobs, status=BulkJob.Status.RUNNING)
        .annotate(runner_count=Count("runners"))
        .filter(runner_count=0)
    )
    for job in orphans:
        start_job(job)


# ------------------------------------------------------------------------------------------------ reading


@dataclass
class Progress:
    total: int
    done: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float  # time spent running: paused time left out
    tokens_per_s: float  # generated tokens per second of running time
    items_per_s: float
    eta_s: float | None  # None until an item has finished, while paused, or once the job has

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed


def progress(job: BulkJob) -> Progress:
    """The job's progress from its counters: one row, however many items."""
    end = job.finished_at or timezone.now()
    elapsed = 0.0
    if job.started_at:
        paused = job.paused_seconds + ((end - job.paused_at).total_seconds() if job.paused_at else 0.0)
        elapsed = max(0.0, (end - job.started_at).total_seconds() - paused)
    finished = job.done + job.failed
    items_per_s = finished / elapsed if elapsed > 0 else 0.0
    running = job.status in (BulkJob.Status.QUEUED, BulkJob.Status.RUNNING)
    eta = (job.total - finished) / items_per_s if items_per_s > 0 and running else None
    return Progress(
        job.total,
        job.done,
        job.failed,
        job.prompt_tokens,
        job.completion_tokens,
        elapsed,
        job.completion_tokens / elapsed if elapsed > 0 else 0.0,
        items_per_s,
        eta,
    )


RESULT_FIELDS = (
    "index",
    "custom_id",
    "status",
    "input",
    "output",
    "response",
    "error",
    "prompt_tokens",
    "completion_tokens",
)


def iter_results(job: BulkJob) -> Iterator[dict[str, Any]]:
    """Every item's result in index order, read a thousand rows at a time."""
    return job.items.order_by("index").values(*RESULT_FIELDS).iterator(chunk_size=CREATE_BATCH)


def key_usage(key: APIKey) -> dict[str, int]:
    """Jobs and tokens of the bulk jobs an API key created (the Batch API's per-key accounting)."""
    return BulkJob.objects.filter(owner=key).aggregate(
        jobs=Count("pk"),
        prompt_tokens=Sum("prompt_tokens", default=0),
        completion_tokens=Sum("completion_tokens", default=0),
    )
