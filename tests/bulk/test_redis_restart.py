"""A bulk job across a Redis restart: redis-server killed mid-job and started again on its port after longer
than a task's slice (`tests.bulk.settings`: 5 s), so a slice ends while the broker is away. The job still
completes, every item once, and the worker lives on (no worker start recovers the job here)."""

from __future__ import annotations

import time

import pytest

from llmserve.bulk import services
from llmserve.bulk.models import BulkItem, BulkJob

from .conftest import PARAMS, TEMPLATE, BulkStack, wait_until
from .test_jobs import documents, wait_finished

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # ~20 s; test_celery_redis holds the crash fix

AWAY = 7.0  # seconds Redis stays down: longer than a slice


def test_redis_restarted_mid_job(bulk_stack: BulkStack) -> None:
    docs = documents(40, seed=7)
    job = services.create_job(bulk_stack.model, TEMPLATE, docs, PARAMS, name="redis restarted")
    wait_until(lambda: job.items.filter(status=BulkItem.Status.DONE).count() >= 4, 240, "4 items done")
    bulk_stack.redis.process.kill()
    bulk_stack.redis.process.wait()
    time.sleep(AWAY)
    bulk_stack.redis.start()
    try:
        job = wait_finished(job, timeout=180)
    finally:
        log = bulk_stack.log(f"worker{bulk_stack.worker_count}")
        print(f"\nthe worker's log:\n{log}")
    assert bulk_stack.worker.poll() is None, log[-3000:]  # the same worker, alive
    assert job.status == BulkJob.Status.COMPLETED, (job.status, log[-3000:])
    assert job.items.filter(status=BulkItem.Status.DONE).count() == 40
