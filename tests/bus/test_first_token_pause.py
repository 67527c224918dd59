"""Where the engine's threads take every CPU, the server idles a moment after writing a request's first
token, so that the web process and Redis, which deliver it to the client, get a core before the next step
takes them all."""

from __future__ import annotations

import threading

from inference_engine.bus.server import first_token_pause_for
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, ThreadedServer

PAUSE = 0.125


class _RecordedEvent(threading.Event):
    """The server's stop event, recording every wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def test_serve_pauses_only_where_the_engine_takes_every_cpu() -> None:
    assert first_token_pause_for(threads=2, cpus=2) == first_token_pause_for(threads=8, cpus=4) > 0
    assert first_token_pause_for(threads=2, cpus=4) == 0


def _server(engine, url: str, prefix: str, **settings) -> tuple[ThreadedServer, _RecordedEvent]:
    """A started server over `engine` whose stop event records its waits."""
    server = ThreadedServer(engine, url, prefix, **settings)
    server.server._stopping = stopping = _RecordedEvent()
    server.server._connect()
    return server.start(), stopping


def test_the_server_pauses_after_a_first_token_while_work_remains(engine, client, redis_server, prefix):
    server, stopping = _server(engine, redis_server.url, prefix, first_token_pause=PAUSE)
    try:
        # One token and nothing else running: the request ends with its first token, nothing to give way to.
        assert client.generate(MODEL, "Hello", SamplingParams(max_tokens=1, ignore_eos=True)).result()
        assert stopping.waits.count(PAUSE) == 0
        # Several tokens: a pause after the first, none after the others.
        streams = [
            client.generate(MODEL, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
            for prompt in ("The sky is", "Once upon a time")
        ]
        for stream in streams:
            assert len(stream.result().outputs[0].token_ids) == 6
        # One pause per step that gave a request its first token: one or two steps, as the two were admitted.
        assert 1 <= stopping.waits.count(PAUSE) <= 2
    finally:
        server.stop()


def test_no_pause_by_default(engine, client, redis_server, prefix):
    server, stopping = _server(engine, redis_server.url, prefix)
    try:
        assert client.generate(MODEL, "The sky is", SamplingParams(max_tokens=6, ignore_eos=True)).result()
    finally:
        server.stop()
    assert stopping.waits == []
