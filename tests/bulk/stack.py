"""`BulkStack`: the web tests' real stack plus a Celery worker (prefork, as deployed), with the engine, the
worker and its pool processes killable and restartable. Used by tests/bulk and benchmarks/bulk.py."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys

import psutil

from tests.web.stack import ROOT, Stack


class BulkStack(Stack):
    """`Stack` plus a Celery worker, and restartable engine and worker processes."""

    worker: subprocess.Popen | None = None
    worker_count: int = 0

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "DJANGO_SETTINGS_MODULE": "tests.bulk.settings"}

    def start(self) -> BulkStack:
        super().start()
        if self.database.vendor == "sqlite":
            with sqlite3.connect(self.workdir / "db.sqlite3") as db:  # readers never block the writers
                db.execute("PRAGMA journal_mode=WAL")
        self.start_worker()
        return self

    def start_worker(self) -> None:
        """A prefork worker with two pool processes, in a session of its own so that `kill_worker` can take
        the whole of it down."""
        self.worker_count += 1
        name = f"worker{self.worker_count}"
        with open(self.workdir / f"{name}.log", "w") as log:
            self.worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "hostproject",
                    "worker",
                    "--pool",
                    "prefork",
                    "--concurrency",
                    "2",
                    "--loglevel",
                    "INFO",
                    "-n",
                    f"bulk{self.worker_count}@%h",
                    "--without-gossip",
                    "--without-mingle",
                ],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pool_processes(self) -> list[int]:
        assert self.worker is not None
        return [child.pid for child in psutil.Process(self.worker.pid).children()]

    def kill_pool_process(self, pid: int) -> None:
        """SIGKILL one pool process (as the OOM killer would); the worker starts a new one."""
        assert pid in self.pool_processes(), (pid, self.log(f"worker{self.worker_count}"))
        os.kill(pid, signal.SIGKILL)

    def kill_worker(self) -> None:
        """SIGKILL the whole worker: its main process and every pool process."""
        assert self.worker is not None and self.worker.poll() is None, self.log(f"worker{self.worker_count}")
        os.killpg(self.worker.pid, signal.SIGKILL)
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
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait()
        super().stop()
