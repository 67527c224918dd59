"""The host project's Celery app. Reusable apps (llmserve) only declare ``@shared_task``s; this binds them."""

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")

app = Celery("hostproject")
# Every CELERY_* Django setting configures Celery (CELERY_BROKER_URL, CELERY_TASK_ACKS_LATE, ...).
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_configure.connect
def _redis_transport(sender: Celery, source: Any, **kwargs: Any) -> None:
    """A Redis broker through `hostproject.broker`'s transport (a worker survives a Redis restart)."""
    if str(source.broker_url or "").startswith(("redis://", "rediss://")) and not source.broker_transport:
        source.broker_transport = "hostproject.broker:Transport"
