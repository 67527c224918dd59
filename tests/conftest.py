"""Django's settings for every test folder that sets Django up (each does so with ``setdefault``, so this
choice wins): `tests.settings`, the host project's on the tests' database."""

import os

import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")


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
