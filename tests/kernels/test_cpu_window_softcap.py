"""Sliding windows and soft-capping in the native CPU attention kernels against the reference.

Blocks wholly outside every query's window hold NaN: the kernels must not read them (that is where a long
context with a short window saves its time)."""

import math
import random
from pathlib import Path

import pytest
import torch

from llmserve_kernels.cpu import attention as cpu_attention
from llmserve_kernels.reference import paged_decode_attention_ref, paged_extend_attention_ref

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def device() -> str:
    """These kernels are the CPU's own: no Triton, no interpreter needed."""
    return "cpu"


@pytest.fixture(params=["amx", "vector"])
def routine(request):
    """Both kernels' AMX routines (where the CPU has them) and their vector ones."""
    amx = request.param == "amx"
    if cpu_attention.decode_through_amx(amx) != amx or cpu_attention.extend_through_amx(amx) != amx:
        pytest.skip("no AMX here")
    yield request.param
    cpu_attention.decode_through_amx(True)
    cpu_attention.extend_through_amx(True)


# (seq_lens, block_size, head_dim, heads, kv_heads, dtype, window, softcap): windows shorter and longer than
# the contexts, not multiples of the block size, of one key; softcap with and without a window; contexts
# in the AMX routine's range (256 to 2048 keys) beside short ones; the generic loops (fp32, head dim 80).
DECODE_CASES = [
    ([1, 17, 40, 100], 16, 64, 9, 3, BF16, 16, 0.0),
    ([300, 33, 5], 16, 64, 8, 2, BF16, 37, 0.0),
    ([129, 64, 65], 8, 128, 4, 4, F32, 1, 0.0),
    ([700, 20, 260], 16, 64, 6, 2, BF16, 250, 0.0),
    ([50, 3, 90], 16, 64, 9, 3, F32, 0, 5.0),
    ([400, 31, 300], 32, 128, 8, 2, BF16, 0, 2.5),
    ([400, 31, 300], 32, 128, 8, 2, BF16, 100, 2.5),
    ([45, 3, 70], 8, 80, 16, 2, BF16, 20, 3.0),
    ([2100, 500], 16, 64, 9, 3, BF16, 1000, 0.0),
    (random.Random(7).choices(range(1, 300), k=9), 16, 64, 8, 4, F32, 70, 1.0),
    (random.Random(8).choices(range(1, 400), k=24), 16, 128, 16, 2, BF16, 123, 4.0),
]


@pytest.mark.parametrize(
    ("seq_lens", "block_size", "head_dim", "heads", "kv_heads", "dtype", "window", "softcap"), DECODE_CASES
)
def test_decode_matches_reference(
    paged_kv,
    rand,
    assert_close,
    outside_window_poisoned,
    routine,
    seq_lens,
    block_size,
    head_dim,
    heads,
    kv_heads,
    dtype,
    window,
    softcap,
):
    kv = paged_kv(seq_lens, block_size, kv_heads, head_dim, dtype)
    # Queries as the model hands them over: a view into the fused qkv rows; wide scores, so the cap matters.
    q = (rand(len(seq_lens), heads + 2 * kv_heads, head_dim, dtype=F32) * 3).to(dtype)[:, :heads]
    scale = 1 / math.sqrt(head_dim)
    options = {"window": window, "softcap": softcap}
    ref = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, **options
    )
    if window:
        kv = outside_window_poisoned(kv, [n - window for n in seq_lens])
    out = cpu_attention.paged_decode(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, **options
    )
    assert out is not None
    assert_close(out, ref)


def test_decode_options_change_the_result(paged_kv, rand):
    """The window and the cap are applied, not ignored."""
    kv = paged_kv([300], 16, 2, 64, BF16)
    q = rand(1, 4, 64, dtype=BF16) * 3
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    plain = cpu_attention.paged_decode(*args)
    assert not torch.allclose(cpu_attention.paged_decode(*args, window=20), plain, atol=1e-2)
    assert not torch.allclose(cpu_attention.paged_decode(*args, softcap=1.0), plain, atol=1e-2)


@pytest.mark.skipif(
    "avx512_bf16" not in (flags := set(Path("/proc/cpuinfo").read_text().split()))
    and not {"avx2", "fma"} <= flags,
    reason="the extend kernel needs AVX512-BF16 or AVX2",
)
@pytest.mark.parametrize(
    ("chunks", "block_size", "head_dim", "heads", "kv_heads", "window", "softcap"),
    [
        ([(0, 40), (0, 17)], 16, 64, 9, 3, 16, 0.0),  # prompts longer and shorter than the window
        ([(100, 30), (0, 65), (7, 9)], 8, 64, 12, 3, 21, 0.0),  # cached prefixes, window off the blocks
        ([(200, 70), (3, 1), (150, 1)], 16, 128, 8, 2, 1, 0.0),  # each token sees itself only
        ([(60, 100), (10, 5)], 16, 64, 4, 4, 500, 0.0),  # a window longer than every context
        ([(20, 7), (0, 33), (5, 1)], 32, 128, 8, 2, 0, 4.0),  # softcap alone
        ([(300, 40), (0, 90), (64, 1), (5, 3)], 16, 64, 16, 2, 37, 3.0),  # both
        ([(0, 450)], 16, 64, 9, 3, 100, 0.0),  # a long prompt: many tasks, windows far from their start
        ([(900, 200), (130, 66)], 32, 128, 32, 4, 129, 2.0),  # a long cached prefix, 8 heads a KV head
    ],
)
def test_extend_matches_reference(
    paged_kv,
    rand,
    assert_close,
    outside_window_poisoned,
    routine,
    chunks,
    block_size,
    head_dim,
    heads,
    kv_heads,
    window,
    softcap,
):
    q_lens = [n for _, n in chunks]
    kv = paged_kv([p + n for p, n in chunks], block_size, kv_heads, head_dim, BF16)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = (rand(int(starts[-1]), heads + 2 * kv_heads, head_dim, dtype=F32) * 3).to(BF16)[:, :heads]
    scale = 1 / math.sqrt(head_dim)
    options = {"window": window, "softcap": softcap}
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale)
    ref = paged_extend_attention_ref(*args, max(q_lens), **options)
    if window:
        kv = outside_window_poisoned(kv, [p - window + 1 for p, _ in chunks])
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale)
    assert cpu_attention.paged_extend(*args, out, **options)
    assert_close(out, ref)


def test_negative_options_are_refused(paged_kv, rand):
    kv = paged_kv([10], 16, 2, 64, BF16)
    q = rand(1, 4, 64, dtype=BF16)
    with pytest.raises(ValueError, match="window"):
        cpu_attention.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1, window=-1)
