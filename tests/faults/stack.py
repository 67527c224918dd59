"""The stack exactly as ``scripts/run`` starts it (`hostproject.run`: private Redis, engine supervisor with a
standby spare, Celery worker, two web workers on one port), with a test database (PostgreSQL when one answers
on the loopback) and the small engine settings of the other end-to-end tests. Its services can be found by
role and killed, as a crash would."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from inference_engine.bus.redis_server import free_port
from tests.database import TestDatabase

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--kv-cache-memory-bytes",
    str(256 * 2**20),
    "--max-num-seqs",
    "64",
    "--log-level",
    "WARNING",
]


SHUTDOWN_GRACE = 10  # seconds a SIGTERMed web worker lets its answers finish (30 by default)


def established(pid: int, port: int) -> int:
    """How many client connections to `port` process `pid` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if match := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(match.group(1))
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            count += local_port == port and state == "01" and inode in inodes
    return count


class LauncherStack:
    def __init__(self, web_workers: int = 2) -> None:
        self.web_workers = web_workers
        self.workdir = Path(tempfile.mkdtemp(prefix="llmserve-faults-"))
        self.port = free_port()
        self.database = TestDatabase.create(self.workdir)
        self.output: list[str] = []
        self.launcher: subprocess.Popen | None = None
        self.redis_url = ""
        self.api_key = ""

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "DJANGO_", "CELERY_"))}
        env.update(
            DJANGO_SETTINGS_MODULE="tests.faults.settings",
            DJANGO_SECRET_KEY="test-only-secret",
            DATABASE_URL=self.database.url,
            LLMSERVE_ENGINE_THREADS="1",
            LLMSERVE_ENGINE_FLAGS=shlex.join(ENGINE_FLAGS),
            LLMSERVE_ADMIN_USER="admin",
            LLMSERVE_ADMIN_PASSWORD="faults-admin-password",
            LLMSERVE_LOG_DIR=str(self.log_dir),
            LLMSERVE_SHUTDOWN_GRACE=str(SHUTDOWN_GRACE),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        if self.redis_url:
            env["LLMSERVE_REDIS_URL"] = self.redis_url
        return env

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def start(self, timeout: float = 300) -> LauncherStack:
        command = [sys.executable, "-m", "hostproject.run", "--port", str(self.port)]
        self.launcher = subprocess.Popen(
            [*command, "--web-workers", str(self.web_workers)],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=lambda: self.output.extend(self.launcher.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not any("Press Ctrl-C" in line for line in self.output):
            assert self.launcher.poll() is None, "".join(self.output)
            assert time.monotonic() < deadline, "".join(self.output)
            time.sleep(0.3)
        self.redis_url = re.search(r"Redis: (\S+)", "".join(self.output)).group(1)
        self.api_key = self.manage("llmserve_createkey", "faults").strip()
        return self

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

    def pids(self, pattern: str) -> list[int]:
        """Live descendants of the launcher whose command line matches `pattern`."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                session = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[4])
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError, ValueError):
                continue
            if state != "Z" and re.search(pattern, cmdline) and self._ours(int(proc.name), session):
                found.append(int(proc.name))
        return sorted(found)

    def _ours(self, pid: int, session: int) -> bool:
        """Whether `pid` descends from the launcher (each service has its own session, so walk parents)."""
        while pid > 1:
            if pid == self.launcher.pid:
                return True
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                return False
        return False

    def kill(self, pattern: str) -> int:
        """SIGKILL the newest process matching `pattern`; its pid."""
        [*_, pid] = self.pids(pattern)
        os.kill(pid, signal.SIGKILL)
        return pid

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, keep_logs: bool = False) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGINT)
            try:
                self.launcher.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait()
        self.database.drop()
        if keep_logs:
            print(f"\nthe launcher's logs: {self.log_dir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
