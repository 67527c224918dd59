"""The restart policy shared by the engine supervisor and the launcher (`inference_engine.bus.backoff`)."""

from __future__ import annotations

from inference_engine.bus.backoff import MAX_DELAY, STABLE_AFTER, RestartBackoff


def test_quick_deaths_wait_longer_each_time_up_to_the_cap() -> None:
    backoff = RestartBackoff()
    delays = [backoff.died(ran_for=1.0) for _ in range(9)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_DELAY, MAX_DELAY, MAX_DELAY]
    assert not backoff.given_up  # the launcher's services are never given up on


def test_a_death_after_a_stable_run_counts_as_the_first() -> None:
    backoff = RestartBackoff()
    assert [backoff.died(1.0) for _ in range(3)] == [0.0, 1.0, 2.0]
    assert backoff.died(STABLE_AFTER + 1) == 0.0
    assert backoff.died(1.0) == 1.0


def test_it_gives_up_after_that_many_quick_restarts_in_a_row() -> None:
    backoff = RestartBackoff(give_up_after=3)
    assert [backoff.died(1.0) for _ in range(3)] == [0.0, 1.0, 2.0]
    assert not backoff.given_up
    backoff.died(1.0)
    assert backoff.given_up
