"""The engine's stats count the time a mixture-of-experts model spends in its fused expert kernel
(`moe_seconds_total`) beside its step time (`step_seconds_total`), and its stats line logs the share."""

from __future__ import annotations

import logging
import re

from inference_engine import LLM, SamplingParams

from . import moe_families


def test_moe_share_of_step_time_is_counted_and_logged(caplog):
    llm = LLM(model=str(moe_families.folder("qwen3moe")), dtype="float32", log_stats_interval=1e-9)
    assert llm.engine.stats()["moe_seconds_total"] == llm.engine.stats()["step_seconds_total"] == 0.0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="inference_engine.llm_engine"):
        llm.generate(["The capital of France is", "1, 1, 2, 3, 5,"], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert 0 < stats["moe_seconds_total"] < stats["step_seconds_total"]
    shares = [int(m[1]) for r in caplog.records if (m := re.search(r" moe=(\d+)%", r.getMessage()))]
    assert shares and all(0 <= share <= 100 for share in shares), shares


def test_dense_model_reports_no_moe_time():
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)
    llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    stats = llm.engine.stats()
    assert "moe_seconds_total" not in stats and stats["step_seconds_total"] > 0
