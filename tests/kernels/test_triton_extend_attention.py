"""Paged extend (prefill / chunked prefill / prefix hit / decode) attention against the reference."""

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from kernels.reference import paged_extend_attention_ref
from kernels.triton import paged_extend_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _random_chunks(seed: int, batch: int) -> list[tuple[int, int]]:
    """Ragged (prefix length, chunk length) pairs, as a mixed batch in the engine would have."""
    rng = random.Random(seed)
    return [(rng.randrange(100), rng.randrange(1, 40)) for _ in range(batch)]


# (chunks as (cached prefix length, chunk length), block_size, head_dim, num_heads, num_kv_heads, dtype, pad)
# Chunks longer than a tile's query tokens (64 / GQA group) exercise several tiles per sequence.
CASES = [
    ([(0, 1)], 16, 64, 9, 3, F32, None),  # the first token of a prompt
    ([(0, 17), (0, 16), (0, 45)], 16, 64, 9, 3, BF16, -1),  # plain prefill
    ([(16, 1), (32, 1), (0, 1), (8, 1)], 8, 128, 8, 2, F32, None),  # decode through the extend kernel
    ([(20, 7), (64, 70), (3, 1)], 32, 128, 4, 4, F16, 0),  # chunked prefill, prefix-cache hits
    ([(100, 30), (0, 65), (7, 9)], 8, 64, 12, 3, BF16, None),
    ([(5, 3), (0, 40), (31, 2), (1, 1), (47, 17), (0, 8)], 16, 64, 8, 8, F32, -1),
    (_random_chunks(seed=2, batch=8), 32, 128, 9, 3, F16, None),
]


@pytest.mark.parametrize(
    ("chunks", "block_size", "head_dim", "num_heads", "num_kv_heads", "dtype", "pad"), CASES
)
def test_extend_matches_reference(
    paged_kv, rand, assert_close, chunks, block_size, head_dim, num_heads, num_kv_heads, dtype, pad
):
    q_lens = [q_len for _, q_len in chunks]
    kv = paged_kv(
        [prefix + q_len for prefix, q_len in chunks], block_size, num_kv_heads, head_dim, dtype, pad=pad
    )
    query_start_loc = (
        torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(kv.seq_lens.device)
    )
    q = rand(sum(q_lens), num_heads, head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, scale, max(q_lens))
    out = torch.full_like(q, float("nan"))

    result = paged_extend_attention(*args, out=out)

    assert result is out
    assert_close(out, paged_extend_attention_ref(*args))


def test_extend_with_one_token_chunks_equals_decode(paged_kv, rand):
    """q_len = 1 everywhere must give exactly the decode kernel's answer (up to float rounding)."""
    from kernels.triton import paged_decode_attention

    kv = paged_kv([1, 24, 25], 8, 3, 64, F32)
    q = rand(3, 9, 64, dtype=F32)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=q.device)

    extend = paged_extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.125, 1
    )
    decode = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, 1)

    torch.testing.assert_close(extend, decode, atol=1e-5, rtol=1e-5)
