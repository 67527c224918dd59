"""Output streams keep a TTL without an EXPIRE per delta: set on first and last write, refreshed between."""

from __future__ import annotations

import threading

from inference_engine.bus import protocol as P
from inference_engine.bus.server import EngineServer, ServeSettings
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, assert_idle


def _expire_calls(raw_redis) -> int:
    return int(raw_redis.info("commandstats").get("cmdstat_expire", {}).get("calls", 0))


def test_output_stream_ttl_is_kept_with_few_expires(engine, redis_server, raw_redis, client, prefix):
    ttl = 2
    settings = ServeSettings(
        prefix=prefix, heartbeat_interval=0.2, heartbeat_ttl=1.0, idle_block=0.05, output_ttl=ttl
    )
    server = EngineServer(engine, redis_server.url, MODEL, settings)
    server._connect()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        before = _expire_calls(raw_redis)
        stream = client.generate(
            MODEL,
            "Count slowly from one to one hundred:",
            SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True),
        )
        key = P.Keys(prefix).output(stream.request_id)
        deltas, ttls = 0, []
        for _ in stream:
            deltas += 1
            ttls.append(raw_redis.ttl(key))
        expires = _expire_calls(raw_redis) - before
        final_ttl = raw_redis.ttl(key)
    finally:
        server.stop()
        thread.join(10)
    assert_idle(engine)
    assert deltas >= 40
    assert all(0 < t <= ttl for t in ttls), ttls  # the stream never went without a TTL, nor expired
    assert 0 < final_ttl <= ttl
    # First write, last write, and a refresh per ttl/4 of running time; far fewer than one per delta.
    assert 2 <= expires < deltas / 2, (expires, deltas)
    assert not server._expire_set  # nothing left behind for finished requests
