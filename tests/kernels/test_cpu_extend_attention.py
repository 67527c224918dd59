"""The native CPU extend kernel (prompt chunks attending causally to their paged K/V) against the
per-sequence reference of kernels/reference.py on fresh random inputs."""

import itertools
import math
import random
from pathlib import Path

import pytest
import torch

from llmserve_kernels.cpu import attention as cpu_attention
from llmserve_kernels.reference import paged_extend_attention_ref

BF16 = torch.bfloat16


@pytest.fixture
def device() -> str:
    """These kernels are the CPU's own: no Triton, no interpreter needed."""
    return "cpu"


@pytest.fixture(autouse=True)
def _needs_vector_code():
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if "avx512_bf16" not in flags and not {"avx2", "fma"} <= flags:
        pytest.skip("the extend kernel needs AVX512-BF16 or AVX2; this CPU takes the decode kernel per token")


@pytest.fixture(autouse=True, params=["amx", "vector"])
def routine(request):
    """Every test runs the AMX routine (where the CPU has it) and the vector one."""
    amx = request.param == "amx"
    if cpu_attention.extend_through_amx(amx) != amx:
        pytest.skip("no AMX here")
    yield request.param
    cpu_attention.extend_through_amx(True)


def _extend(paged_kv, rand, seq_lens, query_lens, block_size, heads, kv_heads, head_dim, bounds=None):
    """The kernel's output (NaN where it wrote nothing) and the reference, queries as a view into a wider
    per-token row (the fused qkv output)."""
    kv = paged_kv(seq_lens, block_size, kv_heads, head_dim, BF16)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    q = rand(int(starts[-1]), heads + 2 * kv_heads, head_dim, dtype=BF16)[:, :heads]
    scale = 1 / math.sqrt(head_dim)
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale)
    assert cpu_attention.paged_extend(*args, out, *([bounds] if bounds else []))
    return out, paged_extend_attention_ref(*args, max(query_lens)), starts


# (seq_lens, query_lens, block_size, head_dim, heads, kv_heads): whole prompts and chunks on a cached
# prefix, lengths at and one past tile (AVX-512 16, AVX2 8) and step (64, 32) ends, GQA groups of 1, 3, 4,
# 8 and 16 (more query rows than AVX2 takes in one part of a task), both head dims.
CASES = [
    ([33], [33], 16, 64, 9, 3),
    ([9, 32, 24], [9, 32, 17], 16, 128, 6, 2),
    ([70], [40], 16, 64, 32, 2),
    ([64, 65, 130], [64, 65, 40], 16, 64, 9, 3),
    ([450], [450], 16, 64, 9, 3),
    ([300, 97], [120, 97], 32, 128, 8, 2),
    ([77, 200], [77, 33], 8, 64, 8, 8),
    ([129, 48], [100, 48], 16, 128, 32, 4),
    ([1000], [600], 16, 64, 24, 3),
    (random.Random(5).choices(range(40, 300), k=6), [40] * 6, 16, 64, 9, 3),
]


@pytest.mark.parametrize(("seq_lens", "query_lens", "block_size", "head_dim", "heads", "kv_heads"), CASES)
def test_matches_the_reference(
    paged_kv, rand, assert_close, seq_lens, query_lens, block_size, head_dim, heads, kv_heads
):
    # Unowned cache slots are NaN: a kernel that reads past a sequence's end fails.
    out, ref, _ = _extend(paged_kv, rand, seq_lens, query_lens, block_size, heads, kv_heads, head_dim)
    assert_close(out, ref)


def test_writes_only_the_sequences_within_its_bounds(paged_kv, rand, assert_close):
    """The backend serves chunks of 33 tokens or more here, the rest elsewhere: their rows stay untouched."""
    query_lens = [5, 40, 1, 33, 32]
    out, ref, starts = _extend(
        paged_kv, rand, [20, 90, 7, 33, 64], query_lens, 16, 9, 3, 64, bounds=(33, 1024)
    )
    for b, n in enumerate(query_lens):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        if n >= 33:
            assert_close(out[rows], ref[rows])
        else:
            assert out[rows].isnan().all()


@pytest.mark.parametrize("threads", [1, 2])
def test_result_does_not_depend_on_thread_count(paged_kv, rand, threads):
    kv = paged_kv([300, 70], 16, 3, 64, BF16)
    starts = torch.tensor([0, 200, 270], dtype=torch.int32)
    q = rand(270, 9, 64, dtype=BF16)
    results = []
    previous = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            assert cpu_attention.paged_extend(
                q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, 0.125, out
            )
            results.append(out)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(*results)


def test_declines_what_it_cannot_run(paged_kv, rand):
    """fp32 caches and head dims other than 64 and 128 go elsewhere (False, nothing written)."""
    starts = torch.tensor([0, 40], dtype=torch.int32)
    for dtype, head_dim in ((torch.float32, 64), (BF16, 80)):
        kv = paged_kv([40], 16, 3, head_dim, dtype)
        q = rand(40, 9, head_dim, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        assert not cpu_attention.paged_extend(
            q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, 0.1, out
        )
        assert out.isnan().all()
