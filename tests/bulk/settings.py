"""The host project's settings for the Celery worker and daphne of tests/bulk: short runner timings and a
broker that redelivers a dead worker's task within seconds. The database (``DATABASE_URL``) and the Redis
cache, which counts rate limits across daphne and every pool process of the worker, are the host project's."""

from hostproject.settings import *  # noqa: F403
from hostproject.settings import LLMSERVE

LLMSERVE = {**LLMSERVE, "BULK_RUNNER_TIMEOUT": 6.0, "BULK_SLICE_SECONDS": 5.0}
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 12,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
