"""A mixture-of-experts model through the whole stack: `serve --model` on the tiny Qwen2-MoE checkpoint
(shared expert, a dense layer; `tests/engine/moe_families.py`), the bus and the OpenAI API give transformers'
fp32 greedy tokens, as the offline engine does in `tests/engine/test_moe.py`; /metrics shows the time its
experts took as part of the engine's step time."""

from __future__ import annotations

import re
import time
import urllib.request

import openai
import pytest

from tests.engine import moe_families
from tests.engine.families import compare
from tests.web.stack import Stack, engine_flags

pytestmark = pytest.mark.timeout(300)

FAMILY = "qwen2moe"
MAX_TOKENS = 24
TEXTS = ["The capital of France is", "def quicksort(arr):\n    "]


def test_moe_model_served_through_the_api_gives_transformers_tokens() -> None:
    from transformers import AutoTokenizer

    folder = moe_families.folder(FAMILY)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    references = moe_families.hf_greedy(FAMILY, prompts, MAX_TOKENS)
    stack = Stack(model="tiny-moe", engine_flags=[*engine_flags(), "--model", str(folder)]).start()
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
        reply = client.completions.create(
            model=stack.model,
            prompt=prompts,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        metrics = _metrics_after(stack, generated=len(prompts) * MAX_TOKENS)
    finally:
        stack.stop()
    choices = sorted(reply.choices, key=lambda c: c.index)
    served = [[int(re.fullmatch(r"token_id:(\d+)", t)[1]) for t in c.logprobs.tokens] for c in choices]
    assert [len(tokens) for tokens in served] == [MAX_TOKENS] * len(prompts)
    mismatches, ties = compare(served, references)
    print(f"{FAMILY} through the stack: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    moe, step = metrics["llmserve_moe_seconds_total"], metrics["llmserve_step_seconds_total"]
    print(f"experts: {moe:.3f} s of {step:.3f} s of steps ({100 * moe / step:.0f}%)")
    assert 0 < moe < step, metrics


def _metrics_after(stack: Stack, generated: int) -> dict[str, float]:
    """The model's /metrics samples once a heartbeat has reported `generated` tokens."""
    for _ in range(50):
        with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        pattern = rf'^(llmserve_\w+)\{{model_name="{stack.model}"\}} (\S+)$'
        values = {m[1]: float(m[2]) for line in lines if (m := re.match(pattern, line))}
        if values.get("llmserve_generation_tokens_total", 0) >= generated:
            return values
        time.sleep(0.2)
    raise AssertionError(f"no heartbeat reported {generated} tokens: {values}")
