"""The host project's settings, with a test task the Celery worker of `test_celery_redis` also runs."""

from hostproject.settings import *  # noqa: F403

CELERY_IMPORTS = ["tests.faults.celery_tasks"]
