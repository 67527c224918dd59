"""A task for the Celery worker of `test_celery_redis`: one that runs long enough to span a Redis restart."""

import time

from celery import shared_task


@shared_task
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
