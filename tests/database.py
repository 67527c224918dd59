"""The database of the tests' real stacks: PostgreSQL (the production database) when one answers on the
loopback with trust authentication, else a SQLite file.

`TestDatabase.create()` makes a fresh, uniquely named database so that stacks of concurrent test runs never
share one; `drop()` removes it. ``LLMSERVE_TEST_DATABASE=sqlite`` forces SQLite.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

ADMIN_URL = os.environ.get("LLMSERVE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def postgres_available() -> bool:
    if os.environ.get("LLMSERVE_TEST_DATABASE") == "sqlite":
        return False
    try:
        import psycopg

        with psycopg.connect(ADMIN_URL, connect_timeout=2) as connection:
            connection.execute("SELECT 1")
    except Exception:  # not installed, not running, no such role: the tests use SQLite
        return False
    return True


@dataclass
class TestDatabase:
    url: str  # DATABASE_URL for the stack's processes
    postgres_name: str | None = None

    @classmethod
    def create(cls, workdir: Path) -> TestDatabase:
        if not postgres_available():
            return cls(f"sqlite:///{workdir / 'db.sqlite3'}")
        import psycopg

        name = f"llmserve_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return cls(ADMIN_URL.rsplit("/", 1)[0] + f"/{name}", name)

    @property
    def vendor(self) -> str:
        return "postgresql" if self.postgres_name else "sqlite"

    def drop(self) -> None:
        if self.postgres_name is not None:
            drop_postgres_database(self.postgres_name)


def in_process_test_database() -> str:
    """The name pytest-django gives this run's test database on PostgreSQL (see tests/settings.py)."""
    return f"test_llmserve_{os.getpid()}"


def drop_postgres_database(name: str) -> None:
    """Drop `name` even if connections are left open on it (e.g. by threads of in-process ASGI tests)."""
    import psycopg

    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
