"""N-gram speculative decoding: greedy outputs identical to decoding without it, the K/V of rejected
draft tokens rolled back (even when every proposal is wrong), every KV block freed."""

from __future__ import annotations

import json
import logging
import random

import pytest

from inference_engine import LLM, SamplingParams, speculative
from inference_engine.bus.protocol import ModelInfo, ReplicaInfo
from inference_engine.errors import InvalidRequestError
from inference_engine.speculative import NgramConfig, fit_to_rows, ngram_proposal
from llmserve import metrics
from llmserve_kernels.cpu.linear import SAME_BITS_ROWS, cheap_bf16_rows, cheap_quant_rows

from .conftest import PROMPTS, assert_all_blocks_free, greedy

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,  # speculation at any batch size, so every test prompt runs through it
}
QUOTING = [
    "Minutes: the board approved the budget of 2.4 million euros and the hiring of two engineers. "
    "Question: what did the board approve? Answer: the board approved the budget of",
    "def area(radius):\n    return 3.14159 * radius * radius\n\ndef circumference(radius):\n    return",
]


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    # No periodic stats line: it would log (and so reset) the speculation counters a test reads in between.
    return LLM(dtype="float32", seed=0, speculative_config=NGRAM, log_stats_interval=0)


def test_proposals_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 7, 3, 4, 5, 6, 7]
    assert ngram_proposal(tokens, 2, 1, 3) == [3, 4]  # "5 6 7" last seen before "3 4"
    assert ngram_proposal(tokens, 9, 1, 3) == [3, 4, 5, 6, 7]  # as many as there are
    assert ngram_proposal([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_proposal([8, 1, 8], 3, 2, 3) == []  # only a 1-gram matches, below the minimum


def by_windows(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, window by window: the longest suffix first, its latest earlier occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_proposals_match_the_window_by_window_definition(seed):
    rng = random.Random(seed)
    for _ in range(300):
        tokens = rng.choices(range(rng.randint(2, 6)), k=rng.randint(1, 60))  # few ids: many repeats
        k, n_min = rng.randint(1, 6), rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        assert ngram_proposal(tokens, k, n_min, n_max) == by_windows(tokens, k, n_min, n_max), tokens


def test_a_short_match_proposes_one_token():
    """Below `confident` matching tokens, only the token right after the match: a common pair predicts
    the next token far more often than the ones after it."""
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 7, 3, 4, 5, 6, 7]
    assert ngram_proposal(tokens, 4, 1, 3, confident=3) == [3, 4, 5, 6]  # "5 6 7": three tokens
    assert ngram_proposal(tokens, 4, 1, 2, confident=3) == [3]  # "6 7": two
    assert ngram_proposal([4, 8, 1, 2, 8], 4, 1, 3, confident=3) == [1]  # "8": one
    assert ngram_proposal([4, 8, 1, 2, 8], 4, 1, 3) == [1, 2, 8]  # no minimum: as many as follow


def test_only_a_cpu_shortens_proposals():
    """Verifying rows costs a CPU step a share of its time per row; on a GPU they are nearly free."""
    config = NgramConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert speculative.NgramProposer(config, 100).confident_match == speculative.CPU_CONFIDENT_MATCH
    assert speculative.NgramProposer(config, 100, "cuda").confident_match == 0


def test_greedy_outputs_equal_decoding_without_speculation(llm, spec_llm):
    prompts = PROMPTS + QUOTING
    plain = llm.generate(prompts, greedy(), use_tqdm=False)
    fast = spec_llm.generate(prompts, greedy(), use_tqdm=False)
    for a, b in zip(plain, fast, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, a.prompt
        assert b.outputs[0].text == a.outputs[0].text
    proposer = spec_llm.llm_engine.proposer
    assert proposer.num_accepted_tokens > 0 and proposer.num_draft_tokens > proposer.num_accepted_tokens
    assert_all_blocks_free(spec_llm)


def test_all_rejected_proposals_leave_no_trace(llm, spec_llm, monkeypatch):
    """Proposals of a token the model never picks here: every step rejects all of them, so each step's
    draft K/V must be overwritten later and the blocks taken for it given back."""
    monkeypatch.setattr(speculative, "ngram_proposal", lambda tokens, k, *limits: [0] * k)
    plain = llm.generate(PROMPTS[:6], greedy(), use_tqdm=False)
    engine = spec_llm.llm_engine
    trims = []
    trim = engine.block_manager.trim

    def observed_trim(seq, num_tokens):
        before = len(seq.block_table)
        trim(seq, num_tokens)
        trims.append(before - len(seq.block_table))

    monkeypatch.setattr(engine.block_manager, "trim", observed_trim)
    accepted = engine.proposer.num_accepted_tokens
    fast = spec_llm.generate(PROMPTS[:6], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert engine.proposer.num_accepted_tokens == accepted  # nothing accepted
    assert sum(trims) > 0  # blocks taken for drafts went back
    assert_all_blocks_free(spec_llm)


def test_sampled_requests_are_reproducible_with_a_seed(spec_llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24)
    first = spec_llm.generate(QUOTING, params, use_tqdm=False)
    again = spec_llm.generate(QUOTING, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert all(len(o.outputs[0].token_ids) <= 24 for o in first)
    assert_all_blocks_free(spec_llm)


def test_no_proposals_above_the_batch_limit(spec_llm, monkeypatch):
    monkeypatch.setattr(spec_llm.llm_engine.proposer.config, "disable_by_batch_size", 2)
    drafted = spec_llm.llm_engine.proposer.num_draft_tokens
    spec_llm.generate(PROMPTS[:4], greedy(8, ignore_eos=True), use_tqdm=False)
    # four sequences run together until the last steps, where fewer than three are left
    assert spec_llm.llm_engine.proposer.num_draft_tokens - drafted < 4 * 8


def test_a_limit_of_zero_proposes_nothing(spec_llm, monkeypatch):
    """The default for quantized weights where extra rows cost the kernel as much as the first."""
    proposer = spec_llm.llm_engine.proposer
    drafted = proposer.num_draft_tokens
    spec_llm.generate(QUOTING[:1], greedy(8, ignore_eos=True), use_tqdm=False)
    assert proposer.num_draft_tokens > drafted  # this prompt draws proposals
    monkeypatch.setattr(proposer.config, "disable_by_batch_size", 0)
    drafted = proposer.num_draft_tokens
    spec_llm.generate(QUOTING[:1], greedy(8, ignore_eos=True), use_tqdm=False)
    assert proposer.num_draft_tokens == drafted
    assert_all_blocks_free(spec_llm)


def test_counters_follow_each_verification():
    """vLLM's counters: a verification of proposals is one draft; position i counts the drafts whose i-th
    token was accepted."""
    proposer = speculative.NgramProposer(NgramConfig.from_dict(NGRAM), 100)
    for proposed, accepted in ((4, 2), (3, 3), (2, 0)):
        proposer.record(proposed, accepted)
    assert proposer.stats() == {
        "spec_decode_num_drafts": 3,
        "spec_decode_num_draft_tokens": 9,
        "spec_decode_num_accepted_tokens": 5,
        "spec_decode_num_accepted_tokens_per_pos": [2, 2, 1, 0],
    }


def test_speculation_counters_reach_the_log_and_the_metrics(spec_llm, caplog):
    engine = spec_llm.llm_engine
    engine._log_speculation()  # the log then covers the requests below only
    before = engine.stats()
    spec_llm.generate(QUOTING, greedy(16, ignore_eos=True), use_tqdm=False)
    stats = json.loads(json.dumps(engine.stats()))  # as a heartbeat carries them to the web processes
    drafts, proposed, accepted = (
        stats[f"spec_decode_num_{key}"] - before[f"spec_decode_num_{key}"]
        for key in ("drafts", "draft_tokens", "accepted_tokens")
    )
    assert drafts > 0 and accepted > 0
    per_position = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == NGRAM["num_speculative_tokens"]
    assert sum(per_position) == stats["spec_decode_num_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # a token counts only after the ones before it
    assert per_position[0] <= stats["spec_decode_num_drafts"]

    with caplog.at_level(logging.INFO, logger="inference_engine.llm_engine"):
        engine._log_speculation()
        engine._log_speculation()  # nothing verified since: no line
    assert [r.getMessage() for r in caplog.records] == [
        f"speculative decoding: mean acceptance length={1 + accepted / drafts:.2f} "
        f"acceptance rate={100 * accepted / proposed:.1f}% drafts={drafts}"
    ]

    # Two replicas of one model, the second proposing two tokens at most: summed, position by position.
    other = {**stats, "spec_decode_num_accepted_tokens_per_pos": [5, 1]}
    plain = {key: value for key, value in stats.items() if not key.startswith("spec_decode")}
    replicas = [ReplicaInfo("a", "m", {"stats": stats}), ReplicaInfo("b", "m", {"stats": other})]
    models = [ModelInfo("m", replicas), ModelInfo("plain", [ReplicaInfo("c", "plain", {"stats": plain})])]
    text = metrics.render(models).decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    for prefix in ("llmserve_", "vllm:"):
        drafts_total = float(samples[prefix + 'spec_decode_num_drafts_total{model_name="m"}'])
        assert drafts_total == 2 * stats["spec_decode_num_drafts"]
        per_pos = prefix + 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"}'
        assert float(samples[per_pos % 0]) == per_position[0] + 5
        assert float(samples[per_pos % 1]) == per_position[1] + 1
        assert float(samples[per_pos % 3]) == per_position[3]
        assert per_pos % 4 not in samples
    plain_samples = [name for name in samples if 'model_name="plain"' in name]
    assert plain_samples and not any("spec_decode" in name for name in plain_samples)


def quantized_cpu_limit() -> int:
    """The default limit for quantized weights on this CPU: none proposed where extra rows cost the quantized
    kernel about what the first does (AVX2)."""
    return speculative.CPU_QUANTIZED_BATCH_LIMIT if cheap_quant_rows() else 0


def bf16_cpu_limit() -> int:
    """The default limit for bf16 weights on this CPU: higher where AMX takes every bf16 step."""
    return speculative.CPU_AMX_BATCH_LIMIT if cheap_bf16_rows() else speculative.CPU_BATCH_LIMIT


def test_the_batch_limit_defaults_by_device():
    """Unset, speculation stops above a few sequences on a CPU (more for bf16 weights where AMX takes every
    step, fewer for quantized weights, or all of them where the quantized kernel lacks AVX512-VNNI) and never
    on a GPU; null lifts the limit."""
    config = {"method": "ngram", "num_speculative_tokens": 2}
    assert NgramConfig.from_dict(config).disable_by_batch_size == speculative.CPU_BATCH_LIMIT
    bf16 = NgramConfig.from_dict(config, bf16=True).disable_by_batch_size
    assert bf16 == bf16_cpu_limit() >= speculative.CPU_BATCH_LIMIT
    quantized = NgramConfig.from_dict(config, quantized=True, bf16=True).disable_by_batch_size
    assert quantized == quantized_cpu_limit() < speculative.CPU_BATCH_LIMIT
    assert NgramConfig.from_dict(config, "cuda").disable_by_batch_size is None
    assert NgramConfig.from_dict(config, "cuda", quantized=True).disable_by_batch_size is None
    lifted = NgramConfig.from_dict({**config, "disable_by_batch_size": None})
    assert lifted.disable_by_batch_size is None
    assert NgramConfig.from_dict({**config, "disable_by_batch_size": 8}, "cuda").disable_by_batch_size == 8


@pytest.mark.parametrize(("quantized", "bf16"), [(False, False), (False, True), (True, True)])
def test_unset_on_a_cpu_a_steps_rows_are_bounded_whatever_k(quantized, bf16):
    """The default batch limit does not fall with k: a decode step's rows are bounded instead, at
    `SAME_BITS_ROWS`, where every row gets the bits it gets alone; no bound on a GPU, nor where the user set
    the limit. The bound is not a key of vLLM's config, so a user cannot set it."""
    limit = quantized_cpu_limit() if quantized else bf16_cpu_limit() if bf16 else speculative.CPU_BATCH_LIMIT
    for k in (1, 6, 16):
        config = NgramConfig.from_dict({"num_speculative_tokens": k}, quantized=quantized, bf16=bf16)
        assert (config.disable_by_batch_size, config.max_step_rows) == (limit, SAME_BITS_ROWS)
    assert NgramConfig.from_dict({"num_speculative_tokens": 6}, "cuda").max_step_rows is None
    chosen = NgramConfig.from_dict({"num_speculative_tokens": 6, "disable_by_batch_size": 4})
    assert chosen.max_step_rows is None
    with pytest.raises(InvalidRequestError):
        NgramConfig.from_dict({"num_speculative_tokens": 6, "max_step_rows": 40})


def test_proposals_are_cut_to_share_a_steps_rows():
    assert fit_to_rows([[1] * 6, [2] * 6, [3] * 6, [4] * 6], 16) == [[1] * 4, [2] * 4, [3] * 4, [4] * 4]
    assert fit_to_rows([[1] * 6, [2], [], [3] * 3], 8) == [[1] * 4, [2], [], [3] * 3]  # short ones whole
    assert fit_to_rows([[1] * 6, [2] * 2], 30) == [[1] * 6, [2] * 2]
    assert fit_to_rows([[1] * 6, [2] * 2], 0) == [[], []]
    assert fit_to_rows([[1] * 6, [2] * 2], -3) == [[], []]  # more sequences than rows
    rng = random.Random(0)
    for _ in range(500):
        drafts = [list(range(rng.randint(0, 16))) for _ in range(rng.randint(0, 8))]
        rows = rng.randint(-4, 40)
        fitted = fit_to_rows(drafts, rows)
        assert sum(map(len, fitted)) <= max(rows, 0)
        assert all(d[: len(f)] == f for d, f in zip(drafts, fitted, strict=True))
        cap = max(map(len, fitted), default=0)  # the longest cut that fits: one more token would not
        if any(len(d) > cap for d in drafts):
            assert sum(min(len(d), cap + 1) for d in drafts) > rows


def test_sequences_with_long_proposals_share_a_step_within_its_rows(llm, spec_llm, monkeypatch):
    """Four sequences proposing six tokens each would make 28 rows: on a CPU's default they keep proposing,
    shortened to 20 rows a step, and greedy outputs are those of plain decoding."""
    monkeypatch.setattr(speculative, "ngram_proposal", lambda tokens, k, *limits: [0] * k)
    config = spec_llm.llm_engine.proposer.config
    monkeypatch.setattr(config, "num_speculative_tokens", 6)
    monkeypatch.setattr(config, "disable_by_batch_size", speculative.CPU_BATCH_LIMIT)
    monkeypatch.setattr(config, "max_step_rows", SAME_BITS_ROWS)
    proposer = spec_llm.llm_engine.proposer
    steps = []
    propose = proposer.propose

    def observed(running):
        propose(running)
        decoding = [s for s in running if s.num_computed_tokens == len(s) - 1]
        steps.append((len(decoding), len(running) + sum(len(s.draft_token_ids) for s in running)))

    monkeypatch.setattr(proposer, "propose", observed)
    plain = llm.generate(PROMPTS[:4], greedy(12, ignore_eos=True), use_tqdm=False)
    fast = spec_llm.generate(PROMPTS[:4], greedy(12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert all(rows <= SAME_BITS_ROWS for _, rows in steps)
    assert (4, SAME_BITS_ROWS) in steps  # four decoding sequences, their proposals cut to fill the rows
    assert_all_blocks_free(spec_llm)


@pytest.mark.parametrize(
    ("quantization", "dtype", "limit"),
    [
        (None, "bfloat16", quantized_cpu_limit),
        ("none", "bfloat16", bf16_cpu_limit),
        ("none", "float32", lambda: speculative.CPU_BATCH_LIMIT),
    ],
    ids=["q4_1", "bf16", "fp32"],
)
def test_the_engine_takes_the_limit_of_its_weights(quantization, dtype, limit):
    """The bundled Q4_1 file kept quantized gets the quantized default; dequantized, the bf16 or the dense
    one."""
    config = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(quantization=quantization, dtype=dtype, max_model_len=256, speculative_config=config)
    assert llm.llm_engine.proposer.config.disable_by_batch_size == limit()


@pytest.mark.parametrize(
    "config",
    [
        {"method": "eagle", "num_speculative_tokens": 2},
        {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
        {"method": "ngram", "num_speculative_tokens": 2, "typo": 1},
    ],
)
def test_bad_configs_are_refused(config):
    with pytest.raises(InvalidRequestError):
        NgramConfig.from_dict(config)
