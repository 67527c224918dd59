"""The batched sampler on synthetic logits, through both of its paths: the native CPU kernel and the PyTorch
code that CUDA runs (`use_native=False` runs it here).

Distributions are checked statistically (chi-square, fixed seeds) against the exact filtered distribution
computed by sorting, as the previous per-row sampler did; speculative verification against greedy decoding
token by token and, when sampling, against the distribution of sampling one token at a time.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from inference_engine import SamplingParams
from inference_engine.sampler import Sampler, apply_edits, sample_rows
from inference_engine.sampling_metadata import SamplingMetadata, TokenHistory
from inference_engine.sequence import Sequence, SequenceGroup
from llmserve_kernels.cpu import available
from llmserve_kernels.cpu import sampling as cpu_sampling

EOS = 2

PATHS = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not available(), reason="no C compiler")),
    pytest.param(False, id="torch"),
]


@pytest.fixture(params=PATHS)
def native(request) -> bool:
    return request.param


def make_seq(params: SamplingParams, prompt=(5, 6, 7), outputs=(), index: int = 0) -> Sequence:
    """A sequence as the engine makes it (the same per-sample generator for seeded requests)."""
    group = SequenceGroup("r", None, list(prompt), params)
    seq = Sequence(0, group, [*prompt, *outputs], len(prompt), index=index)
    if params.seed is not None:
        seq.generator = torch.Generator().manual_seed(hash((params.seed, index)) & (2**63 - 1))
    group.seqs.append(seq)
    return seq


def exact_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from, by full sorts in float64 (top-k, then top-p over what top-k
    left, then min-p)."""
    x = logits.double() / params.temperature
    if 0 < params.top_k < len(x):
        x[x < torch.topk(x, params.top_k).values[-1]] = -math.inf
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        drop = ordered.cumsum(dim=-1) - ordered >= params.top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, str]:
    """Pearson's test at p = 1e-4 (bins of expected count < 5 pooled), and nothing outside the support."""
    n = counts.sum()
    expected = probs * n
    outside = int(counts[probs == 0].sum())
    small = (expected < 5) & (probs > 0)
    observed = torch.cat([counts[expected >= 5], counts[small].sum(dim=0, keepdim=True)])
    wanted = torch.cat([expected[expected >= 5], expected[small].sum(dim=0, keepdim=True)])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    dof = max(len(wanted) - 1, 1)
    z = 3.719  # one-sided 1e-4 normal quantile; Wilson-Hilferty approximation of the chi-square quantile
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    detail = f"chi2={statistic:.1f} critical={critical:.1f} dof={dof} outside={outside}"
    return statistic < critical and outside == 0, detail


CASES = {
    "temperature": SamplingParams(temperature=0.8),
    "hot": SamplingParams(temperature=1.7),
    "top_k": SamplingParams(temperature=0.8, top_k=7),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p": SamplingParams(temperature=1.2, min_p=0.05),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "all": SamplingParams(temperature=1.3, top_k=30, top_p=0.8, min_p=0.02),
}


@pytest.mark.parametrize("vocab", [40, 1500])
@pytest.mark.parametrize("case", CASES)
def test_samples_follow_the_exact_filtered_distribution(native, vocab, case):
    params = CASES[case]
    gen = torch.Generator().manual_seed(vocab)
    row = torch.randn(vocab, generator=gen) * (2.0 if vocab == 40 else 3.0)
    n = 20_000 if vocab == 40 else 4_000
    sampler = Sampler([EOS], seed=1, use_native=native)
    seqs = [make_seq(params)] * n
    tokens = torch.tensor([r.token_id for r in sampler(row.repeat(n, 1), seqs)])
    ok, detail = chi_square_ok(torch.bincount(tokens, minlength=vocab).double(), exact_probs(row, params))
    assert ok, detail


def test_the_chi_square_check_can_fail():
    """A sampler with the wrong temperature is caught by the same check."""
    row = torch.randn(40, generator=torch.Generator().manual_seed(40)) * 2.0
    sampler = Sampler([EOS], seed=1)
    seqs = [make_seq(SamplingParams(temperature=0.9))] * 20_000
    tokens = torch.tensor([r.token_id for r in sampler(row.repeat(20_000, 1), seqs)])
    ok, _ = chi_square_ok(
        torch.bincount(tokens, minlength=40).double(), exact_probs(row, CASES["temperature"])
    )
    assert not ok


