"""`python -m inference_engine serve` as a process that hosts one engine for its whole life."""

from __future__ import annotations

import gc

import torch

from inference_engine import __main__ as cli
from inference_engine.bus.server import first_token_pause_for


def test_serve_puts_the_startup_heap_out_of_the_collectors_reach(redis_server, prefix, monkeypatch) -> None:
    """Every object alive once the engine is built lives as long as the process: a full collection that walks
    them again pauses every step for nothing, so serve freezes them before it takes its first request."""
    frozen_when_serving: list[int] = []
    pauses: list[float] = []

    def serve_until_signal(stop, run) -> None:  # instead of serving: what serving would start from
        frozen_when_serving.append(gc.get_freeze_count())
        pauses.append(run.__self__.settings.first_token_pause)

    monkeypatch.setattr(cli, "_run_until_signal", serve_until_signal)
    flags = ["--redis-url", redis_server.url, "--prefix", prefix, "--dtype", "float32"]
    flags += ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 2**20)]
    args = cli.build_parser().parse_args(["serve", *flags])
    assert gc.get_freeze_count() == 0
    try:
        cli.serve(args)
    finally:
        gc.unfreeze()  # this test process goes on building and dropping engines
    assert frozen_when_serving and frozen_when_serving[0] > 0
    # A CPU engine gives way after a first token where its threads take every CPU (test_first_token_pause).
    assert pauses == [first_token_pause_for(torch.get_num_threads(), cli._usable_cpus())]
