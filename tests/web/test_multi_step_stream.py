"""Multi-step scheduling through the whole stack: `serve --num-scheduler-steps` streams a sampled completion
(as the chat page asks for them: temperature 0.7, here with a seed) in bursts of tokens, with the text of
decoding step by step."""

from __future__ import annotations

import openai
import pytest

from inference_engine import LLM, SamplingParams
from tests.web.stack import Stack, engine_flags

pytestmark = pytest.mark.timeout(300)

PROMPT = "Once upon a time, in a small village by the sea,"
TOKENS = 32


def test_a_sampled_completion_streams_in_bursts_with_the_text_of_single_steps() -> None:
    flags = ["bfloat16" if flag == "float32" else flag for flag in engine_flags(threads=2)]
    stack = Stack(engine_flags=[*flags, "--num-scheduler-steps", "8"]).start()
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
        stream = client.completions.create(
            model=stack.model,
            prompt=PROMPT,
            max_tokens=TOKENS,
            temperature=0.7,
            seed=11,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    finally:
        stack.stop()
    single_steps = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=1 << 27)
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=TOKENS, ignore_eos=True)
    assert "".join(pieces) == single_steps.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    # The prompt's step gives the first token, then bursts of up to 8: a handful of chunks, not one a token.
    assert len(pieces) <= 2 + TOKENS // 8
