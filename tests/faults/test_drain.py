"""SIGTERM of the web workers (what the launcher sends them on Ctrl-C or SIGTERM) drains them: a stream of
about five seconds in flight finishes whole, one that would outlast the grace period ends with an error event
and ``[DONE]`` (its request aborted in the engine), and the workers exit by themselves (the launcher then
starts them again, so the stack serves on)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from .load import chat
from .stack import MODEL, SHUTDOWN_GRACE, LauncherStack

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "ignore_eos": True}
MOST = 460  # the stack's context is 512 tokens


def test_sigterm_lets_a_five_second_stream_finish(launched: LauncherStack) -> None:
    async def scenario():
        probe = await chat(launched.port, launched.api_key, MODEL, timeout=120, max_tokens=64, **GREEDY)
        assert probe.complete and probe.ttft is not None, probe
        rate = 63 / max(probe.elapsed - probe.ttft, 1e-3)  # tokens a second after the first
        short = max(16, min(MOST, int(rate * 5)))
        started = [asyncio.Event(), asyncio.Event()]
        streams = [
            asyncio.create_task(
                chat(
                    launched.port, launched.api_key, MODEL, first_token=e, timeout=120, max_tokens=n, **GREEDY
                )
            )
            for e, n in zip(started, (short, MOST), strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        workers = launched.pids(r"hostproject\.server")
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        short_outcome, long_outcome = await asyncio.gather(*streams)
        deadline = time.monotonic() + 20
        while any(pid in launched.pids(r"hostproject\.server") for pid in workers):
            assert time.monotonic() < deadline, "the workers did not exit after draining"
            await asyncio.sleep(0.2)
        return rate, short, short_outcome, long_outcome, time.monotonic() - signalled

    rate, short, short_outcome, long_outcome, exited = asyncio.run(scenario())
    long_end = "complete" if long_outcome.complete else (long_outcome.error or {}).get("code")
    print(
        f"\n{rate:.0f} tokens/s: the {short}-token stream {'complete' if short_outcome.complete else 'CUT'}; "
        f"the {MOST}-token one {long_end}; workers gone {exited:.1f}s after SIGTERM (grace {SHUTDOWN_GRACE}s)"
    )
    assert short_outcome.complete and short_outcome.finish_reason == "length", short_outcome
    assert long_outcome.complete or (long_outcome.clean_error and long_outcome.done), long_outcome
    if MOST / rate > SHUTDOWN_GRACE + 3:  # it could not have finished in time
        assert not long_outcome.complete and "shut down" in long_outcome.error["message"], long_outcome
    assert exited < SHUTDOWN_GRACE + 10
