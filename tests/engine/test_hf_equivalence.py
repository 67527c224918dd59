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
        {"block_size": 8, "enable_prefix_caching": False},
        # Long prompts prefill in chunks of at most 64 tokens, mixed with other sequences' decodes.
        {"block_size": 32, "max_num_batched_tokens": 64},
    ],
    ids=["block8-no-prefix-cache", "block32-chunked-prefill"],
)
def test_engine_variants_match_transformers(kwargs, hf_greedy):
    llm = LLM(dtype="float32", **kwargs)
    _check_against_hf(llm, hf_greedy)


BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, 3 KV heads of 64, fp32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False},
        {"swap_space": 40 * BLOCK_BYTES / 2**30},
    ],
    ids=["recompute-prefix-cache", "recompute-no-prefix-cache", "swap"],
)
def test_preemption_keeps_outputs_identical(kwargs, hf_greedy):
    # 24 blocks of 16 tokens cannot hold 16 running sequences of up to ~100 tokens: preemption must happen.
    llm = LLM(dtype="float32", kv_cache_memory_bytes=24 * BLOCK_BYTES, **kwargs)
    assert llm.engine.block_manager.num_blocks == 24
    swapped = []
    step = llm.engine.step

    def observed_step():
        outputs = step()
        swapped.append(len(llm.engine.scheduler.swapped))
        return outputs

    llm.engine.step = observed_step
    _check_against_hf(llm, hf_greedy)
    assert llm.engine.scheduler.num_preemptions > 0
    assert (max(swapped) > 0) == ("swap_space" in kwargs)
    assert len(llm.engine.block_manager.free_cpu) == llm.engine.block_manager.num_cpu_blocks
