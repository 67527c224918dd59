"""Split-K paged decode attention against the per-sequence PyTorch reference."""

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from llmserve_kernels.reference import paged_decode_attention_ref
from llmserve_kernels.triton import paged_decode_attention
from llmserve_kernels.triton.decode_attention import MAX_SPLITS, choose_num_splits

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (seq_lens, block_size, head_dim, num_heads, num_kv_heads, dtype, num_splits, table padding)
# Lengths cover 1, exact block ends and one past them; GQA ratios 1, 3 and 4; num_splits of 1, several,
# more than a sequence has blocks, and None (the launcher's choice). None padding = an all-NaN block.
CASES = [
    ([1], 16, 64, 9, 3, F32, 1, None),
    ([16, 17, 1, 33], 16, 64, 9, 3, BF16, None, -1),
    ([8, 9, 7, 64, 65], 8, 128, 8, 2, F32, 3, None),
    ([32, 31, 97], 32, 128, 4, 4, F16, 2, 0),
    ([200, 1, 129], 16, 64, 12, 3, BF16, 4, None),
    ([5, 40], 8, 64, 9, 3, F32, 16, None),
    ([3, 150, 64, 1, 77, 32, 33, 120], 32, 64, 8, 8, BF16, 1, -1),
    ([600], 16, 64, 3, 1, F32, None, None),
    ([130, 17], 16, 128, 32, 8, BF16, None, None),
    (random.Random(1).choices(range(1, 300), k=16), 16, 128, 9, 3, BF16, 5, None),
    # A grid of many splits for short sequences, as a CUDA graph captured for the longest context runs it.
    ([1, 5, 63, 64, 65, 127, 128, 129, 300], 16, 64, 8, 2, F16, 16, None),
    ([3, 40, 1], 8, 8, 4, 2, BF16, 2, None),  # head_dim 8: tiles padded to the 16 tl.dot needs
]


@pytest.mark.parametrize(
    ("seq_lens", "block_size", "head_dim", "num_heads", "num_kv_heads", "dtype", "num_splits", "pad"), CASES
)
def test_decode_matches_reference(
    paged_kv,
    rand,
    assert_close,
    seq_lens,
    block_size,
    head_dim,
    num_heads,
    num_kv_heads,
    dtype,
    num_splits,
    pad,
):
    kv = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, pad=pad)
    q = rand(len(seq_lens), num_heads, head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))

    result = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, num_splits, out=out
    )

    assert result is out
    ref = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    assert_close(out, ref)


def test_decode_accepts_query_view_of_fused_qkv(paged_kv, rand, assert_close):
    """The engine slices q out of a fused QKV projection: a strided view, not a contiguous tensor."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    kv = paged_kv([19, 48], 16, num_kv_heads, head_dim, F32)
    qkv = rand(2, (num_heads + 2 * num_kv_heads) * head_dim, dtype=F32)
    q = qkv[:, : num_heads * head_dim].view(2, num_heads, head_dim)

    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, 2)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(
        out, paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    )


def test_decode_padding_rows_of_length_zero_give_zeros(paged_kv, rand, assert_close):
    """A batch padded to a captured size carries rows with seq_len 0: zeros, as the reference, not NaN."""
    kv = paged_kv([20, 7, 1], 8, 2, 64, BF16)
    kv.seq_lens[1] = 0
    q = rand(3, 4, 64, dtype=BF16)

    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, 8)

    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(
        out, paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    )


def test_decode_rejects_head_counts_that_do_not_group(paged_kv, rand):
    kv = paged_kv([4], 8, 3, 64, F32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(
            rand(1, 4, 64, dtype=F32), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 1.0
        )


@pytest.mark.parametrize(
    ("batch", "num_kv_heads", "max_context", "expected"),
    [
        (1, 8, 8192, 33),  # one long sequence: ~2 programs per SM
        (1, 8, 256, 2),  # short context: no split below MIN_TOKENS_PER_SPLIT tokens
        (64, 8, 8192, 1),  # the batch alone fills the GPU
        (1, 1, 1 << 20, MAX_SPLITS),
        (4, 3, 1, 1),
    ],
)
def test_choose_num_splits(batch, num_kv_heads, max_context, expected):
    assert choose_num_splits(batch, num_kv_heads, max_context, num_sms=132) == expected