def acceptance(native: bool, row: torch.Tensor, params: SamplingParams, drafts, u_accept) -> torch.Tensor:
    """Whether each draft token is accepted against `row` with the given acceptance uniforms: with a uniform
    near 0 that says whether the token is kept, with one near p(token) whether p(token) exceeds it."""
    n = len(drafts)
    k = params.top_k if 0 < params.top_k < len(row) else 0
    full = lambda value, dtype: torch.full((n,), value, dtype=dtype)  # noqa: E731
    md = SamplingMetadata(
        temperature=full(params.temperature, torch.float32),
        top_k=full(k, torch.int32),
        top_p=full(params.top_p, torch.float32),
        min_p=full(params.min_p, torch.float32),
        draft=torch.tensor(drafts, dtype=torch.int64),
        uniforms=torch.stack([torch.as_tensor(u_accept, dtype=torch.float64), torch.full((n,), 0.5)], dim=1),
        greedy_rows=[],
        top_k_rows=list(range(n)) if k else [],
        full_rows=[] if k else list(range(n)),
        edits=None,
        logprob_rows=[],
        logprob_ks=[],
    )
    logits = row.repeat(n, 1)
    args = (md.temperature, md.top_k, md.top_p, md.min_p, md.draft, md.uniforms)
    tokens, accepted = cpu_sampling.sample(logits, *args) if native else sample_rows(logits, md)
    assert torch.equal(tokens[accepted], md.draft[accepted])
    return accepted


PROBES = {
    "top_k": SamplingParams(temperature=0.8, top_k=40),
    "top_k_large": SamplingParams(temperature=1.0, top_k=2000),  # more than the vocabulary's blocks
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k_top_p_min_p": SamplingParams(temperature=1.3, top_k=300, top_p=0.7, min_p=0.01),
    "min_p": SamplingParams(temperature=0.9, min_p=0.03),
    "temperature": SamplingParams(temperature=1.1),
}


@pytest.mark.parametrize("scale", [1.0, 4.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("probe", PROBES)
def test_kept_tokens_and_their_probabilities_are_exact(native, probe, scale):
    """Token by token against the float64 sort: which tokens are kept, and p(token) to 1e-4 relative. The
    flat rows send top-p through the histogram of the native kernel (thousands of candidates)."""
    params, vocab = PROBES[probe], 6007
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(16)) * scale
    exact = exact_probs(row, params)
    order = exact.argsort(descending=True).tolist()
    boundary = int((exact > 0).sum())
    drafts = sorted({*order[:50], *order[max(boundary - 100, 0) : boundary + 100], *order[::60]})
    kept = acceptance(native, row, params, drafts, [1e-300] * len(drafts))
    assert kept.tolist() == [bool(exact[d] > 0) for d in drafts]
    likely = [d for d in drafts if exact[d] > 1e-6]
    p = exact[likely]
    assert acceptance(native, row, params, likely, p * (1 - 1e-4)).all()
    assert not acceptance(native, row, params, likely, p * (1 + 1e-4)).any()


def test_ties_at_the_k_th_largest_logit_are_all_kept(native):
    """bf16 logits tie often: top_k keeps every token equal to the k-th largest, as sorting would."""
    row = torch.zeros(5000)
    row[[10, 999, 4000]] = 3.0
    row[[7, 1500, 2047, 2048, 4999]] = 2.0  # five tied for fourth place
    params = SamplingParams(temperature=1.0, top_k=4)
    kept = acceptance(native, row, params, list(range(5000)), [1e-300] * 5000)
    assert kept.nonzero().flatten().tolist() == [7, 10, 999, 1500, 2047, 2048, 4000, 4999]


def mixed_batch() -> list[tuple[SamplingParams, tuple[int, ...]]]:
    """Every parameter, alone and combined, each with a seed; outputs so far included for the penalties."""
    settings = [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.5, "logprobs": 2},
        {"temperature": 0.8},
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
        {"temperature": 1.0, "top_p": 0.7},
        {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 1.1, "top_k": 5},
        {"temperature": 0.9, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0.9, "repetition_penalty": 1.3, "top_k": 20},
        {"temperature": 1.0, "logit_bias": {3: 5.0, 9: -100.0}},
        {"temperature": 1.0, "min_tokens": 4, "stop_token_ids": [11]},
        {"temperature": 0.7, "logprobs": 3, "top_p": 0.9},
        {"temperature": 1.2, "logprobs": 0, "frequency_penalty": -1.0, "min_p": 0.05, "top_k": 100},
    ]
    outputs = [(), (8, 8, 3), (1,), (9, 2, 9)]
    return [(SamplingParams(seed=100 + i, **s), outputs[i % 4]) for i, s in enumerate(settings)]


