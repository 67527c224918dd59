"""Request ownership on the launcher's real stack: SIGKILL a daphne worker while it streams long answers, and
the engine stops generating them (their KV blocks freed) within 10 s, while the other worker's streams go on.
Nobody is left to send those requests' aborts: the engine notices that their owner's liveness key lapsed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from inference_engine.bus.client import EngineClient

from .load import chat
from .stack import MODEL, LauncherStack, established

pytestmark = pytest.mark.timeout(300)

LONG = {"max_tokens": 460, "temperature": 0, "ignore_eos": True}  # the stack's context is 512 tokens
FREED_WITHIN = 10.0


def _inflight(client: EngineClient) -> tuple[int, float]:
    """The engine's requests in flight, and when its heartbeat said so."""
    (model,) = [m for m in client.list_models() if m.name == MODEL]
    data = model.replicas[0].data
    return data["inflight"], data["time"]


def test_killing_a_web_worker_frees_its_requests_in_the_engine(launched: LauncherStack) -> None:
    bus = EngineClient(launched.redis_url)

    async def scenario() -> tuple[int, int, float, int]:
        started = [asyncio.Event() for _ in range(10)]
        streams = [
            asyncio.create_task(chat(launched.port, launched.api_key, MODEL, first_token=e, **LONG))
            for e in started
        ]
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started):
            assert not any(t.done() for t in streams), [t.result() for t in streams if t.done()]
            assert time.monotonic() < deadline, "the streams did not all start within 120 s"
            await asyncio.sleep(0.05)
        workers = launched.pids(r"hostproject\.server")
        load = {pid: established(pid, launched.port) for pid in workers}
        victim = max(load, key=load.get)  # the worker with the most streams
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.sleep(1.0)
        cut = sum(1 for t in streams if t.done() and t.result().cut)
        while True:  # until the engine runs only what the surviving worker still streams
            inflight, beat = await asyncio.to_thread(_inflight, bus)
            streaming = sum(1 for t in streams if not t.done())
            if beat > time.time() - 60 and inflight <= streaming:
                break
            assert time.monotonic() - killed < FREED_WITHIN + 5, (inflight, streaming)
            await asyncio.sleep(0.2)
        freed = time.monotonic() - killed
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return load[victim], cut, freed, streaming

    try:
        victim_streams, cut, freed, still_streaming = asyncio.run(scenario())
    finally:
        bus.close()
    print(
        f"\nSIGKILL of a daphne worker holding {victim_streams} of 10 streams: {cut} cut; the engine ran "
        f"only the other worker's {still_streaming} after {freed:.1f}s"
    )
    assert cut == victim_streams > 0
    assert freed < FREED_WITHIN
    # The surviving streams were still running then, and the killed worker's were as long: those were
    # aborted, not finished.
    assert still_streaming > 0 or victim_streams == 10
