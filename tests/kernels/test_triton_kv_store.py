"""KV-cache store: exactly the mapped slots change, padding tokens (slot -1) write nothing."""

import pytest
import torch

pytest.importorskip("triton")

from llmserve_kernels.reference import store_kvcache_ref
from llmserve_kernels.triton import store_kvcache


@pytest.mark.parametrize(
    (
        "num_tokens",
        "num_blocks",
        "block_size",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "slot_dtype",
        "num_padding",
    ),
    [
        (1, 2, 16, 3, 64, torch.float32, torch.int32, 0),
        (13, 4, 8, 3, 64, torch.bfloat16, torch.int64, 3),
        (20, 3, 32, 8, 128, torch.float16, torch.int32, 5),
        (9, 5, 16, 1, 128, torch.float32, torch.int64, 9),  # a batch of nothing but padding
    ],
)
def test_store_writes_exactly_the_mapped_slots(
    gen,
    rand,
    device,
    num_tokens,
    num_blocks,
    block_size,
    num_kv_heads,
    head_dim,
    dtype,
    slot_dtype,
    num_padding,
):
    # key/value are views of a fused QKV projection (strided), as the engine passes them.
    qkv = rand(num_tokens, 3, num_kv_heads, head_dim, dtype=dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    slot_mapping = slots.to(dtype=slot_dtype, device=device)
    k_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device
    )
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for cache, ref, source in ((k_cache, k_ref, key), (v_cache, v_ref, value)):
        flat = cache.flatten(0, 1).cpu()
        assert flat[~written].isnan().all(), "a slot outside the mapping changed"
        valid = slots >= 0
        assert torch.equal(flat[slots[valid]], source[valid.to(device)].cpu())
        torch.testing.assert_close(cache, ref, atol=0, rtol=0, equal_nan=True)


def test_store_of_zero_tokens_is_a_no_op(device):
    cache = torch.zeros(2, 8, 1, 64, device=device)
    empty = torch.empty(0, 1, 64, device=device)
    store_kvcache(empty, empty, cache, cache, torch.empty(0, dtype=torch.int32, device=device))
    assert not cache.any()
