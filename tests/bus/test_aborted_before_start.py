"""A request aborted while it waits in the queue still gets an ending on its output stream (a reader that
attached to it, such as a bulk runner taking over an item, must not wait for nothing)."""

from __future__ import annotations

import threading

from inference_engine.bus import protocol as P
from inference_engine.bus.server import EngineServer, ServeSettings
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, assert_idle


def test_a_request_aborted_in_the_queue_ends_with_an_error(engine, redis_server, raw_redis, client, prefix):
    """Two of them: the blocking read that wakes the engine takes the first, whose abort the next round trip
    asks about beside the top-up read; that read takes the second, asked about on its own."""
    keys = P.Keys(prefix)
    server = EngineServer(engine, redis_server.url, MODEL, ServeSettings(prefix=prefix, idle_block=0.05))
    server._connect()  # the streams exist, so a request can wait in the queue before the engine runs
    messages = [
        P.Generate(f"queued-then-aborted-{i}", SamplingParams(max_tokens=4).to_dict(), prompt="Hello")
        for i in range(2)
    ]
    for message in messages:
        raw_redis.xadd(keys.requests(MODEL), P.encode(message))
        client.abort(MODEL, message.id)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        endings = []
        for message in messages:
            entries = raw_redis.xread({keys.output(message.id): "0-0"}, block=10_000)
            (_, [(_, fields)]) = entries[0]
            endings.append(P.parse(fields))
    finally:
        server.stop()
        thread.join(10)
    assert all(isinstance(e, P.Error) and e.code == "aborted" for e in endings), endings
    assert_idle(engine)


def test_an_idle_engine_acknowledges_a_request_one_round_trip_after_the_read_that_woke_it(
    engine, redis_server, client, prefix
):
    """Between the blocking read that brings a lone request and its ack, one round trip: the top-up read,
    which also asks whether the request was aborted meanwhile."""
    server = EngineServer(engine, redis_server.url, MODEL, ServeSettings(prefix=prefix, idle_block=0.05))
    server._connect()
    trips: list[list[str]] = []  # the commands of each pipeline the server ran, in order
    pipeline = server.redis.pipeline

    def recorded(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        def run(*a, **k):
            trips.append([str(command[0]).upper() for command, _ in pipe.command_stack])
            return execute(*a, **k)

        pipe.execute = run
        return pipe

    server.redis.pipeline = recorded
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        stream = client.generate(MODEL, "Hello", SamplingParams(temperature=0.0, max_tokens=2))
        assert len(list(stream)) >= 1
    finally:
        server.stop()
        thread.join(10)
    ack = next(i for i, commands in enumerate(trips) if "XADD" in commands)
    woke = max(i for i in range(ack) if "XREADGROUP" in trips[i] and "XREAD" in trips[i])
    assert trips[woke + 1 : ack] == [["XREADGROUP", "XREADGROUP", "EXISTS"]], trips[woke : ack + 1]
    assert_idle(engine)
