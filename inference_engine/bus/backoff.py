"""When to restart a process that died: the one policy of the engine supervisor (its engines) and of the
launcher (`hostproject.run`, its services), so that the two cannot drift apart.

At once after the first death, then after 1, 2, 4 ... seconds (at most `MAX_DELAY`) while the process keeps
dying; a process that ran `STABLE_AFTER` seconds before it died starts the count over. A crash now and then
costs no wait, and a process that cannot start (bad configuration, out of memory) does not spin.
"""

from __future__ import annotations

MAX_DELAY = 30.0  # seconds
STABLE_AFTER = 60.0  # seconds of running after which a death counts as the first again


class RestartBackoff:
    """One process's deaths in a row. With `give_up_after`, the death after that many quick restarts in a
    row is the last: `given_up` says so."""

    def __init__(self, give_up_after: int | None = None) -> None:
        self.give_up_after = give_up_after
        self.failures = 0  # deaths in a row, each within `STABLE_AFTER` of its start but the first

    def died(self, ran_for: float) -> float:
        """Seconds to wait before restarting a process that died after running `ran_for` seconds."""
        if ran_for > STABLE_AFTER:
            self.failures = 0
        delay = 0.0 if self.failures == 0 else min(MAX_DELAY, 2.0 ** (self.failures - 1))
        self.failures += 1
        return delay

    @property
    def given_up(self) -> bool:
        return self.give_up_after is not None and self.failures > self.give_up_after
