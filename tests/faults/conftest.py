"""One stack started by the launcher itself (`tests/faults/stack.py`), shared by every test here: load first,
then the crashes, each of which the stack must survive by itself."""

from __future__ import annotations

import os
from collections.abc import Iterator

import django
import pytest

# As in tests/web: pytest-django needs the settings before the test modules import Django.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-only-secret")
django.setup()

from .stack import LauncherStack  # noqa: E402


@pytest.fixture(scope="package")
def launched(request: pytest.FixtureRequest) -> Iterator[LauncherStack]:
    stack = LauncherStack()
    failed_before = request.session.testsfailed
    try:
        yield stack.start()  # inside: a start that fails after the launcher is up still stops it
    finally:
        stack.stop(keep_logs=request.session.testsfailed > failed_before)
