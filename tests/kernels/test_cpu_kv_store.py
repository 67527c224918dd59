"""The native KV store against index_copy_, the PyTorch op it replaces."""

import pytest
import torch

from inference_engine.attention import torch_backend
from llmserve_kernels.cpu import attention as cpu_attention


@pytest.mark.parametrize(
    ("tokens", "kv_heads", "head_dim", "dtype"),
    [
        (1, 3, 64, torch.bfloat16),
        (26, 3, 64, torch.bfloat16),
        (300, 8, 128, torch.float32),
        (7, 1, 80, torch.float16),
    ],
)
def test_store_matches_index_copy(tokens, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(tokens)
    blocks, block_size = 40, 16
    # K as the model passes it, a strided view into the fused projection's rows; V contiguous, so the two
    # row strides differ.
    qkv = torch.randn(tokens, 5 + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, 5 : 5 + kv_heads], qkv[:, 5 + kv_heads :].contiguous()
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    caches = [torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv"]
    expected = [c.clone() for c in caches]
    expected[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    expected[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    assert cpu_attention.store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_out_of_range_slot_raises_and_writes_nothing():
    k = torch.ones(3, 2, 64, dtype=torch.bfloat16)
    caches = [torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16) for _ in "kv"]
    for bad in (64, -1):
        with pytest.raises(IndexError):
            cpu_attention.store_kv(k, k, *caches, torch.tensor([0, bad, 5]))
        assert not caches[0].any() and not caches[1].any()


def test_declines_what_it_cannot_run_and_the_backend_falls_back():
    caches = [torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16) for _ in "kv"]
    odd = torch.ones(3, 64, 2, dtype=torch.bfloat16).transpose(1, 2)  # head_dim not contiguous
    slots = torch.tensor([1, 2, 3])
    assert not cpu_attention.store_kv(odd, odd, *caches, slots)
    assert not cpu_attention.store_kv(odd.float(), odd.float(), *caches, slots)  # dtype differs from cache
    torch_backend.store_kv(odd, odd, *caches, slots)  # index_copy_ takes it
    assert caches[0].view(-1, 2, 64)[1:4].eq(1).all() and caches[1].view(-1, 2, 64)[1:4].eq(1).all()


def test_declines_caches_of_different_shapes():
    """The kernel bounds every slot by the K cache: a smaller V cache must not be written past its end."""
    k = torch.ones(3, 2, 64, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(blocks, 16, 2, 64, dtype=torch.bfloat16) for blocks in (4, 2))
    assert not cpu_attention.store_kv(k, k, k_cache, v_cache, torch.tensor([0, 40, 63]))
