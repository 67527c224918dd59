"""SIGKILL of each service of the launcher's stack in the middle of load: the stack serves again by itself
(measured: seconds from the kill to the first complete answer), and the clients that were being answered
get a clean error — an error event then ``[DONE]``, or a closed connection — never a hang.

Not here: a Celery worker killed mid-job (bulk jobs' own tests cover it)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from .load import Outcome, chat
from .stack import MODEL, LauncherStack

pytestmark = pytest.mark.timeout(300)

# Still streaming when the kill lands. (The engine aborts a killed web worker's streams once its owner key
# lapses, test_orphans.py; the web worker is still killed last.)
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
RECOVERY_LIMIT = 10.0
SETTLE = 15.0  # seconds after a kill within which every stream it concerned has ended


async def _kill_mid_load(
    stack: LauncherStack, pattern: str, clients: int = 6
) -> tuple[list[Outcome | None], float]:
    """Start `clients` long streams, kill the newest process matching `pattern` once all stream, then ask
    until an answer completes. Returns the seconds from the kill to that answer, and how each stream ended
    within `SETTLE` seconds of the kill (None: still streaming, so the kill did not concern it)."""
    await _settled(stack)
    started = [asyncio.Event() for _ in range(clients)]
    streams = [
        asyncio.create_task(chat(stack.port, stack.api_key, MODEL, first_token=event, timeout=300, **LONG))
        for event in started
    ]
    deadline = time.monotonic() + 120
    while not all(event.is_set() for event in started):
        ended = [t.result() for t, e in zip(streams, started, strict=True) if t.done() and not e.is_set()]
        assert not ended, f"a stream ended before its first token: {ended}"
        assert time.monotonic() < deadline, "the streams did not all start within 120 s"
        await asyncio.sleep(0.05)
    await asyncio.to_thread(stack.kill, pattern)
    killed = time.monotonic()
    while True:
        probe = await chat(stack.port, stack.api_key, MODEL, "Hi", stream=False, timeout=5, max_tokens=2)
        if probe.complete:
            break
        assert time.monotonic() - killed < 60, probe
        await asyncio.sleep(0.1)
    recovery = time.monotonic() - killed
    await asyncio.wait(streams, timeout=max(0.0, killed + SETTLE - time.monotonic()))
    for task in streams:
        task.cancel()  # the client goes away: the server aborts the request
    return [task.result() if task.done() and not task.cancelled() else None for task in streams], recovery


async def _settled(stack: LauncherStack, in_a_row: int = 6) -> None:
    """Until `in_a_row` short answers come back one after another (the web workers take turns): a previous
    test's kill may still be settling (after a Redis restart, each worker's pooled connections fail once,
    and the engine re-registers within a second or two), and load started then would meet its clean 503s."""
    deadline, good = time.monotonic() + 60, 0
    while good < in_a_row:
        assert time.monotonic() < deadline, "the stack did not settle within 60 s"
        probe = await chat(stack.port, stack.api_key, MODEL, "Hi", stream=False, timeout=10, max_tokens=1)
        good = good + 1 if probe.complete else 0


def _check(what: str, outcomes: list[Outcome | None], recovery: float) -> None:
    ends = [
        "streaming"
        if o is None
        else "complete"
        if o.complete
        else "cut"
        if o.cut
        else (o.error or {}).get("code")
        for o in outcomes
    ]
    print(
        f"\nSIGKILL {what}: serving again after {recovery:.2f}s; streams {SETTLE:g}s after the kill: {ends}"
    )
    for outcome in filter(None, outcomes):
        assert outcome.complete or outcome.clean_error, outcome
        if outcome.error:
            assert not re.search(r"127\.0\.0\.1|redis://|:\d{4,5}\b", outcome.error["message"]), outcome.error
    assert recovery < RECOVERY_LIMIT, f"{what}: {recovery:.1f}s"


def test_sigkill_redis_mid_load(launched: LauncherStack) -> None:
    outcomes, recovery = asyncio.run(_kill_mid_load(launched, r"redis-server "))
    _check("redis-server", outcomes, recovery)
    # Redis (no persistence) forgot them all: every one ended with an error.
    assert all(o is not None and o.error for o in outcomes), outcomes


def test_sigkill_the_engine_mid_load(launched: LauncherStack) -> None:
    deadline = time.monotonic() + 240
    while "standing by" not in launched.log("engine"):  # the spare has loaded the model
        assert time.monotonic() < deadline, launched.log("engine")[-3000:]
        time.sleep(0.5)
    outcomes, recovery = asyncio.run(_kill_mid_load(launched, r"inference_engine serve (?!.*--standby)"))
    _check("the engine", outcomes, recovery)
    assert all(o is not None and o.error for o in outcomes), outcomes  # its only replica died


def test_sigkill_the_supervisor_mid_load(launched: LauncherStack) -> None:
    """Its engines serve on, and the supervisor the launcher starts again adopts them and the spare."""
    deadline = time.monotonic() + 240
    while True:  # a spare has loaded the model since the last one took over (the engine's test)
        log = launched.log("engine")
        engines = launched.pids(r"inference_engine serve")
        if len(engines) == 2 and log.rfind("standing by") > log.rfind("takes over"):
            break
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.5)
    outcomes, recovery = asyncio.run(_kill_mid_load(launched, r"inference_engine supervise"))
    _check("the supervisor", outcomes, recovery)
    assert all(o is None or o.complete for o in outcomes), outcomes  # nothing interrupted
    deadline = time.monotonic() + 60
    while "adopted" not in launched.log("engine"):
        assert time.monotonic() < deadline, launched.log("engine")[-3000:]
        time.sleep(0.5)
    # The same serving process and spare, alive (children of init now, so not found by descent).
    assert len(engines) == 2 and all(Path(f"/proc/{pid}").exists() for pid in engines), engines


def test_sigkill_a_web_worker_mid_load(launched: LauncherStack) -> None:
    before = launched.pids(r"hostproject\.server")
    outcomes, recovery = asyncio.run(_kill_mid_load(launched, r"hostproject\.server"))
    _check("a daphne worker", outcomes, recovery)
    deadline = time.monotonic() + 30
    while len(launched.pids(r"hostproject\.server")) < len(before):  # the launcher restarted it
        assert time.monotonic() < deadline
        time.sleep(0.2)
