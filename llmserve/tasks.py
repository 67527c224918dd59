"""Celery's ``autodiscover_tasks()`` imports ``<app>.tasks``: this makes the bulk job tasks known to
workers."""

from llmserve.bulk.tasks import run_bulk_job

__all__ = ["run_bulk_job"]
