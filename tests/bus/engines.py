"""Real engine processes (`python -m inference_engine serve` / `supervise`) for the end-to-end tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from inference_engine.bus.client import EngineClient

# Small, deterministic and frugal: one torch thread, a small KV budget, fast heartbeats.
TEST_FLAGS = [
    "--threads",
    "1",
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


def start(url: str, prefix: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "inference_engine", *args, "--redis-url", url, "--prefix", prefix, *TEST_FLAGS]
    )


def serve(url: str, prefix: str, name: str, *flags: str) -> subprocess.Popen:
    return start(url, prefix, "serve", "--served-model-name", name, *flags)


def wait_live(
    client: EngineClient, name: str, count: int, processes: list[subprocess.Popen], timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while len(client.live_replicas(name)) < count:
        for p in processes:
            assert p.poll() is None, f"engine process exited with {p.returncode}"
        assert time.monotonic() < deadline, f"{name}: {count} replica(s) not live within {timeout}s"
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def live_replicas(
    url: str, prefix: str, name: str, count: int, *flags: str
) -> Iterator[list[subprocess.Popen]]:
    """`count` engines serving `name`, live on the bus until the block ends."""
    procs = [serve(url, prefix, name, *flags) for _ in range(count)]
    client = EngineClient(url, prefix=prefix)
    try:
        wait_live(client, name, count, procs)
        yield procs
    finally:
        client.close()
        for p in procs:
            stop(p)
