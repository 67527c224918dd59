"""The real serving stack for end-to-end tests: a private redis-server, an engine process, a database
(`tests.database`: a fresh PostgreSQL database when one answers on the loopback, else a SQLite file) and
daphne serving the host project, each a child process on a free local port.

Also used by benchmarks/serving.py, which is why it takes its engine flags as arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from inference_engine.bus.redis_server import RedisServer, free_port
from tests.database import TestDatabase

ROOT = Path(__file__).resolve().parents[2]


def engine_flags(threads: int = 1, max_num_seqs: int = 16) -> list[str]:
    """Small, deterministic and frugal: one torch thread by default (other processes share the cores), fp32,
    a short context, a 128 MiB KV cache and fast heartbeats."""
    return [
        "--threads",
        str(threads),
        "--max-num-seqs",
        str(max_num_seqs),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(128 * 2**20),
        "--heartbeat-interval",
        "0.25",
        "--heartbeat-ttl",
        "1.5",
        "--log-level",
        "WARNING",
    ]


@dataclass
class Stack:
    model: str = "smol"
    engine_flags: list[str] = field(default_factory=engine_flags)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="llmserve-web-")))
    redis: RedisServer | None = None
    database: TestDatabase | None = None
    engine: subprocess.Popen | None = None
    daphne: subprocess.Popen | None = None
    port: int = 0
    api_key: str = ""
    # A second local port whose pages the API's CORS settings let call it (tests/web/test_browser_cors.py).
    cors_port: int = field(default_factory=free_port)

    @property
    def cors_origin(self) -> str:
        return f"http://127.0.0.1:{self.cors_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        assert self.redis is not None
        return {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "hostproject.settings",
            "DATABASE_URL": self.database.url,
            "LLMSERVE_REDIS_URL": self.redis.url,
            "DJANGO_SECRET_KEY": "test-only-secret",
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PROMETHEUS_MULTIPROC_DIR": str(self.workdir / "prometheus"),
            "LLMSERVE_CORS_ALLOWED_ORIGINS": self.cors_origin,
        }

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout

    def start(self) -> Stack:
        """Starts every part; a start that fails midway stops what it started (no fixture would)."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Stack:
        self.database = TestDatabase.create(self.workdir)
        self.redis = RedisServer().start()
        (self.workdir / "prometheus").mkdir()
        # The engine loads its model while the database is prepared.
        self.engine = self._spawn(
            "engine",
            "-m",
            "inference_engine",
            "serve",
            "--served-model-name",
            self.model,
            "--redis-url",
            self.redis.url,
            *self.engine_flags,
        )
        self.manage("migrate", "--verbosity", "0")
        self.api_key = self.manage("llmserve_createkey", "tests").strip()
        self.port = free_port()
        self.daphne = self._spawn(
            "daphne", "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "hostproject.asgi:application"
        )
        self.wait_ready()
        return self

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        """A child process whose output goes to ``{workdir}/{name}.log`` (shown when it fails)."""
        with open(self.workdir / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in (("engine", self.engine), ("daphne", self.daphne)):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as reply:
                    if self.model in json.load(reply).get("models", {}):
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(
            f"the stack was not ready within {timeout}s:\n{self.log('engine')}\n{self.log('daphne')}"
        )

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        for proc in (self.daphne, self.engine):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.redis is not None:
            self.redis.stop()
        if self.database is not None:
            self.database.drop()
        self.daphne = self.engine = self.redis = self.database = None  # a second stop does nothing
        shutil.rmtree(self.workdir, ignore_errors=True)
