"""`tests.faults.settings` with a small admission bound, for the queue-limit test's extra web server."""

from tests.faults.settings import *  # noqa: F403
from tests.faults.settings import LLMSERVE

LLMSERVE = {**LLMSERVE, "MAX_QUEUE": 6}
