"""Where the engine's threads take every CPU, the server idles a moment after writing a request's first
token, so that the web process and Redis, which deliver it to the client, get a core before the next step
takes them all."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from inference_engine.bus.server import EngineServer, ServeSettings, first_token_pause_for
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, assert_idle

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


@contextmanager
def _serving(engine, url: str, settings: ServeSettings) -> Iterator[_RecordedEvent]:
    """A server over `engine` in a thread while the block runs; yields its recorded stop event."""
    server = EngineServer(engine, url, MODEL, settings)
    server._stopping = stopping = _RecordedEvent()
    server._connect()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield stopping
    finally:
        server.stop()
        thread.join(10)
    assert_idle(engine)


def test_the_server_pauses_after_a_first_token_while_work_remains(engine, client, redis_server, prefix):
    settings = ServeSettings(prefix=prefix, idle_block=0.05, first_token_pause=PAUSE)
    with _serving(engine, redis_server.url, settings) as stopping:
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


def test_no_pause_by_default(engine, client, redis_server, prefix):
    with _serving(engine, redis_server.url, ServeSettings(prefix=prefix, idle_block=0.05)) as stopping:
        assert client.generate(MODEL, "The sky is", SamplingParams(max_tokens=6, ignore_eos=True)).result()
    assert stopping.waits == []
