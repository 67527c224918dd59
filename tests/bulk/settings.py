"""The host project's settings for the Celery worker and daphne of tests/bulk: short runner timings, a broker
that redelivers a dead worker's task within seconds, the stack's Redis as the cache, and the stack's database
(a private PostgreSQL database when the stack made one, see `tests.bulk.stack`, else its SQLite file)."""

import os

from hostproject.settings import *  # noqa: F403
from hostproject.settings import LLMSERVE, REDIS_URL

if os.environ.get("LLMSERVE_TEST_PG_DATABASE"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ["LLMSERVE_TEST_PG_DATABASE"],
            "HOST": "127.0.0.1",
            "PORT": 5432,
            "USER": "postgres",
        }
    }

# Rate limits counted across processes (daphne, and every pool process of the worker), as a deployment with
# several processes must.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}

LLMSERVE = {**LLMSERVE, "BULK_RUNNER_TIMEOUT": 6.0, "BULK_SLICE_SECONDS": 5.0}
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 12,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
