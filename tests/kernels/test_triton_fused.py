"""Fused residual add + RMSNorm, rotary embedding and SiLU-and-multiply against their references, and the
references against transformers' Llama layers (the semantics the engine must reproduce)."""

import pytest
import torch

pytest.importorskip("triton")

from llmserve_kernels.reference import add_rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref
from llmserve_kernels.triton.fused import add_rms_norm, rms_norm, rotary_embedding_, silu_and_mul

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Each kernel rounds once per stored value, as its reference does, yet a result may differ by a unit in the
# last place: the references' fp32 sums run in another order. bf16 allows a few units more, because Triton's
# interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even.
ULP = {
    F32: {"atol": 1e-5, "rtol": 1e-5},
    F16: {"atol": 1e-3, "rtol": 1e-3},
    BF16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.mark.parametrize(
    ("tokens", "hidden", "dtype"),
    [(1, 576, BF16), (7, 4096, BF16), (33, 960, F16), (5, 100, F32), (3, 8192, BF16), (0, 64, BF16)],
)
def test_add_rms_norm_matches_reference(rand, tokens, hidden, dtype):
    # x is a strided view (rows of a wider buffer), as a slice of a larger activation would be.
    x = rand(tokens, hidden + 8, dtype=dtype)[:, :hidden]
    residual = rand(tokens, hidden, dtype=dtype)
    weight = (1 + 0.1 * rand(hidden, dtype=F32)).to(dtype)

    out, new_residual = add_rms_norm(x, residual, weight, 1e-5)

    ref_out, ref_residual = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert out.dtype == new_residual.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(new_residual, ref_residual, **ULP[dtype])
    torch.testing.assert_close(out, ref_out, **ULP[dtype])
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), add_rms_norm_ref(x, None, weight, 1e-6), **ULP[dtype]
    )


def test_norm_reference_is_transformers_llama_rms_norm(gen):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    layer = LlamaRMSNorm(576, eps=1e-5).to(BF16)
    layer.weight.data = (1 + 0.1 * torch.randn(576, generator=gen)).to(BF16)
    x, residual = (torch.randn(6, 576, generator=gen).to(BF16) for _ in range(2))

    out, new_residual = add_rms_norm_ref(x, residual, layer.weight, 1e-5)

    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, layer(x + residual))


def test_add_rms_norm_rejects_mismatched_shapes(rand):
    x = rand(2, 64, dtype=F32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, rand(32, dtype=F32), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, rand(3, 64, dtype=F32), rand(64, dtype=F32), 1e-5)


def _rope_caches(head_dim: int, max_position: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from inference_engine.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, max_position, theta=10000.0)
    return rope.cos.to(device), rope.sin.to(device)


@pytest.mark.parametrize(
    ("tokens", "num_heads", "num_kv_heads", "head_dim", "dtype", "pos_dtype"),
    [
        (1, 9, 3, 64, BF16, torch.int64),
        (13, 32, 8, 128, BF16, torch.int64),
        (5, 4, 4, 64, F16, torch.int32),
        (7, 3, 1, 96, F32, torch.int64),  # half a head (48) is not a power of two
    ],
)
def test_rotary_rotates_queries_and_keys_in_place(
    gen, rand, device, tokens, num_heads, num_kv_heads, head_dim, dtype, pos_dtype
):
    cos, sin = _rope_caches(head_dim, 2048, device)
    qkv = rand(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    before = qkv.clone()
    # Queries and keys together, a strided view of the fused projection: exactly what the model passes.
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(tokens, num_heads + num_kv_heads, head_dim)
    positions = torch.randint(0, 2048, (tokens,), generator=gen).to(dtype=pos_dtype, device=device)

    result = rotary_embedding_(qk, positions, cos, sin)

    assert result is qk
    expected = rotary_embedding_ref(before[:, : qk.shape[1] * head_dim].view_as(qk), positions, cos, sin)
    torch.testing.assert_close(qk, expected, **ULP[dtype])
    assert torch.equal(qkv[:, qk.shape[1] * head_dim :], before[:, qk.shape[1] * head_dim :]), "V changed"


def test_rotary_reference_is_transformers_apply_rotary_pos_emb(gen):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim = 64
    cos, sin = _rope_caches(head_dim, 512, "cpu")
    positions = torch.randint(0, 512, (6,), generator=gen)
    q, k = torch.randn(6, 9, head_dim, generator=gen), torch.randn(6, 3, head_dim, generator=gen)
    # transformers' sin is +sin in both halves; RotaryEmbedding folds rotate_half's sign into the first.
    hf_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), -1)

    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos[positions], hf_sin[positions], unsqueeze_dim=1)

    torch.testing.assert_close(rotary_embedding_ref(q, positions, cos, sin), hf_q)
    torch.testing.assert_close(rotary_embedding_ref(k, positions, cos, sin), hf_k)


@pytest.mark.parametrize(
    ("tokens", "width", "dtype"),
    [(1, 1536, BF16), (9, 2816, BF16), (4, 1000, F16), (3, 300, F32), (0, 64, F32)],
)
def test_silu_and_mul_matches_reference(rand, tokens, width, dtype):
    gate_up = rand(tokens, 2 * width, dtype=dtype)

    out = silu_and_mul(gate_up)

    assert out.shape == (tokens, width) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **ULP[dtype])


def test_silu_and_mul_reference_is_the_llama_mlp_activation(gen):
    gate_up = torch.randn(5, 2 * 96, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul_ref(gate_up), torch.nn.functional.silu(gate) * up)