def test_a_mixed_batch_equals_each_row_alone(native):
    vocab = 300
    logits = torch.randn(13, vocab, generator=torch.Generator().manual_seed(3)) * 3
    batch = mixed_batch()
    together = Sampler([EOS], seed=0, use_native=native)(
        logits.clone(), [make_seq(p, outputs=o) for p, o in batch]
    )
    for i, (params, outputs) in enumerate(batch):
        alone = Sampler([EOS], seed=9, use_native=native)(
            logits[i : i + 1].clone(), [make_seq(params, outputs=outputs)]
        )
        assert alone == [together[i]], f"row {i}: {params}"


def test_seeded_rows_repeat_and_unseeded_rows_vary(native):
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(4))

    def draw(params: SamplingParams, sampler: Sampler) -> int:
        return sampler(logits.clone(), [make_seq(params)])[0].token_id

    seeded = SamplingParams(temperature=1.0, seed=7)
    assert len({draw(seeded, Sampler([EOS], seed=s, use_native=native)) for s in range(5)}) == 1
    sampler = Sampler([EOS], seed=0, use_native=native)
    assert len({draw(SamplingParams(temperature=1.0), sampler) for _ in range(10)}) > 1


def test_native_and_torch_paths_draw_the_same_tokens():
    """Both paths follow one definition; with the same uniforms only rounding at a CDF boundary could part
    them, which these draws do not hit."""
    if not available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(200, 2000, generator=gen) * 3
    cases = [*CASES.values(), SamplingParams(temperature=0.0)]
    params = [SamplingParams(**{**p.__dict__, "seed": i}) for i, p in enumerate(cases * 25)]
    results = {
        native: Sampler([EOS], seed=0, use_native=native)(logits.clone(), [make_seq(p) for p in params])
        for native in (True, False)
    }
    assert [r.token_id for r in results[True]] == [r.token_id for r in results[False]]


def reference_edits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """The previous sampler's per-row bias, min_tokens ban and penalties."""
    vocab = logits.shape[1]
    for row, seq in zip(logits, seqs, strict=True):
        params = seq.params
        for token, bias in (params.logit_bias or {}).items():
            row[token] += bias
        if seq.num_output_tokens < params.min_tokens:
            row[[EOS, *params.stop_token_ids]] = -math.inf
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)))
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=vocab).float()
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()


def test_biases_bans_and_penalties_match_the_per_row_definition():
    vocab = 64
    seqs = [make_seq(p, outputs=o) for p, o in mixed_batch()]
    seqs.append(make_seq(SamplingParams(repetition_penalty=0.5, presence_penalty=2.0), (1, 1, 4), (4, 4, 60)))
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(6)) * 4
    expected = logits.clone()
    reference_edits(expected, seqs)
    md = SamplingMetadata.build(seqs, None, vocab, [EOS], torch.Generator(), TokenHistory(), logits.device)
    apply_edits(logits, md.edits)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-5)


def test_logprobs_come_from_the_raw_distribution(native):
    vocab = 500
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, top_k=10, logprobs=5, frequency_penalty=2.0, seed=1),
        SamplingParams(temperature=1.0, logprobs=0, logit_bias={7: 50.0}, seed=2),
    ]
    results = Sampler([EOS], seed=0, use_native=native)(
        logits.clone(), [make_seq(p, outputs=(4, 4)) for p in params]
    )
    raw = torch.log_softmax(logits, dim=-1)
    assert results[2].token_id == 7  # the bias moved the sample, not the logprobs
    for row, (result, p) in enumerate(zip(results, params, strict=True)):
        assert result.logprob == pytest.approx(float(raw[row, result.token_id]), abs=1e-5)
        top = raw[row].topk(p.logprobs)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert result.top_logprobs[token].rank == rank
            assert result.top_logprobs[token].logprob == pytest.approx(value, abs=1e-5)
        chosen = result.top_logprobs[result.token_id]
        assert chosen.rank == int((raw[row] > raw[row, result.token_id]).sum()) + 1
        assert len(result.top_logprobs) in (p.logprobs, p.logprobs + 1)


