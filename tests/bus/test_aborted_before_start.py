"""A request aborted while it waits in the queue still gets an ending on its output stream (a reader that
attached to it, such as a bulk runner taking over an item, must not wait for nothing)."""

from __future__ import annotations

import threading

from inference_engine.bus import protocol as P
from inference_engine.bus.server import EngineServer, ServeSettings
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, assert_idle


def test_a_request_aborted_in_the_queue_ends_with_an_error(engine, redis_server, raw_redis, client, prefix):
    keys = P.Keys(prefix)
    server = EngineServer(engine, redis_server.url, MODEL, ServeSettings(prefix=prefix, idle_block=0.05))
    server._connect()  # the streams exist, so a request can wait in the queue before the engine runs
    message = P.Generate("queued-then-aborted", SamplingParams(max_tokens=4).to_dict(), prompt="Hello")
    raw_redis.xadd(keys.requests(MODEL), P.encode(message))
    client.abort(MODEL, message.id)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        entries = raw_redis.xread({keys.output(message.id): "0-0"}, block=10_000)
        (_, [(_, fields)]) = entries[0]
        ending = P.parse(fields)
    finally:
        server.stop()
        thread.join(10)
    assert isinstance(ending, P.Error) and ending.code == "aborted"
    assert_idle(engine)
