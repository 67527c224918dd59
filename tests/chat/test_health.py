"""``/health`` in process, against a real Redis bus and the session's real engine served in a thread: 503 with
a reason while no replica is live, 200 with the replicas while one is, and per model with ``?model=``."""

from __future__ import annotations

import json

import pytest
from django.test import AsyncClient

from tests.bus.conftest import MODEL

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]


async def health(query: str = "") -> tuple[int, dict]:
    reply = await AsyncClient().get("/health" + query)
    return reply.status_code, json.loads(reply.content)


@pytest.mark.asyncio
async def test_health_follows_the_live_replicas(serve) -> None:
    status, body = await health()  # the bus answers, but no engine serves anything yet
    assert status == 503 and body["status"] == "unavailable" and "no live engine replica" in body["detail"]
    server = serve()
    assert await health() == (200, {"status": "ok", "models": {MODEL: {"replicas": 1}}})
    assert await health(f"?model={MODEL}") == (200, {"status": "ok", "model": MODEL, "replicas": 1})
    status, body = await health("?model=another")
    assert status == 503 and "`another`" in body["detail"]
    server.server.stop()  # a replica that stops withdraws its heartbeat at once
    server.thread.join(10)
    status, body = await health(f"?model={MODEL}")
    assert status == 503 and body["models"] == {}


@pytest.mark.asyncio
async def test_health_without_redis(settings) -> None:
    settings.LLMSERVE = {"REDIS_URL": "redis://127.0.0.1:9/0"}
    status, body = await health()
    assert status == 503 and "does not answer" in body["detail"] and "127.0.0.1" not in body["detail"]
