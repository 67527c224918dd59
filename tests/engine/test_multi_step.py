"""Multi-step scheduling (`num_scheduler_steps`): a burst of decode steps in one native call gives the
tokens, texts and finish reasons of single steps, greedy and seeded sampled sequences alike, whether a
sequence stops within a burst (EOS, a stop string, max_tokens, the context's end) or not, and gives back
every KV block; requests a burst cannot serve (logprobs, penalties) decode step by step."""

from __future__ import annotations

import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.errors import InvalidRequestError

from .conftest import PROMPTS, assert_all_blocks_free, greedy

MAX_MODEL_LEN = 96


def _pair(quantization: str) -> tuple[LLM, LLM]:
    options = dict(dtype="bfloat16", kv_cache_memory_bytes=1 << 27, max_model_len=MAX_MODEL_LEN)
    return (
        LLM(quantization=quantization, num_scheduler_steps=8, **options),
        LLM(quantization=quantization, **options),
    )


def _counted_bursts(llm: LLM) -> list[int]:
    """Records the number of steps of each burst the engine runs from now on."""
    runner, steps = llm.llm_engine.runner, []
    execute_burst = runner.execute_burst

    def counted(sched, sampling):
        tokens = execute_burst(sched, sampling)
        steps.append(len(tokens[0]))
        return tokens

    runner.execute_burst = counted
    return steps


def _params() -> list[SamplingParams]:
    """A mix that ends sequences at every point of a burst: max_tokens not a multiple of it, EOS (the chat
    turn answers in a few tokens), a stop string, the context's end."""
    params = [greedy(max_tokens) for max_tokens in (40, 13, 21, 6)] * 4
    params[11] = greedy(40, stop=[","])  # "1, 1, 2, 3, 5, 8, 13," goes on with a number and a comma
    params[15] = greedy(None)  # the longest prompt (64 tokens), on to the end of the context
    # Seeded samples, which draw from generators of their own (unseeded ones share the engine's, whose draws
    # a sequence that ends within a burst shifts for the others).
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=30)
    params[2] = SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=2, max_tokens=23, ignore_eos=True)
    return params


@pytest.mark.parametrize("quantization", ["none", "gguf"], ids=["bf16", "q4_1"])
def test_bursts_give_the_tokens_of_single_steps(quantization):
    bursty, plain = _pair(quantization)
    assert bursty.llm_engine.runner.burst_rows >= len(PROMPTS)
    steps = _counted_bursts(bursty)
    expected = plain.generate(PROMPTS, _params(), use_tqdm=False)
    got = bursty.generate(PROMPTS, _params(), use_tqdm=False)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, a.prompt
        assert b.outputs[0].text == a.outputs[0].text
        assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (
            a.outputs[0].finish_reason,
            a.outputs[0].stop_reason,
        )
    ends = [(o.outputs[0].finish_reason, o.outputs[0].stop_reason, len(o.outputs[0].token_ids)) for o in got]
    assert ends[11][:2] == ("stop", ",") and 1 < ends[11][2] < 9  # the stop string, within the first burst
    assert any(reason == "stop" and stop is None and count > 1 for reason, stop, count in ends)  # EOS
    assert max(steps) == 8 and min(steps) < 8  # full bursts, and bursts cut short near a sequence's end
    assert len(expected[15].prompt_token_ids) + len(expected[15].outputs[0].token_ids) == MAX_MODEL_LEN
    assert_all_blocks_free(bursty)
    assert_all_blocks_free(plain)


def test_requests_a_burst_cannot_serve_decode_step_by_step():
    bursty = LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 27, num_scheduler_steps=8)
    steps = _counted_bursts(bursty)
    penalised = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, presence_penalty=0.5)
    with_logprobs = greedy(24, logprobs=1, ignore_eos=True)
    for other in (penalised, with_logprobs):
        bursty.generate(PROMPTS[:2], [greedy(24, ignore_eos=True), other], use_tqdm=False)
        assert steps == []  # a greedy sequence beside it decodes step by step too
    bursty.generate(PROMPTS[:2], greedy(24, ignore_eos=True), use_tqdm=False)
    assert steps  # alone, the greedy ones burst
    assert_all_blocks_free(bursty)


@pytest.mark.parametrize("steps", [0, 65])
def test_bad_step_counts_are_refused(steps):
    with pytest.raises(InvalidRequestError, match="num_scheduler_steps"):
        LLM(num_scheduler_steps=steps)