# --- speculative verification -----------------------------------------------------------------------------


class ToyModel:
    """Logits that depend on the last token (a random bigram table), so draft tokens change what follows."""

    def __init__(self, vocab: int, seed: int, scale: float = 3.0) -> None:
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * scale

    def logits(self, last: int, draft: list[int]) -> torch.Tensor:
        """Rows for the positions after `last` and after each draft token."""
        return self.table[[last, *draft]].clone()


def decode_greedy(model: ToyModel, seq: Sequence, steps: int, sampler: Sampler) -> list[int]:
    """Greedy decoding one token at a time (penalties and all), appending to seq."""
    for _ in range(steps):
        token = sampler(model.logits(seq.token_ids[-1], [])[:1], [seq])[0].token_id
        seq.token_ids.append(token)
    return seq.output_token_ids


GREEDY_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.8, logprobs=1),
    SamplingParams(temperature=0.0, min_tokens=3, logit_bias={4: 2.0}),
]


@pytest.mark.parametrize("params", GREEDY_PARAMS, ids=["plain", "penalties", "min_tokens"])
def test_greedy_verification_is_greedy_decoding(native, params):
    model, k = ToyModel(vocab=16, seed=11), 5
    sampler = Sampler([EOS], seed=0, use_native=native)
    truth = decode_greedy(model, make_seq(params), k + 1, sampler)
    wrong = [(t + 1) % 16 for t in truth]
    drafts = {
        "all accepted": truth[:k],
        "none accepted": wrong[:k],
        "two accepted": truth[:2] + wrong[2:k],
        "empty draft": [],
    }
    seqs = [make_seq(params) for _ in drafts]
    logits = torch.cat([model.logits(s.token_ids[-1], d) for s, d in zip(seqs, drafts.values(), strict=True)])
    results = sampler.verify(logits, seqs, list(drafts.values()))
    accepted = {name: [r.token_id for r in res] for name, res in zip(drafts, results, strict=True)}
    assert accepted == {
        "all accepted": truth[: k + 1],
        "none accepted": truth[:1],
        "two accepted": truth[:3],
        "empty draft": truth[:1],
    }


def test_verification_counts_the_draft_as_generated(native):
    """A frequency penalty makes the token after a draft token depend on that token: verification must
    reach the same tokens as decoding them one at a time."""
    model = ToyModel(vocab=8, seed=12, scale=0.5)
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = Sampler([EOS], seed=0, use_native=native)
    truth = decode_greedy(model, make_seq(params), 6, sampler)
    seq = make_seq(params)
    results = sampler.verify(model.logits(seq.token_ids[-1], truth[:5]), [seq], [truth[:5]])
    assert [r.token_id for r in results[0]] == truth


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=1.0),
    ],
    ids=["temperature", "top_k_top_p", "min_p_penalty"],
)
def test_rejection_sampling_keeps_the_distribution(native, params):
    """Over many verifications of one draft: the first token follows p0 (accepted or not); the second, given
    that the draft's first token was taken, follows p1 computed as sampling would after that token."""
    vocab, n = 12, 20_000
    model = ToyModel(vocab=vocab, seed=13, scale=1.5)
    probe = make_seq(params)
    draft = [int(exact_probs(model.logits(probe.token_ids[-1], [])[0], params).argmax()), 3]
    sampler = Sampler([EOS], seed=5, use_native=native)
    seqs = [make_seq(params) for _ in range(n)]
    logits = model.logits(probe.token_ids[-1], draft).repeat(n, 1)
    results = sampler.verify(logits, seqs, [draft] * n)
    firsts = torch.tensor([r[0].token_id for r in results])
    seconds = torch.tensor([r[1].token_id for r in results if len(r) > 1])
    assert all(len(r) == 1 or r[0].token_id == draft[0] for r in results)

    def processed(row: int, outputs: tuple[int, ...]) -> torch.Tensor:
        x = model.logits(probe.token_ids[-1], draft)[row : row + 1]
        reference_edits(x, [make_seq(params, outputs=outputs)])
        return exact_probs(x[0], params)

    ok, detail = chi_square_ok(torch.bincount(firsts, minlength=vocab).double(), processed(0, ()))
    assert ok, f"first token: {detail}"
    assert len(seconds) > 1000
    ok, detail = chi_square_ok(torch.bincount(seconds, minlength=vocab).double(), processed(1, (draft[0],)))
    assert ok, f"second token: {detail}"


