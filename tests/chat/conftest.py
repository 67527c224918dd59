"""Fixtures of the chat tests: Django settings, a private redis-server, and for the in-process consumer tests
the session's real `LLMEngine` (tests/bus/conftest.py's) served on a bus namespace of its own by an
`EngineServer` in a thread of the test process. The whole real stack (daphne, engine process) is
`tests/web/stack.py`'s."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import django
import pytest

# As in tests/web: pytest-django needs the settings before the test modules import models.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-only-secret")
django.setup()

from inference_engine.bus.redis_server import RedisServer  # noqa: E402
from tests.bus import conftest as bus_fixtures  # noqa: E402
from tests.bus.conftest import ThreadedServer  # noqa: E402
from tests.web.stack import Stack  # noqa: E402

if TYPE_CHECKING:
    from inference_engine.llm_engine import LLMEngine

ADMIN = ("admin", "chat-test-password")

# The session's real engine (SmolLM2-135M on CPU, float32, one torch thread, 512-token context, small KV
# budget): tests/bus's fixture, made a fixture of these tests too.
engine = bus_fixtures.engine


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer().start() as server:
        yield server


@pytest.fixture
def serve(engine: LLMEngine, redis_server: RedisServer, settings) -> Iterator[Callable[[], ThreadedServer]]:
    """Starts a bus server over the shared engine on a fresh namespace and points the app's LLMSERVE settings
    at it. Call it after any `generate_offline` (the engine must not be stepped by two threads); the server
    is stopped at teardown, which also checks that it left the engine empty with every KV block free."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings.LLMSERVE = {
        "REDIS_URL": redis_server.url,
        "BUS_PREFIX": prefix,
        "ACK_TIMEOUT": 5.0,
        "STREAM_TIMEOUT": 5.0,
    }
    servers: list[ThreadedServer] = []

    def start() -> ThreadedServer:
        assert not servers, "one server per test"
        server = ThreadedServer(engine, redis_server.url, prefix)
        server.server._connect()  # registered before the thread runs: clients never race the first heartbeat
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def served(engine: LLMEngine, serve: Callable[[], ThreadedServer]) -> LLMEngine:
    """The real engine, already served on the bus the app is configured for."""
    serve()
    return engine


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The real thing: redis-server, an engine process with the bundled model, daphne; and a login."""
    stack = Stack().start()
    try:
        stack.manage(
            "shell",
            "-c",
            "from django.contrib.auth.models import User; "
            f"User.objects.create_superuser({ADMIN[0]!r}, '', {ADMIN[1]!r})",
        )
        yield stack
    finally:
        stack.stop()
