"""Request lifecycle: validation errors that cost nothing, aborts that free blocks, duplicate ids."""

from __future__ import annotations

import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.errors import InvalidRequestError

from .conftest import PROMPTS, assert_all_blocks_free, greedy


def test_abort_frees_blocks_at_once_and_others_finish(clean_llm):
    engine = clean_llm.engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"a{i}", prompt, greedy(20))
    engine.step()
    engine.step()
    used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    engine.abort_request(["a1", "a2", "unknown"])
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks < used
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"a0", "a3"}


def test_abort_of_a_waiting_request(clean_llm):
    engine = clean_llm.engine
    engine.add_request("w", PROMPTS[0], greedy())
    engine.abort_request("w")
    assert engine.step() == []


def test_too_long_prompt_is_rejected_without_side_effects(clean_llm):
    engine = clean_llm.engine
    too_long = "hello " * (engine.max_model_len + 10)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", too_long, greedy())
    prompt = "hello " * (engine.max_model_len - 100)
    with pytest.raises(InvalidRequestError, match="in the completion"):
        engine.add_request("long2", prompt, greedy(max_tokens=500))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", "", greedy())
    assert not engine.has_unfinished_requests()
    # The engine serves normally afterwards, and the rejected id can be reused.
    out = clean_llm.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_duplicate_request_id_is_rejected(clean_llm):
    engine = clean_llm.engine
    engine.add_request("dup", PROMPTS[0], greedy(2))
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_request("dup", PROMPTS[1], greedy(2))
    while engine.has_unfinished_requests():
        engine.step()


def test_request_larger_than_the_whole_cache_is_rejected():
    llm = LLM(dtype="float32", kv_cache_memory_bytes=4 * 737280, block_size=16)  # 4 blocks = 64 tokens
    with pytest.raises(InvalidRequestError, match="whole cache"):
        llm.generate(["hello " * 40], greedy(max_tokens=32), use_tqdm=False)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -5},
        {"n": 0},
        {"max_tokens": 0},
        {"stop": [""]},
        {"min_tokens": 5, "max_tokens": 2},
        {"logprobs": 50},
        {"logit_bias": {1: 500}},
    ],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_sampling_params_round_trip_and_reject_unknown_keys():
    params = SamplingParams(n=2, stop="x", logit_bias={5: 1.5}, seed=3)
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(InvalidRequestError, match="unknown"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_urgent_request_preempts_bulk_work_and_outputs_stay_identical(hf_greedy):
    llm = LLM(dtype="float32", max_num_seqs=2)
    engine = llm.engine
    engine.add_request("bulk0", PROMPTS[0], greedy(), priority=10)
    engine.add_request("bulk1", PROMPTS[2], greedy(), priority=10)
    for _ in range(3):
        engine.step()
    engine.add_request("chat", PROMPTS[13], greedy(), priority=0)
    first = engine.step()
    # Admitted (and prefilled) at once, in a step of its own: the bulk sequence still running waits a step.
    assert [o.request_id for o in first] == ["chat"]
    assert engine.scheduler.num_preemptions == 1
    second = engine.step()
    assert sorted(o.request_id for o in second) == ["bulk0", "chat"]
    outputs = {o.request_id: o for o in first + second}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    for rid, prompt in (("bulk0", PROMPTS[0]), ("bulk1", PROMPTS[2]), ("chat", PROMPTS[13])):
        out = outputs[rid]
        assert out.finished and out.outputs[0].token_ids == hf_greedy[tuple(out.prompt_token_ids)], prompt
    assert_all_blocks_free(llm)


def test_low_priority_prompts_prefill_in_small_chunks_while_interactive_requests_arrive(hf_greedy):
    """Without interactive traffic a bulk prompt prefills in one step; after an interactive request arrives,
    a bulk prompt prefills at most max(block, sequences decoding) tokens a step, so steps stay short."""
    llm = LLM(dtype="float32", max_num_seqs=4)
    engine = llm.engine
    computed = {}

    def step() -> None:
        for out in engine.step():
            outputs[out.request_id] = out
        for seq in engine.scheduler.running:
            computed[seq.group.request_id] = seq.num_computed_tokens

    outputs = {}
    engine.add_request("bulk0", PROMPTS[15], greedy(), priority=10)
    step()
    prompt_len = {
        rid: len(engine.tokenizer.encode(p)) for rid, p in (("bulk0", PROMPTS[15]), ("bulk1", PROMPTS[9]))
    }
    assert computed["bulk0"] == prompt_len["bulk0"]  # the whole prompt at once
    engine.add_request("chat", PROMPTS[1], greedy(), priority=0)
    step()
    engine.add_request("bulk1", PROMPTS[9], greedy(), priority=10)
    step()
    block = engine.block_manager.block_size
    assert prompt_len["bulk1"] > block and computed["bulk1"] == block  # two sequences decode: one block
    step()
    assert computed["bulk1"] == min(2 * block, prompt_len["bulk1"])
    while engine.has_unfinished_requests():
        step()
    for rid, prompt in (("bulk0", PROMPTS[15]), ("chat", PROMPTS[1]), ("bulk1", PROMPTS[9])):
        out = outputs[rid]
        assert out.finished and out.outputs[0].token_ids == hf_greedy[tuple(out.prompt_token_ids)], prompt
    assert_all_blocks_free(llm)
