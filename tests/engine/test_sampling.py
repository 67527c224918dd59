"""Each sampling parameter has its documented effect on the bundled model (fp32, shared engine)."""

from __future__ import annotations

import pytest

from inference_engine import LLM, SamplingParams

from .conftest import PROMPTS, assert_all_blocks_free, greedy

PROMPT = "Write a short poem about the sea:"
CHAT = PROMPTS[12]  # a chat turn that the model answers briefly and ends with its EOS token


def text_of(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_temperature_sampling_varies_and_greedy_does_not(clean_llm):
    sampled = {
        text_of(clean_llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=12)).text for _ in range(4)
    }
    greedy_texts = {text_of(clean_llm, PROMPT, greedy(12)).text for _ in range(2)}
    assert len(sampled) > 1
    assert len(greedy_texts) == 1


def test_a_long_greedy_request_run_again_gives_the_same_tokens():
    """As the README promises of repeats: without the prefix cache, a prompt long enough to prefill in a step
    of many rows (other kernels than a decode step's) gives the bundled model's default engine the same greedy
    tokens every time, whatever order its threads finish in."""
    llm = LLM(enable_prefix_caching=False, max_model_len=1024)
    prompt = "The quarterly report of the steel plant in Leeds, in figures. " * 24 + "Summary:"
    runs = [text_of(llm, prompt, greedy(24)).token_ids for _ in range(3)]
    assert len(llm.get_tokenizer().encode(prompt)) > 200
    assert runs[0] == runs[1] == runs[2]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "params", [{"top_k": 1}, {"top_p": 1e-3}, {"min_p": 1.0}], ids=["top_k=1", "top_p~0", "min_p=1"]
)
def test_truncation_to_the_top_token_equals_greedy(clean_llm, params):
    expected = text_of(clean_llm, PROMPT, greedy(12)).token_ids
    got = text_of(clean_llm, PROMPT, SamplingParams(temperature=1.5, max_tokens=12, **params)).token_ids
    assert got == expected


def test_top_k_and_top_p_limit_the_choices(clean_llm):
    wide = {
        text_of(clean_llm, PROMPT, SamplingParams(temperature=2.0, max_tokens=1, seed=s)).token_ids[0]
        for s in range(12)
    }
    narrow = {
        text_of(clean_llm, PROMPT, SamplingParams(temperature=2.0, max_tokens=1, seed=s, top_k=2)).token_ids[
            0
        ]
        for s in range(12)
    }
    assert len(narrow) <= 2 < len(wide)


def test_seed_reproduces_alone_and_inside_a_batch(clean_llm):
    params = SamplingParams(temperature=0.9, max_tokens=16, seed=1234)
    alone = text_of(clean_llm, PROMPT, params)
    batch = clean_llm.generate(
        [PROMPTS[0], PROMPT, PROMPTS[6], PROMPTS[9]],
        [
            SamplingParams(temperature=1.0, max_tokens=20),
            params,
            greedy(),
            SamplingParams(temperature=0.7, seed=7),
        ],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.token_ids
    other_seed = text_of(clean_llm, PROMPT, SamplingParams(temperature=0.9, max_tokens=16, seed=4321))
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8}],
    ids=["frequency", "presence", "repetition"],
)
def test_penalties_reduce_repetition(clean_llm, penalty):
    prompt = "na na na na na na na na na na na na"
    plain = text_of(clean_llm, prompt, greedy(24)).token_ids
    penalised = text_of(clean_llm, prompt, greedy(24, **penalty)).token_ids
    assert len(set(penalised)) > len(set(plain))


def test_logit_bias_forces_and_forbids_tokens(clean_llm):
    forced = clean_llm.get_tokenizer().encode(" banana")[0]
    assert text_of(clean_llm, PROMPT, greedy(5, logit_bias={forced: 100})).token_ids == [forced] * 5
    first = text_of(clean_llm, PROMPT, greedy(1)).token_ids[0]
    assert text_of(clean_llm, PROMPT, greedy(1, logit_bias={first: -100})).token_ids[0] != first


def test_max_tokens_ends_with_length(clean_llm):
    out = text_of(clean_llm, PROMPT, greedy(7))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_ignore_eos_and_min_tokens(clean_llm):
    eos = clean_llm.get_tokenizer().eos_token_ids
    natural = text_of(clean_llm, CHAT, greedy(64))
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in eos
    n = len(natural.token_ids)
    ignoring = text_of(clean_llm, CHAT, greedy(n + 6, ignore_eos=True))
    assert len(ignoring.token_ids) == n + 6 and ignoring.finish_reason == "length"
    longer = text_of(clean_llm, CHAT, greedy(64, min_tokens=n + 3))
    assert len(longer.token_ids) >= n + 3
    assert not set(longer.token_ids[: n + 2]) & set(eos)


def test_stop_strings_end_the_text_and_never_leak(clean_llm):
    full = text_of(clean_llm, PROMPTS[8], greedy(32))
    stop = full.text[10:14]
    cut = full.text.index(stop)
    out = text_of(clean_llm, PROMPTS[8], greedy(32, stop=[stop, "never-appears"]))
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = text_of(clean_llm, PROMPTS[8], greedy(32, stop=stop, include_stop_str_in_output=True))
    assert kept.text == full.text[: cut + len(stop)]


def test_stop_token_ids(clean_llm):
    full = text_of(clean_llm, PROMPT, greedy(16)).token_ids
    stop_token = full[3]
    out = text_of(clean_llm, PROMPT, greedy(16, stop_token_ids=[stop_token]))
    first = full.index(stop_token)
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_logprobs_of_generated_and_prompt_tokens(clean_llm):
    result = clean_llm.generate([PROMPT], greedy(6, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    out = result.outputs[0]
    assert len(out.logprobs) == 6
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert position[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(position) <= 4 and all(lp.logprob <= 0 for lp in position.values())
        assert sorted(lp.rank for lp in position.values())[:3] == [1, 2, 3]
        assert position[token].decoded_token is not None
    assert out.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs, strict=True))
    )
    prompt_lps = result.prompt_logprobs
    assert len(prompt_lps) == len(result.prompt_token_ids) and prompt_lps[0] is None
    for token, position in zip(result.prompt_token_ids[1:], prompt_lps[1:], strict=True):
        assert token in position and position[token].rank >= 1


def test_parallel_samples_share_the_prompt_blocks(clean_llm):
    engine = clean_llm.engine
    long_prompt = PROMPTS[15]

    def peak_blocks(requests):
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        peak, outputs = 0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
            peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
        return peak, outputs

    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    # Prompts differ from their first token, so the prefix cache cannot share anything between them.
    independent, _ = peak_blocks([(f"solo{i}", f"{i}: {long_prompt}", params) for i in range(4)])
    fork_params = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True)
    shared, outputs = peak_blocks([("fork", f"9: {long_prompt}", fork_params)])
    samples = outputs["fork"].outputs
    assert [s.index for s in samples] == [0, 1, 2, 3] and all(len(s.token_ids) == 8 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert shared < independent
