"""The host project's settings with short bulk-job timings, for the Celery worker and daphne of tests/bulk:
leases and task slices of a few seconds, and a broker that redelivers a dead worker's task within seconds."""

from hostproject.settings import *  # noqa: F403
from hostproject.settings import LLMSERVE

LLMSERVE = {**LLMSERVE, "BULK_LEASE_SECONDS": 4.0, "BULK_SLICE_SECONDS": 5.0, "BULK_CONCURRENCY": 8}
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 12,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
