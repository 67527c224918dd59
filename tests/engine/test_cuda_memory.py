"""The KV budget on CUDA: gpu_memory_utilization is each engine's share of the device, as in vLLM. The
arithmetic runs here with the device's memory readings stood in (they need a GPU); the GPU check runs
several engines in one process for real (tests/engine/test_cuda_engine.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from inference_engine.config import EngineConfig
from inference_engine.cuda_runner import CUDARunner

GiB = 2**30


def _runner(monkeypatch, *, utilization, before, peak, activations, free, total=100 * GiB) -> CUDARunner:
    """A runner whose process held `before` bytes when it started, `peak` at its profiling step's peak
    (`activations` of them the step's own), on a device of `total` bytes with `free` free afterwards."""
    runner = object.__new__(CUDARunner)
    runner.config = EngineConfig(gpu_memory_utilization=utilization)
    runner.device = torch.device("cuda", 0)
    runner._allocated_before = before
    monkeypatch.setattr(runner, "_profile_peak_memory", lambda: (peak, activations), raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    return runner


def test_an_engine_alone_gets_its_share_less_its_weights_and_activations(monkeypatch):
    runner = _runner(monkeypatch, utilization=0.9, before=0, peak=6 * GiB, activations=2 * GiB, free=93 * GiB)
    assert runner._kv_budget() == 90 * GiB - 6 * GiB


def test_a_second_engine_in_the_process_is_not_charged_for_the_first(monkeypatch, caplog):
    # The first engine holds 40 GiB (weights and cache); this one's weights and activations peak at 4 GiB.
    runner = _runner(
        monkeypatch, utilization=0.4, before=40 * GiB, peak=44 * GiB, activations=1 * GiB, free=57 * GiB
    )
    with caplog.at_level(logging.WARNING):
        assert runner._kv_budget() == 40 * GiB - 4 * GiB
    assert not caplog.records


@pytest.mark.parametrize("utilization", [0.9, 1.0])
def test_the_cache_takes_only_what_is_free_and_says_so(monkeypatch, caplog, utilization):
    # Another process holds 30 GiB: a share of 90 GiB does not fit beside it.
    runner = _runner(
        monkeypatch, utilization=utilization, before=0, peak=5 * GiB, activations=2 * GiB, free=67 * GiB
    )
    with caplog.at_level(logging.WARNING):
        assert runner._kv_budget() == 67 * GiB - 2 * GiB
    assert "only 65.00 GiB are free" in caplog.text
