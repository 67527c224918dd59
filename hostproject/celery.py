"""The host project's Celery app. Reusable apps (llmserve) only declare ``@shared_task``s; this binds them."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")

app = Celery("hostproject")
# Every CELERY_* Django setting configures Celery (CELERY_BROKER_URL, CELERY_TASK_ACKS_LATE, ...).
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
