"""`BulkStack`: the web tests' real stack plus a Celery worker, with the engine and the worker killable and
restartable. Used by tests/bulk and benchmarks/bulk.py."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
from pathlib import Path

from tests.web.stack import Stack


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
        if self.database.vendor == "sqlite":
            with sqlite3.connect(self.db_path) as db:  # readers never block writers (test, worker, daphne)
                db.execute("PRAGMA journal_mode=WAL")
        self.start_worker()
        return self

    def start_worker(self) -> None:
        self.worker_count += 1
        self.worker = self._spawn(
            f"worker{self.worker_count}",
            "-m",
            "celery",
            "-A",
            "hostproject",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            "2",
            "--loglevel",
            "INFO",
            "-n",
            f"bulk{self.worker_count}@%h",
            "--without-gossip",
            "--without-mingle",
        )

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
        self.engine = self._spawn(
            "engine2",
            "-m",
            "inference_engine",
            "serve",
            "--served-model-name",
            self.model,
            "--redis-url",
            self.redis.url,
            *self.engine_flags,
        )

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(20)
            except subprocess.TimeoutExpired:
                self.worker.kill()
        super().stop()
