"""Crash recovery and Redis restarts, with the session's real engine served in threads."""

import json
import time

import pytest
import redis

from inference_engine.bus import protocol as P
from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import RedisServer
from inference_engine.bus.server import EngineServer, ServeSettings
from inference_engine.errors import EngineUnavailableError

from .conftest import MODEL, ThreadedServer, generate_offline, wait_idle

pytestmark = pytest.mark.timeout(60)

PARAMS = {"max_tokens": 3, "temperature": 0}


def _submit_raw(raw_redis, keys, rid, prompt="abc"):
    message = {"type": P.GENERATE, "id": rid, "prompt": prompt, "params": PARAMS}
    raw_redis.set(keys.request_id(rid), MODEL)
    raw_redis.xadd(keys.requests(MODEL), P.encode(message))


def _outputs(raw_redis, keys, rid):
    return [P.decode(f) for _, f in raw_redis.xrange(keys.output(rid))]


def test_dead_consumers_entries_are_rerun_or_failed(redis_server, raw_redis, prefix, engine):
    expected = generate_offline(engine, "abc", PARAMS)
    keys = P.Keys(prefix)
    raw_redis.xgroup_create(keys.requests(MODEL), P.GROUP, id="0", mkstream=True)
    for rid in ("fresh", "acked", "streamed", "done"):
        _submit_raw(raw_redis, keys, rid)
    # A "ghost" replica took all four and died at different points (it never had a heartbeat key).
    raw_redis.xreadgroup(P.GROUP, "ghost", {keys.requests(MODEL): ">"}, count=10)
    ghost = {"replica": "ghost"}
    raw_redis.xadd(keys.output("acked"), P.encode({"type": P.ACK, "prompt_tokens": 3, **ghost}))
    raw_redis.xadd(keys.output("streamed"), P.encode({"type": P.ACK, "prompt_tokens": 3, **ghost}))
    raw_redis.xadd(
        keys.output("streamed"),
        P.encode({"type": P.DELTA, "outputs": [{"index": 0, "text": "x", "token_ids": [1]}], **ghost}),
    )
    raw_redis.xadd(
        keys.output("done"),
        P.encode(
            {
                "type": P.FINAL,
                "outputs": [],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                **ghost,
            }
        ),
    )
    server = ThreadedServer(engine, redis_server.url, prefix).start()
    try:
        deadline = time.monotonic() + 10

        def settled():
            group = raw_redis.xinfo_groups(keys.requests(MODEL))[0]
            return raw_redis.xlen(keys.requests(MODEL)) == 0 and group["consumers"] == 1

        while not settled() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert settled()  # all handled, and the ghost consumer is forgotten
    finally:
        server.stop()
    me = server.server.replica_id

    def started_here(rid):  # an ACK is written only once the engine has taken the request
        return [o for o in _outputs(raw_redis, keys, rid) if o["type"] == P.ACK and o["replica"] == me]

    # "fresh" and "acked" were re-run, and ran to the same answer as the engine gives offline.
    for rid in ("fresh", "acked"):
        [ack] = started_here(rid)
        assert ack["prompt_tokens"] == len(expected.prompt_token_ids)
        stream = [o for o in _outputs(raw_redis, keys, rid) if o.get("replica") == me]
        assert stream[-1]["type"] == P.FINAL
        deltas = [P.delta_from_message(rid, P.Message.from_wire(o)) for o in stream if o["type"] != P.ACK]
        token_ids = [t for d in deltas for c in d.outputs for t in c.token_ids]
        text = "".join(c.text for d in deltas for c in d.outputs)
        assert (token_ids, text) == (expected.outputs[0].token_ids, expected.outputs[0].text)
    # Never "streamed" (part of it already reached its client) nor "done".
    assert not started_here("streamed") and not started_here("done")
    last = _outputs(raw_redis, keys, "streamed")[-1]
    assert last["type"] == P.ERROR and last["code"] == "engine_unavailable"
    assert len(_outputs(raw_redis, keys, "done")) == 1


def test_redis_restart_fails_inflight_work_then_recovers(prefix, engine):
    with RedisServer() as server:
        engine_server = ThreadedServer(engine, server.url, prefix)
        engine_server.server._connect()
        engine_server.start()
        client = EngineClient(server.url, prefix=prefix, ack_timeout=5, stream_timeout=5, poll_interval=0.2)
        try:
            # Long enough (a few seconds at CPU speed) to be mid-generation when Redis goes away.
            max_tokens = 150
            before = engine.generation_tokens_total
            stream = client.generate(MODEL, "abc", {"max_tokens": max_tokens, "ignore_eos": True})
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
                    if client.live_replicas(MODEL):
                        break
                except redis.ConnectionError:
                    pass
                assert time.monotonic() < deadline, "engine did not come back"
                time.sleep(0.1)
            wait_idle(engine)  # the lost request was aborted in the engine, its KV blocks freed
            assert engine.generation_tokens_total - before < max_tokens  # cut short, not run to the end
            result = client.generate(MODEL, "abc", {"max_tokens": 2, "ignore_eos": True}).result()
            assert result.outputs[0].finish_reason == "length" and result.usage.completion_tokens == 2
            assert json.loads(client.redis.get(P.Keys(prefix).replica(engine_server.server.replica_id)))
        finally:
            client.close()
            engine_server.stop()


def test_maintenance_survives_redis_losing_its_data(engine, redis_server, raw_redis, prefix):
    """Redis restarted empty: the replica's periodic look for dead peers finds no streams at all. It must take
    that as lost data (recreate its groups, carry on), not die of it."""
    settings = ServeSettings(prefix=prefix, heartbeat_interval=0.2, heartbeat_ttl=1.0)
    server = EngineServer(engine, redis_server.url, MODEL, settings)
    try:
        server._connect()
        keys = P.Keys(prefix)
        for key in raw_redis.scan_iter(f"{prefix}:*"):
            raw_redis.delete(key)
        assert server._dead_consumers() == set()
        assert raw_redis.xinfo_groups(keys.requests(MODEL))[0]["name"] == P.GROUP
    finally:
        server.heartbeat.stop()
        server.redis.close()
