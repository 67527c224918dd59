"""Settings of the in-process Django tests (pytest-django): the host project's, on PostgreSQL when one answers
on the loopback (pytest-django creates and drops the test database, named for this run so that concurrent
runs never meet), else SQLite. The tests' real stacks choose the same way (`tests.database`)."""

import dj_database_url

from hostproject.settings import *  # noqa: F403
from tests.database import ADMIN_URL, in_process_test_database, postgres_available

if postgres_available():
    DATABASES = {"default": dj_database_url.parse(ADMIN_URL)}
    DATABASES["default"]["TEST"] = {"NAME": in_process_test_database()}
