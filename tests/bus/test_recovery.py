"""Crash recovery and Redis restarts, with fake engines served in threads."""

import json
import time

import pytest
import redis

from inference_engine.bus import protocol as P
from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import RedisServer
from inference_engine.errors import EngineUnavailableError

from .conftest import ThreadedServer

pytestmark = pytest.mark.timeout(60)


def _submit_raw(raw_redis, keys, rid, prompt="abc"):
    message = {"type": P.GENERATE, "id": rid, "prompt": prompt, "params": {"max_tokens": 3}}
    raw_redis.set(keys.request_id(rid), "fake")
    raw_redis.xadd(keys.requests("fake"), P.encode(message))


def _outputs(raw_redis, keys, rid):
    return [P.decode(f) for _, f in raw_redis.xrange(keys.output(rid))]


def test_dead_consumers_entries_are_rerun_or_failed(redis_server, raw_redis, prefix):
    keys = P.Keys(prefix)
    raw_redis.xgroup_create(keys.requests("fake"), P.GROUP, id="0", mkstream=True)
    for rid in ("fresh", "acked", "streamed", "done"):
        _submit_raw(raw_redis, keys, rid)
    # A "ghost" replica took all four and died at different points (it never had a heartbeat key).
    raw_redis.xreadgroup(P.GROUP, "ghost", {keys.requests("fake"): ">"}, count=10)
    ghost = {"replica": "ghost"}
    raw_redis.xadd(keys.output("acked"), P.encode({"type": P.ACK, "prompt_tokens": 3, **ghost}))
    raw_redis.xadd(keys.output("streamed"), P.encode({"type": P.ACK, "prompt_tokens": 3, **ghost}))
    raw_redis.xadd(keys.output("streamed"), P.encode(
        {"type": P.DELTA, "outputs": [{"index": 0, "text": "x", "token_ids": [1]}], **ghost}))
    raw_redis.xadd(keys.output("done"), P.encode(
        {"type": P.FINAL, "outputs": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0,
                                                    "total_tokens": 0}, **ghost}))
    server = ThreadedServer(redis_server.url, prefix).start()
    try:
        deadline = time.monotonic() + 10
        def settled():
            group = raw_redis.xinfo_groups(keys.requests("fake"))[0]
            return raw_redis.xlen(keys.requests("fake")) == 0 and group["consumers"] == 1

        while not settled() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert settled()  # all handled, and the ghost consumer is forgotten
    finally:
        server.stop()
    assert sorted(server.engine.started) == ["acked", "fresh"]  # never "streamed" nor "done"
    assert _outputs(raw_redis, keys, "fresh")[-1]["type"] == P.FINAL
    assert _outputs(raw_redis, keys, "acked")[-1]["type"] == P.FINAL
    last = _outputs(raw_redis, keys, "streamed")[-1]
    assert last["type"] == P.ERROR and last["code"] == "engine_unavailable"
    assert len(_outputs(raw_redis, keys, "done")) == 1


def test_redis_restart_fails_inflight_work_then_recovers(prefix):
    with RedisServer() as server:
        engine_server = ThreadedServer(server.url, prefix, step_delay=0.02)
        engine_server.server._connect()
        engine_server.start()
        client = EngineClient(server.url, prefix=prefix, ack_timeout=5, stream_timeout=5, poll_interval=0.2)
        try:
            stream = client.generate("fake", "abc", {"max_tokens": 1000})
            deltas = iter(stream)
            next(deltas)
            server.restart()
            start = time.monotonic()
            with pytest.raises(EngineUnavailableError):
                for _ in deltas:
                    pass
            assert time.monotonic() - start < 5
            deadline = time.monotonic() + 10
            while True:  # the engine reconnects and heartbeats again; the client reconnects by itself
                try:
                    if client.live_replicas("fake"):
                        break
                except redis.ConnectionError:
                    pass
                assert time.monotonic() < deadline, "engine did not come back"
                time.sleep(0.1)
            assert not engine_server.engine.requests  # the lost request was aborted in the engine
            result = client.generate("fake", "abc", {"max_tokens": 2}).result()
            assert result.outputs[0].finish_reason == "length"
            assert json.loads(client.redis.get(P.Keys(prefix).replica(engine_server.server.replica_id)))
        finally:
            client.close()
            engine_server.stop()
