"""Celery tasks of bulk jobs. ``@shared_task``s only: the host project's Celery app runs them.

`run_bulk_job` is safe to run any number of times, concurrently or after a crash: it only ever takes pending
items it can claim (see `llmserve.bulk.runner`). It acknowledges late and is rejected (redelivered) when its
worker dies, so a killed worker's job is picked up again once the broker redelivers the message; each run
lasts about ``BULK_SLICE_SECONDS`` and then queues its successor, which keeps every message short-lived
compared with the broker's visibility timeout.
"""

from __future__ import annotations

from celery import shared_task
from django.db import InterfaceError, OperationalError

from llmserve import bus
from llmserve.bulk.runner import JobRunner


@shared_task(
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    max_retries=20,
)
def run_bulk_job(job_id: int) -> None:
    """Run one slice of a job; queue the next slice while work remains."""
    if JobRunner(job_id, bus.client(), on_handover=lambda: run_bulk_job.delay(job_id)).run():
        run_bulk_job.delay(job_id)
