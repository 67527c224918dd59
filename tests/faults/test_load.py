"""Load against the launcher's real stack (two daphne workers, one engine with up to 128 sequences in a
batch): a crowd of streamed chats is queued, not refused; a small admission bound refuses only the excess, and
only with 429 + Retry-After; rate limits hold across the web workers."""

from __future__ import annotations

import asyncio
import collections
import http.client
import subprocess
import sys
import time

import pytest

from inference_engine.bus.redis_server import free_port

from .load import chat
from .stack import MODEL, ROOT, LauncherStack

pytestmark = pytest.mark.timeout(600)

GREEDY_16 = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


def summary(outcomes: list) -> collections.Counter:
    return collections.Counter(
        "complete" if o.complete else f"{o.status} {o.error and o.error.get('code')}" for o in outcomes
    )


def test_200_concurrent_streamed_chats_all_complete(launched: LauncherStack) -> None:
    async def crowd() -> list:
        return await asyncio.gather(
            *(
                chat(
                    launched.port,
                    launched.api_key,
                    MODEL,
                    f"Tell me a fact about the number {i}.",
                    **GREEDY_16,
                )
                for i in range(200)
            )
        )

    start = time.monotonic()
    outcomes = asyncio.run(crowd())
    wall = time.monotonic() - start
    counts = summary(outcomes)
    ttfts = sorted(o.ttft for o in outcomes if o.ttft is not None)
    print(f"\n200 streamed chats: {dict(counts)} in {wall:.1f}s, TTFT p50 {ttfts[len(ttfts) // 2]:.2f}s")
    assert counts == {"complete": 200}, counts
    assert all(o.finish_reason == "length" and o.text for o in outcomes)


def test_small_queue_limit_refuses_only_the_excess_with_retry_after(launched: LauncherStack) -> None:
    """A third web process on the same bus, whose admission bound (MAX_QUEUE) is 6."""
    port = free_port()
    env = {
        **launched.env,
        "DJANGO_SETTINGS_MODULE": "tests.faults.settings_queue",
        "LLMSERVE_REDIS_URL": launched.redis_url,
    }
    web = subprocess.Popen(
        [sys.executable, "-m", "hostproject.server", "-p", str(port), "hostproject.asgi:application"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert web.poll() is None and time.monotonic() < deadline
            time.sleep(0.3)

        async def crowd() -> list:
            return await asyncio.gather(
                *(chat(port, launched.api_key, MODEL, **GREEDY_16) for _ in range(40))
            )

        outcomes = asyncio.run(crowd())
    finally:
        web.terminate()
        web.wait(30)
    counts = summary(outcomes)
    print(f"\n40 chats against MAX_QUEUE=6: {dict(counts)}")
    refused = [o for o in outcomes if not o.complete]
    assert counts["complete"] >= 6 and refused, counts
    for outcome in refused:
        assert outcome.status == 429 and outcome.retry_after and int(outcome.retry_after) >= 1, outcome
        assert outcome.error["code"] == "engine_overloaded", outcome


def test_rate_limit_holds_across_web_workers(launched: LauncherStack) -> None:
    """Counted in Redis: the two daphne processes behind the port share one limit (in process memory, each
    would allow the limit again)."""
    for _ in range(2):  # the limit's window is a minute: try again if the burst straddled two
        window = int(time.time() // 60)
        key = launched.manage("llmserve_createkey", "limited", "--rate-limit", "5").strip()
        statuses = []
        for _ in range(12):
            connection = http.client.HTTPConnection("127.0.0.1", launched.port, timeout=30)
            connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
            statuses.append(connection.getresponse().status)
            connection.close()
        if int(time.time() // 60) == window:
            break
    assert statuses.count(200) == 5 and statuses.count(429) == 7, statuses
