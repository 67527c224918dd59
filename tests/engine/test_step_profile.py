"""benchmarks/step_profile.py on the CPU: a batch's steps are timed and profiled, then its requests are
aborted with every KV block given back (the engine is shared with other tests)."""

import pytest

from benchmarks.step_profile import plot, profile_batch

from .conftest import assert_all_blocks_free


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_profiled_batch_reports_its_step_and_leaves_the_engine_idle(llm, tmp_path, sampling):
    row = profile_batch(llm, batch=3, steps=2, sampling=sampling)
    assert (row["batch"], row["sampling"]) == (3, sampling) and row["step_ms"] > 0
    assert row["kernel_ms_per_step"] is None  # no separate device on the CPU
    own = [f["own_ms_per_step"] for f in row["host_functions"]]
    assert own == sorted(own, reverse=True) and len(own) == 15
    assert all(f["cumulative_ms_per_step"] >= f["own_ms_per_step"] > 0 for f in row["host_functions"])
    assert_all_blocks_free(llm)
    plot([row], tmp_path / "profile.png")
    assert (tmp_path / "profile.png").stat().st_size > 0
