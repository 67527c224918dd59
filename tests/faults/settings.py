"""The host project's settings for the launcher's stack in these tests: requests may wait long for the engine
(this machine is small and shared; the wait limit is not what these tests measure)."""

from hostproject.settings import *  # noqa: F403
from hostproject.settings import LLMSERVE

LLMSERVE = {**LLMSERVE, "ACK_TIMEOUT": 900.0, "STREAM_TIMEOUT": 120.0}
