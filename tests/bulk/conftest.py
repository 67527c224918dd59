"""A real stack for bulk jobs: the web tests' stack (redis-server, engine, SQLite file, daphne) plus a Celery
worker, all on the settings of `tests.bulk.settings`. The test process talks to the same SQLite file (not a
pytest-django test database: the worker must see the rows) and the same Redis."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-only-secret")
django.setup()

from django.db import connections  # noqa: E402
from django.test import override_settings  # noqa: E402

from hostproject.celery import app as celery_app  # noqa: E402
from inference_engine.bus.client import EngineClient  # noqa: E402
from tests.web.stack import Stack, engine_flags  # noqa: E402

TEMPLATE = "Summarise the following document:\n\n{document}"
PARAMS = {"temperature": 0.0, "max_tokens": 8}


class BulkStack(Stack):
    """`Stack` plus a Celery worker, and restartable engine and worker processes."""

    worker: subprocess.Popen | None = None
    worker_count: int = 0

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "DJANGO_SETTINGS_MODULE": "tests.bulk.settings"}

    @property
    def db_path(self) -> Path:
        return self.workdir / "db.sqlite3"

    def start(self) -> BulkStack:
        super().start()
        with sqlite3.connect(self.db_path) as db:  # readers never block the writers (test, worker, daphne)
            db.execute("PRAGMA journal_mode=WAL")
        self.start_worker()
        return self

    def start_worker(self) -> None:
        self.worker_count += 1
        self.worker = self._spawn(f"worker{self.worker_count}", "-m", "celery", "-A", "hostproject", "worker",
                                  "--pool", "threads", "--concurrency", "2", "--loglevel", "INFO",
                                  "-n", f"bulk{self.worker_count}@%h", "--without-gossip", "--without-mingle")

    def kill_worker(self) -> None:
        assert self.worker is not None and self.worker.poll() is None, self.log(f"worker{self.worker_count}")
        self.worker.send_signal(signal.SIGKILL)
        self.worker.wait()

    def kill_engine(self) -> None:
        assert self.engine is not None
        self.engine.send_signal(signal.SIGKILL)
        self.engine.wait()

    def start_engine(self) -> None:
        assert self.redis is not None
        self.engine = self._spawn("engine2", "-m", "inference_engine", "serve", "--served-model-name",
                                  self.model, "--redis-url", self.redis.url, *self.engine_flags)

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(20)
            except subprocess.TimeoutExpired:
                self.worker.kill()
        super().stop()


@pytest.fixture(scope="session")
def bulk_stack(django_db_blocker: pytest.FixtureRequest) -> Iterator[BulkStack]:
    stack = BulkStack(engine_flags=engine_flags(max_num_seqs=16))
    stack.start()
    connection = connections["default"]
    previous = connection.settings_dict["NAME"]
    try:
        with django_db_blocker.unblock(), override_settings(LLMSERVE={"REDIS_URL": stack.redis.url}):
            connection.close()
            connection.settings_dict["NAME"] = str(stack.db_path)
            celery_app.conf.broker_url = stack.redis.url
            yield stack
            connection.close()
    finally:
        connection.settings_dict["NAME"] = previous
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
