"""The native greedy argmax against torch.argmax on fresh random logits, ties, NaN and infinities."""

import pytest
import torch

from inference_engine import sampler
from kernels.cpu import available
from kernels.cpu import sampling as cpu_sampling

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
