"""A Celery worker started as the launcher starts it survives a SIGKILL of its broker, redis-server, and a
restart on the same port (what the launcher does when Redis dies) while it holds an unacknowledged message, as
it does while a bulk job's task runs: it reconnects by itself, answers a ping and runs a task sent after the
restart. (Celery 5.7's own Redis transport dies of an AttributeError there: `hostproject.broker`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery import Celery

from inference_engine.bus.redis_server import RedisServer

from .stack import ROOT

pytestmark = pytest.mark.timeout(120)

# hostproject.run's command for the Celery service
WORKER = [
    sys.executable,
    "-m",
    "celery",
    "-A",
    "hostproject",
    "worker",
    "--loglevel",
    "INFO",
    "--concurrency",
    "2",
]
NAP = 8  # seconds the task runs: it ends after Redis is back
RECONNECTED_WITHIN = 20.0  # Celery's broker retries wait 2 s, then 4 s, ...


def _wait_for(log: Path, text: str, timeout: float, worker: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert worker.poll() is None, (
            f"the worker exited with {worker.returncode}:\n{log.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"no {text!r} within {timeout:g}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_the_celery_worker_survives_a_redis_restart(tmp_path: Path) -> None:
    redis = RedisServer().start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "DJANGO_", "CELERY_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="tests.faults.settings_celery",  # the host project's, and a test task
        DJANGO_SECRET_KEY="test-only-secret",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        LLMSERVE_REDIS_URL=redis.url,
        PYTHONPATH=str(ROOT),
    )
    log = tmp_path / "celery.log"
    app = Celery(broker=redis.url)
    with open(log, "w") as out:
        worker = subprocess.Popen(
            WORKER, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_for(log, " ready.", 60, worker)
        # A task that runs (its message unacknowledged: acks_late) while Redis dies and comes back, as a bulk
        # job's task does; it ends, and is acknowledged, after the worker reconnected.
        running = app.send_task("tests.faults.celery_tasks.nap", args=(NAP,))
        _wait_for(log, f"Task tests.faults.celery_tasks.nap[{running.id}] received", 10, worker)
        redis.process.kill()
        redis.process.wait()
        _wait_for(log, "Connection to broker lost", 10, worker)
        killed = time.monotonic()
        redis.start()
        while not app.control.ping(timeout=0.5):
            assert worker.poll() is None, (
                f"the worker exited with {worker.returncode}:\n{log.read_text()[-3000:]}"
            )
            assert time.monotonic() - killed < RECONNECTED_WITHIN, log.read_text()[-3000:]
        reconnected = time.monotonic() - killed
        _wait_for(log, f"Task tests.faults.celery_tasks.nap[{running.id}] succeeded", NAP + 10, worker)
        # Acknowledged (over the lost connection's channel): the worker still takes tasks.
        task = app.send_task("celery.accumulate", args=(42,))
        _wait_for(log, f"Task celery.accumulate[{task.id}] succeeded", 10, worker)
        assert "Unrecoverable error" not in log.read_text(), log.read_text()[-3000:]
        print(f"\nthe worker answered again {reconnected:.1f}s after Redis was killed and restarted")
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)  # its pool processes too
            worker.wait()
        app.close()
        redis.stop()
