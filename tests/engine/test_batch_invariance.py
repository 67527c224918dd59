"""Batch invariance: a request's greedy tokens do not depend on what else shares its steps (issue 61).

Each prompt's tokens from a call of its own (prefix cache emptied first) are the reference; the same prompts
then run in one `generate` call, from one thread each, behind long prompts that are prefilled in chunks while
they decode, and again with their prefixes in the prefix cache (so only each prompt's last partial block is
computed, in a small step). The bundled Q4_1 file and its bf16 dequantization (`quantization="none"`) both
run. The default run takes a few prompts and tokens; `-m slow` the acceptance check's 16 prompts x 32 tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference_engine import LLM, SamplingParams

from .conftest import PROMPTS, assert_all_blocks_free

BUDGET = 256  # tokens a step: a long prompt is prefilled in chunks beside the short prompts' decode steps
QUICK = dict(prompts=[PROMPTS[i] for i in (0, 3, 14)], tokens=10, long_prompts=1, long_words=300)
FULL = dict(prompts=PROMPTS, tokens=32, long_prompts=2, long_words=750)


@pytest.fixture(scope="module", params=["q4_1", "bf16"])
def llm(request) -> Iterator[LLM]:
    options = {"quantization": "none"} if request.param == "bf16" else {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMSERVE_BATCH_INVARIANT", "1")  # the default only where the CPU has AMX
        yield LLM(dtype="bfloat16", seed=0, max_num_batched_tokens=BUDGET, log_stats_interval=0, **options)


def _long_prompts(count: int, words: int) -> list[str]:
    """`count` prompts of `words` words (about 4 tokens each), unlike each other and the short ones."""
    return [" ".join(f"item{(i * 7 + j) % 997}" for i in range(words)) for j in range(1, count + 1)]


def _tokens(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _check(llm: LLM, prompts: list[str], tokens: int, long_prompts: int, long_words: int) -> None:
    alone = {}
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        alone[prompt] = _tokens(llm, [prompt], tokens)[0]
    differ: dict[str, list[int]] = {}

    def compare(case: str, got: list[list[int]]) -> None:
        differ[case] = [i for i, (p, t) in enumerate(zip(prompts, got, strict=True)) if alone[p] != t]

    assert llm.reset_prefix_cache()
    compare("one batch", _tokens(llm, prompts, tokens))
    # The batch left every prompt's whole blocks in the prefix cache: each now recomputes only its tail.
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    again = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert any(out.num_cached_tokens for out in again)
    compare("prefix cached", [out.outputs[0].token_ids for out in again])

    assert llm.reset_prefix_cache()
    with ThreadPoolExecutor(len(prompts)) as pool:
        compare("threads", list(pool.map(lambda p: _tokens(llm, [p], tokens)[0], prompts)))

    assert llm.reset_prefix_cache()
    long = _long_prompts(long_prompts, long_words)
    assert all(len(ids) > BUDGET for ids in map(llm.get_tokenizer().encode, long))
    compare("behind chunked long prompts", _tokens(llm, long + prompts, tokens)[len(long) :])
    assert_all_blocks_free(llm)
    assert not any(differ.values()), f"prompts (by index) whose tokens differ from their lone run's: {differ}"


def test_greedy_tokens_do_not_depend_on_the_batch(llm: LLM) -> None:
    _check(llm, **QUICK)


@pytest.mark.slow
def test_greedy_tokens_do_not_depend_on_the_batch_16_prompts(llm: LLM) -> None:
    _check(llm, **FULL)
