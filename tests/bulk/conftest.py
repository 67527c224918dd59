"""A real stack for bulk jobs: the web tests' stack (redis-server, engine, daphne) plus a Celery worker and
the stack's own database (PostgreSQL when one answers on the loopback), all on the settings of
`tests.bulk.settings`. The test process talks to the same database (not a pytest-django test database: the
worker must see the rows) and the same Redis."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import dj_database_url
import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-only-secret")
django.setup()

from django.db import connections  # noqa: E402
from django.test import override_settings  # noqa: E402

from hostproject.celery import app as celery_app  # noqa: E402
from inference_engine.bus.client import EngineClient  # noqa: E402
from tests.web.stack import engine_flags  # noqa: E402

from .stack import BulkStack  # noqa: E402

TEMPLATE = "Summarise the following document:\n\n{document}"
PARAMS = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="package")
def bulk_stack(django_db_blocker: Any) -> Iterator[BulkStack]:
    stack = BulkStack(engine_flags=engine_flags(max_num_seqs=16))
    connection = connections["default"]
    previous_settings = dict(connection.settings_dict)
    # Earlier tests may have left the connection on pytest-django's in-memory test database, which Django
    # never closes (closing would destroy it): park that connection and open the stack's database instead.
    previous_connection = connection.connection
    try:
        stack.start()
        connection.connection = None
        connection.settings_dict.update(dj_database_url.parse(stack.database.url))
        with django_db_blocker.unblock(), override_settings(LLMSERVE={"REDIS_URL": stack.redis.url}):
            celery_app.conf.broker_url = stack.redis.url
            yield stack
    finally:
        if connection.connection is not previous_connection:
            connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(previous_settings)
        connection.connection = previous_connection
        stack.stop()


@pytest.fixture
def bus_client(bulk_stack: BulkStack) -> Iterator[EngineClient]:
    client = EngineClient(bulk_stack.redis.url, ack_timeout=120, stream_timeout=60)
    yield client
    client.close()


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
