"""Sliding windows and soft-capping in the Triton paged attention kernels against the reference.

Blocks wholly outside every query's window hold NaN: the kernels must not read them (that is where a long
context with a short window saves its time)."""

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from llmserve_kernels.reference import paged_decode_attention_ref, paged_extend_attention_ref
from llmserve_kernels.triton import paged_decode_attention, paged_extend_attention

F32, BF16 = torch.float32, torch.bfloat16

# (seq_lens, block_size, head_dim, heads, kv_heads, dtype, num_splits, window, softcap): windows shorter and
# longer than the contexts, not multiples of the block size, of one key; softcap with and without a window.
DECODE_CASES = [
    ([1, 17, 40, 100], 16, 64, 9, 3, F32, None, 16, 0.0),
    ([300, 33, 5], 16, 64, 8, 2, BF16, 4, 37, 0.0),
    ([129, 64, 65], 8, 128, 4, 4, F32, 3, 1, 0.0),
    ([700, 20], 16, 64, 6, 2, BF16, None, 250, 0.0),
    ([50, 3, 90], 16, 64, 9, 3, F32, 2, 0, 5.0),
    ([400, 31], 32, 128, 8, 2, BF16, 5, 100, 2.5),
    (random.Random(7).choices(range(1, 300), k=9), 16, 64, 8, 4, F32, None, 70, 1.0),
]


@pytest.mark.parametrize(
    ("seq_lens", "block_size", "head_dim", "heads", "kv_heads", "dtype", "num_splits", "window", "softcap"),
    DECODE_CASES,
)
def test_decode_matches_reference(
    paged_kv,
    rand,
    assert_close,
    outside_window_poisoned,
    seq_lens,
    block_size,
    head_dim,
    heads,
    kv_heads,
    dtype,
    num_splits,
    window,
    softcap,
):
    kv = paged_kv(seq_lens, block_size, kv_heads, head_dim, dtype)
    q = rand(len(seq_lens), heads, head_dim, dtype=dtype) * 3  # wide scores: the cap matters
    scale = 1 / math.sqrt(head_dim)
    options = {"window": window, "softcap": softcap}
    ref = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, **options
    )
    if window:
        kv = outside_window_poisoned(kv, [n - window for n in seq_lens])
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, num_splits, out=out, **options
    )
    assert_close(out, ref)


def test_options_change_the_result(paged_kv, rand):
    """The window and the cap are applied, not ignored (the cases above would pass a kernel that ignores
    them only if the reference did too)."""
    kv = paged_kv([90], 16, 2, 64, F32)
    q = rand(1, 4, 64, dtype=F32) * 3
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    plain = paged_decode_attention(*args)
    assert not torch.allclose(paged_decode_attention(*args, window=20), plain, atol=1e-3)
    assert not torch.allclose(paged_decode_attention(*args, softcap=1.0), plain, atol=1e-3)


# (chunks as (cached prefix, chunk length), block_size, head_dim, heads, kv_heads, dtype, window, softcap)
EXTEND_CASES = [
    ([(0, 40), (0, 17)], 16, 64, 9, 3, F32, 16, 0.0),  # prompts longer and shorter than the window
    ([(100, 30), (0, 65), (7, 9)], 8, 64, 12, 3, BF16, 21, 0.0),  # cached prefixes, window off the blocks
    ([(200, 70), (3, 1), (150, 1)], 16, 128, 8, 2, F32, 1, 0.0),  # each token sees itself only
    ([(60, 100), (10, 5)], 16, 64, 4, 4, BF16, 500, 0.0),  # a window longer than every context
    ([(20, 7), (0, 33), (5, 1)], 32, 128, 8, 2, F32, 0, 4.0),  # softcap alone
    ([(300, 40), (0, 90), (64, 1), (5, 3)], 16, 64, 16, 2, BF16, 37, 3.0),  # both
]


@pytest.mark.parametrize(
    ("chunks", "block_size", "head_dim", "heads", "kv_heads", "dtype", "window", "softcap"), EXTEND_CASES
)
def test_extend_matches_reference(
    paged_kv,
    rand,
    assert_close,
    outside_window_poisoned,
    chunks,
    block_size,
    head_dim,
    heads,
    kv_heads,
    dtype,
    window,
    softcap,
):
    q_lens = [n for _, n in chunks]
    kv = paged_kv([p + n for p, n in chunks], block_size, kv_heads, head_dim, dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(int(starts[-1]), heads, head_dim, dtype=dtype) * 3
    scale = 1 / math.sqrt(head_dim)
    options = {"window": window, "softcap": softcap}
    ref = paged_extend_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale, max(q_lens), **options
    )
    if window:
        kv = outside_window_poisoned(kv, [p - window + 1 for p, _ in chunks])
    out = torch.full_like(q, float("nan"))
    paged_extend_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        starts,
        kv.seq_lens,
        scale,
        max(q_lens),
        out=out,
        **options,
    )
    assert_close(out, ref)
