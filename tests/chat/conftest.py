"""Fixtures of the chat tests: Django settings, a private redis-server, and a fake engine (a thread of the
test process) for the in-process consumer tests. The real stack (daphne, engine process) is
`tests/web/stack.py`'s."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import django
import pytest

# As in tests/web: pytest-django needs the settings before the test modules import models.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-only-secret")
django.setup()

from inference_engine.bus.redis_server import RedisServer  # noqa: E402
from inference_engine.bus.server import EngineServer, ServeSettings  # noqa: E402
from tests.bus.fake_engine import FakeEngine  # noqa: E402
from tests.web.stack import Stack  # noqa: E402

FAKE_MODEL = "fake"
ADMIN = ("admin", "chat-test-password")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer().start() as server:
        yield server


class FakeServer:
    """A bus engine server over `FakeEngine` (a letter per step, `step_delay` seconds a step) in a thread."""

    def __init__(self, url: str, prefix: str, step_delay: float) -> None:
        self.engine = FakeEngine(step_delay=step_delay)
        settings = ServeSettings(prefix=prefix, heartbeat_interval=0.2, heartbeat_ttl=1.0, claim_min_idle=0.2,
                                 idle_block=0.05, shutdown_grace=2.0)
        self.server = EngineServer(self.engine, url, FAKE_MODEL, settings)
        self.server._connect()  # registered before the thread runs: clients never race the first heartbeat
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)


@pytest.fixture
def fake_engine(redis_server: RedisServer, settings) -> Iterator[FakeEngine]:
    """A fake engine on its own bus namespace, and the LLMSERVE settings pointing the app at it. Slow enough
    (20 ms a token) that a test can act while an answer streams."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings.LLMSERVE = {"REDIS_URL": redis_server.url, "BUS_PREFIX": prefix, "ACK_TIMEOUT": 5.0,
                         "STREAM_TIMEOUT": 5.0}
    server = FakeServer(redis_server.url, prefix, step_delay=0.02)
    yield server.engine
    server.stop()


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The real thing: redis-server, an engine process with the bundled model, daphne; and a login."""
    stack = Stack().start()
    try:
        stack.manage("shell", "-c", "from django.contrib.auth.models import User; "
                     f"User.objects.create_superuser({ADMIN[0]!r}, '', {ADMIN[1]!r})")
        yield stack
    finally:
        stack.stop()
