"""Fixtures of the web tests: Django settings for the in-process (pytest-django) tests, and one real serving
stack (redis-server, engine, SQLite, daphne) shared by every end-to-end test of the session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import django
import pytest

# pytest-django looks for settings before this conftest is imported (the project's pytest configuration
# names none, so that the other test folders stay Django-free); set them here and finish Django's setup so the
# test modules can import models. pytest-django's fixtures find the configured settings.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-only-secret")
django.setup()

from .stack import Stack  # noqa: E402


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    stack = Stack().start()
    try:
        yield stack
    finally:
        stack.stop()
