"""Django's settings for every test folder that sets Django up (each does so with ``setdefault``, so this
choice wins): `tests.settings`, the host project's on the tests' database."""

import os
import sys

import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")


@pytest.fixture(autouse=True)
def _forget_lookups():
    """After each test, the app's recent API keys and model entries (`llmserve.lookups`) are forgotten: they
    are rows of a test database that pytest-django empties without the signals that would clear them."""
    yield
    lookups = sys.modules.get("llmserve.lookups")  # never imported (nor Django set up) by the engine's tests
    if lookups is not None:
        lookups.forget()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """pytest-django cannot drop its PostgreSQL test database while a thread of an in-process ASGI test still
    holds a connection to it (it warns and leaves it); drop it by force."""
    try:
        from django.conf import settings
    except ImportError:  # a machine that runs only the engine's tests (the GPU check's)
        return

    if settings.configured and settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        from tests.database import drop_postgres_database, in_process_test_database

        drop_postgres_database(in_process_test_database())
