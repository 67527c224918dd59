"""Rate limits count in fixed one-minute windows (`llmserve.ratelimit`): a test that expects a refusal must
not let the window turn between the requests that use the limit up and the one that should be refused."""

from __future__ import annotations

import time

from llmserve.ratelimit import WINDOW


def early_in_a_rate_window(needed: float) -> None:
    """Returns once at least `needed` seconds of the current window are left, waiting for the next if not."""
    left = WINDOW - time.time() % WINDOW
    if left < needed:
        time.sleep(left + 0.05)