def test_seeded_verification_repeats_alone_and_in_a_batch(native):
    model = ToyModel(vocab=50, seed=14, scale=1.0)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=21, logprobs=1)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, seed=3, top_k=4)]
    draft = [1, 2, 3]

    def verify(params_list, drafts):
        seqs = [make_seq(p) for p in params_list]
        logits = torch.cat([model.logits(s.token_ids[-1], d) for s, d in zip(seqs, drafts, strict=True)])
        return Sampler([EOS], seed=0, use_native=native).verify(logits, seqs, drafts)

    alone = verify([seeded], [draft])[0]
    assert verify([seeded], [draft])[0] == alone
    assert verify([others[0], seeded, others[1]], [[4], draft, []])[1] == alone
    raw = torch.log_softmax(model.logits(7, draft), dim=-1)
    for position, result in enumerate(alone):
        assert result.logprob == pytest.approx(float(raw[position, result.token_id]), abs=1e-5)


def test_verify_rejects_mismatched_shapes():
    sampler = Sampler([EOS], seed=0)
    seqs = [make_seq(SamplingParams(temperature=0.0))]
    with pytest.raises(ValueError, match="rows of logits"):
        sampler.verify(torch.zeros(2, 10), seqs, [[1, 2]])
    with pytest.raises(ValueError, match="draft tokens"):
        sampler.verify(torch.zeros(2, 10), [make_seq(SamplingParams(temperature=0.5))], [[10]])


def test_token_history_grows_and_notices_cut_back_tokens():
    history = TokenHistory()
    seq = make_seq(SamplingParams(), prompt=(1, 2, 3))
    assert history(seq).tolist() == [1, 2, 3]
    seq.token_ids += list(range(100))
    assert history(seq).tolist() == [1, 2, 3, *range(100)]
    del seq.token_ids[-50:]
    seq.token_ids += [7] * 60  # cut back and grown past the known length
    assert history(seq).tolist() == seq.token_ids
    del seq.token_ids[5:]
    assert history(seq).tolist() == seq.token_ids


def test_every_combination_of_filters_samples_inside_its_support(native):
    """Small grid over top-k x top-p x min-p x a draft or none: never a token the filters removed."""
    vocab = 257  # not a multiple of the vector width
    gen = torch.Generator().manual_seed(15)
    logits = torch.randn(1, vocab, generator=gen) * 4
    grid = list(itertools.product([0, 1, 3, 256], [1.0, 0.5, 1e-3], [0.0, 0.2, 1.0], [-1, 0, 5]))
    sampler = Sampler([EOS], seed=0, use_native=native)
    for top_k, top_p, min_p, draft in grid:
        params = SamplingParams(temperature=0.9, top_k=top_k or -1, top_p=top_p, min_p=min_p)
        support = exact_probs(logits[0], params) > 0
        seqs = [make_seq(params)] * 50
        drafts = [[draft]] * 50 if draft >= 0 else [[]] * 50
        rows = torch.cat([logits] * (2 if draft >= 0 else 1)).repeat(50, 1)
        for result in sampler.verify(rows, seqs, drafts):
            assert all(support[r.token_id] for r in result), (top_k, top_p, min_p, draft)


def test_degenerate_logits_still_give_tokens_in_range(native):
    logits = torch.randn(4, 300)
    logits[0] = float("-inf")
    logits[1, ::2] = float("nan")
    logits[2] = 0.0
    logits[3, 17] = float("inf")
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.5)):
        results = Sampler([EOS], seed=0, use_native=native)(logits.clone(), [make_seq(params)] * 4)
        assert all(0 <= r.token_id < 300 for r in results)
