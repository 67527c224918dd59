"""Celery tasks of bulk jobs. ``@shared_task``s only: the host project's Celery app runs them.

`run_bulk_job` is safe to run any number of times, concurrently or after a crash: it only ever takes pending
items no live runner holds (see `llmserve.bulk.runner`). It acknowledges late and is rejected (redelivered at
once) when its pool process dies; the redelivered run, having the same task id, dismisses the dead run's
runner and takes its items over. Each run lasts about ``BULK_SLICE_SECONDS`` and then queues its successor,
which keeps every message short-lived compared with the broker's visibility timeout.

When a whole worker dies, its runners are dismissed by the next runner on the same host (their processes are
gone), by any runner once their heartbeats are stale, or by `recover_bulk_jobs`, which each worker queues when
it starts; a job left without a runner gets a new task at once.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_ready
from django.db import InterfaceError, OperationalError

from llmserve.bulk import services
from llmserve.bulk.runner import JobRunner

# Queueing the next slice waits out a broker outage (Redis restarting: the launcher starts it again at once,
# then after growing delays) rather than failing, which would leave the job without a task.
NEXT_SLICE_RETRY = {"max_retries": 150, "interval_start": 0, "interval_step": 0.5, "interval_max": 2.0}


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    max_retries=20,
)
def run_bulk_job(self: Any, job_id: int) -> None:
    """Run one slice of a job; queue the next slice while work remains."""
    if JobRunner(job_id, self.request.id).run():
        run_bulk_job.apply_async((job_id,), retry=True, retry_policy=NEXT_SLICE_RETRY)


@shared_task(ignore_result=True)
def recover_bulk_jobs() -> None:
    """Dismiss dead runners and restart the jobs they leave without one."""
    services.reap_runners()


@worker_ready.connect
def _recover_on_start(**kwargs: Any) -> None:
    # Queued, not run here: the worker's main process must not open database connections its pool
    # processes would inherit.
    recover_bulk_jobs.delay()
