"""The native sampling kernel: greedy argmax against torch.argmax (fresh random logits, ties, NaN and
infinities), and the sampling entry point's contract. Its distributions are tested through the sampler in
tests/engine/test_sampler.py, against the PyTorch path and exact float64 references."""

import pytest
import torch

from inference_engine import sampler
from llmserve_kernels.cpu import available
from llmserve_kernels.cpu import sampling as cpu_sampling

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the CPU kernels")


@pytest.mark.parametrize("shape", [(1, 49152), (26, 49152), (33, 1000), (3, 17), (5, 16), (2, 1)])
def test_matches_torch_argmax(gen, shape):
    logits = torch.randn(*shape, generator=gen)
    assert torch.equal(cpu_sampling.argmax(logits), logits.argmax(dim=-1))


def test_ties_nan_and_infinities_follow_torch():
    logits = torch.randn(6, 1003)
    logits[0, [5, 700, 1001]] = 50.0  # a tie: the first index wins
    logits[1, [900, 20]] = float("nan")  # a NaN counts as the maximum, the first one wins
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")  # every entry the lowest
    logits[3, 1002] = float("inf")  # in the tail past the last whole vector
    logits[4, 1000] = float("nan")
    logits[5, [0, 16]] = 1e30
    assert cpu_sampling.argmax(logits).tolist() == logits.argmax(dim=-1).tolist() == [5, 20, 0, 1002, 1000, 0]


def test_declines_what_it_cannot_run_and_the_sampler_falls_back():
    for logits in (torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, 4).t(), torch.randn(2, 3, 4)):
        assert cpu_sampling.argmax(logits) is None
    bf16 = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(sampler.argmax(bf16), bf16.argmax(dim=-1))


def kernel_args(rows: int, temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, draft=-1, seed=0):
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    uniforms = torch.rand(rows, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (
        full(temperature, torch.float32),
        full(top_k, torch.int32),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
        full(draft, torch.int64),
        uniforms,
    )


@pytest.mark.parametrize("filters", [{}, {"top_k": 50}, {"top_p": 0.9}, {"top_k": 20, "min_p": 0.1}])
def test_rows_do_not_depend_on_the_batch_or_the_thread_count(gen, filters):
    logits = torch.randn(64, 3001, generator=gen) * 3
    args = kernel_args(64, **filters)
    tokens, _ = cpu_sampling.sample(logits, *args)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(cpu_sampling.sample(logits, *args)[0], tokens)
    one = [cpu_sampling.sample(logits[i : i + 1], *(a[i : i + 1] for a in args))[0] for i in range(0, 64, 9)]
    assert torch.cat(one).tolist() == tokens[::9].tolist()


def test_greedy_rows_take_the_argmax_and_accept_a_matching_draft(gen):
    logits = torch.randn(6, 777, generator=gen)
    best = logits.argmax(dim=-1)
    draft = best.clone()
    draft[::2] = (best[::2] + 1) % 777
    args = list(kernel_args(6, temperature=0.0))
    args[4] = draft
    tokens, accepted = cpu_sampling.sample(logits, *args[:5], None)
    assert torch.equal(tokens, best)
    assert accepted.tolist() == [False, True] * 3


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.5}])
def test_degenerate_rows_still_give_a_token_in_range(filters):
    logits = torch.randn(4, 300)
    logits[0] = float("-inf")
    logits[1, ::2] = float("nan")
    logits[2] = 0.0  # all tied
    logits[3, 17] = float("inf")
    tokens, _ = cpu_sampling.sample(logits, *kernel_args(4, **filters))
    assert all(0 <= t < 300 for t in tokens.tolist())
    assert logits[1, tokens[1]].isfinite()
    assert tokens[3] == 17


def test_sample_declines_or_rejects_what_it_cannot_run():
    logits = torch.randn(3, 64)
    args = kernel_args(3)
    assert cpu_sampling.sample(logits.to(torch.bfloat16), *args) is None
    assert cpu_sampling.sample(torch.randn(64, 3).t(), *args) is None
    with pytest.raises(ValueError, match="top_k"):
        cpu_sampling.sample(logits, args[0], args[1].long(), *args[2:])
    with pytest.raises(ValueError, match="uniforms"):
        cpu_sampling.sample(logits, *args[:5], None)
    with pytest.raises(ValueError, match="uniforms"):
        cpu_sampling.sample(logits, *args[:5], args[5].float())
