"""The host project's settings with a small admission bound, for the queue-limit test's extra web server."""

from hostproject.settings import *  # noqa: F403
from hostproject.settings import LLMSERVE

LLMSERVE = {**LLMSERVE, "MAX_QUEUE": 6}
