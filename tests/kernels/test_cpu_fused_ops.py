"""The native fused bf16 layers (residual add + RMSNorm, rotary, SiLU-and-multiply) against the PyTorch ops
they replace."""

import pytest
import torch
import torch.nn.functional as F

from inference_engine.layers.rotary import RotaryEmbedding
from llmserve_kernels.cpu import fused as cpu_fused

BF16 = torch.bfloat16


@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (26, 576), (300, 576), (2048, 1024), (3, 4096)])
def test_add_rms_norm_matches_pytorch(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, residual = (torch.randn(rows, hidden, generator=gen).to(BF16) * 3 for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(BF16)
    out, summed = cpu_fused.add_rms_norm(x, residual, weight, 1e-5)
    expected_sum = x + residual
    assert torch.equal(summed, expected_sum)
    # transformers' LlamaRMSNorm: normalise in fp32, round to bf16, then scale by the weight and round
    # again. (F.rms_norm rounds once, and so differs from it by one bf16 step in about a quarter of the
    # elements of such inputs.) Only the order of our sum of squares differs from this.
    h = expected_sum.float()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert (out != expected).float().mean() < 0.001


@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"), [(1, 12, 64), (26, 12, 64), (300, 40, 128), (7, 3, 80)]
)
def test_rotary_matches_pytorch_exactly(monkeypatch, tokens, heads, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    # Queries and keys as the model passes them: the leading heads of a wider qkv row.
    qkv = torch.randn(tokens, heads + 4, head_dim, generator=gen).to(BF16)
    with monkeypatch.context() as m:
        m.setattr(cpu_fused, "rotary_", lambda *args: False)
        expected = rotary(positions, qkv[:, :heads])
    untouched = qkv[:, heads:].clone()
    out = rotary(positions, qkv[:, :heads])
    assert out.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, heads:], untouched)  # values beyond the rotated heads are left alone


@pytest.mark.parametrize(("tokens", "heads", "head_dim", "rotary_dim"), [(5, 12, 96, 72), (40, 3, 64, 32)])
def test_partial_rotary_matches_pytorch_exactly(monkeypatch, tokens, heads, head_dim, rotary_dim):
    """Phi-3/4's partial rotation: the first rotary_dim features of each head turn, as a strided view."""
    gen = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, rotary_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv = torch.randn(tokens, heads + 4, head_dim, generator=gen).to(BF16)
    with monkeypatch.context() as m:
        m.setattr(cpu_fused, "rotary_", lambda *args: False)
        expected = rotary(positions, qkv.clone()[:, :heads])
    assert cpu_fused.rotary_(qkv[:, :heads, :rotary_dim], positions, rotary.cos, rotary.sin)
    assert torch.equal(qkv[:, :heads], expected)


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (7, 100), (32, 1536), (300, 1536), (64, 4096)])
def test_silu_mul_matches_pytorch(rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(BF16)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30])  # beyond exp's clamp, tiny
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    out = cpu_fused.silu_mul(gate_up)
    # Our exp is not libm's: the SiLU may round to the other neighbouring bf16 now and then.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-30)
    assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (7, 100), (64, 1536)])
def test_gelu_tanh_mul_matches_pytorch(rows, width):
    gen = torch.Generator().manual_seed(rows * width + 1)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(BF16)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30])  # beyond tanh's saturation, tiny
    gate, up = gate_up.chunk(2, dim=-1)
    out = cpu_fused.gelu_tanh_mul(gate_up)
    # The GELU in fp64 as x * sigmoid(2u) (no cancellation), rounded as PyTorch rounds: ours may round to
    # the other neighbouring bf16 now and then.
    x = gate.double()
    exact = (x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x**3))).to(BF16).mul_(up)
    torch.testing.assert_close(out.float(), exact.float(), rtol=2**-7, atol=1e-30)
    assert (out != exact).float().mean() < 0.01
    # PyTorch's own bf16 GELU: the same but where its 1 + tanh cancels (tiny values, errors below 1e-5).
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh").mul_(up), rtol=2**-7, atol=1e-5)


def test_declines_what_it_cannot_run():
    x = torch.randn(4, 64)
    assert cpu_fused.add_rms_norm(x, x, torch.ones(64), 1e-5) is None  # fp32: PyTorch's path
    xb = x.to(BF16)
    assert cpu_fused.add_rms_norm(xb.t(), xb.t(), torch.ones(4, dtype=BF16), 1e-5) is None  # strided
    assert cpu_fused.silu_mul(torch.randn(4, 64)) is None  # fp32
    assert cpu_fused.silu_mul(torch.randn(4, 63).to(BF16)) is None  # no even split into gate and up
    assert cpu_fused.gelu_tanh_mul(torch.randn(4, 64)) is None  # fp32
    rotary = RotaryEmbedding(64, 128, 10000.0)
    assert not cpu_fused.rotary_(x.view(4, 1, 64), torch.arange(4), rotary.cos, rotary.sin)
    odd_heads = torch.randn(4, 64, 2).to(BF16).transpose(1, 2)  # head_dim not contiguous
    assert not cpu_fused.rotary_(odd_heads, torch.arange(4), rotary.cos, rotary.sin)
