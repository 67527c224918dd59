"""Greedy generation through the paged, continuously batched engine equals transformers' token for token."""

from __future__ import annotations

import pytest

from inference_engine import LLM

from .conftest import PROMPTS, assert_all_blocks_free, greedy


def _check_against_hf(llm: LLM, hf_greedy) -> None:
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    mismatches = []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = hf_greedy[tuple(out.prompt_token_ids)]
        if out.outputs[0].token_ids != expected:
            mismatches.append((prompt[:40], out.outputs[0].token_ids, expected))
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


def test_default_engine_matches_transformers(llm, hf_greedy):
    _check_against_hf(llm, hf_greedy)
    # Second pass: the shared prefix and every earlier prompt now come from the prefix cache.
    hits = llm.engine.block_manager.num_cache_hits
    _check_against_hf(llm, hf_greedy)
    assert llm.engine.block_manager.num_cache_hits > hits


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_prefix_caching": False},
        {"block_size": 8},
        {"block_size": 32},
        {"max_num_batched_tokens": 64},  # long prompts prefill in chunks, mixed with decodes
    ],
    ids=["no-prefix-cache", "block8", "block32", "chunked-prefill"],
)
def test_engine_variants_match_transformers(kwargs, hf_greedy):
    llm = LLM(dtype="float32", **kwargs)
    _check_against_hf(llm, hf_greedy)


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_preemption_keeps_outputs_identical(enable_prefix_caching, hf_greedy):
    # 24 blocks of 16 tokens cannot hold 16 running sequences of up to ~100 tokens: preemption must happen.
    llm = LLM(dtype="float32", enable_prefix_caching=enable_prefix_caching, kv_cache_memory_bytes=24 * 737280)
    assert llm.engine.block_manager.num_blocks == 24
    _check_against_hf(llm, hf_greedy)
    assert llm.engine.scheduler.num_preemptions > 0
