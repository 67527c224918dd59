"""The engine on the Triton attention backend (the CUDA path), run on the CPU by Triton's interpreter."""

from __future__ import annotations

import os

import pytest

from inference_engine import LLM

from .conftest import PROMPTS, assert_all_blocks_free, greedy

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 exported before Python starts"
)


def test_triton_backend_matches_transformers(hf_greedy):
    llm = LLM(dtype="float32", attention_backend="triton", block_size=8)
    prompts = [PROMPTS[0], PROMPTS[7], PROMPTS[8]]  # English, Chinese, code
    # Run the same prompt twice so the second request extends a cached prefix through the extend kernel.
    # Two tokens: one decode step, 30 layers of the decode kernel under the interpreter (slow).
    outputs = llm.generate(prompts + prompts[:1], greedy(max_tokens=2), use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy[tuple(out.prompt_token_ids)][:2]
    assert_all_blocks_free(llm)
