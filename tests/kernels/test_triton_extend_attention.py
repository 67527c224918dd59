"""Paged extend (prefill / chunked prefill / prefix hit / decode) attention against the reference."""

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from llmserve_kernels.reference import paged_extend_attention_ref
from llmserve_kernels.triton import paged_extend_attention
from llmserve_kernels.triton.extend_attention import extend_grid, extend_tile

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _random_chunks(seed: int, batch: int) -> list[tuple[int, int]]:
    """Ragged (prefix length, chunk length) pairs, as a mixed batch in the engine would have."""
    rng = random.Random(seed)
    return [(rng.randrange(100), rng.randrange(1, 40)) for _ in range(batch)]


def _chunk_beside_decodes(seed: int, chunk: tuple[int, int], decodes: int) -> list[tuple[int, int]]:
    """A mixed step as the scheduler builds it: one prefill chunk, then single-token decodes."""
    rng = random.Random(seed)
    return [chunk] + [(rng.randrange(200), 1) for _ in range(decodes)]


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
    # Mixed steps: one long chunk (several tiles) beside many decodes, the chunk's prefix cached or not.
    (_chunk_beside_decodes(3, (0, 150), decodes=30), 16, 64, 8, 2, BF16, None),
    (_chunk_beside_decodes(4, (180, 70), decodes=25), 8, 64, 12, 3, F16, -1),
    (_chunk_beside_decodes(5, (40, 97), decodes=8), 32, 128, 4, 4, F32, 0),
    ([(3, 1), (0, 1), *_chunk_beside_decodes(6, (100, 33), decodes=6)], 16, 64, 16, 2, BF16, None),
    ([(0, 5), (0, 5), (2, 5)], 16, 8, 4, 2, BF16, None),  # head_dim 8: tiles padded to the 16 tl.dot needs
    ([(60, 1), (61, 2), (0, 3), (9, 4)], 8, 64, 32, 8, F16, None),  # short chunks: the smallest tile
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
    from llmserve_kernels.triton import paged_decode_attention

    kv = paged_kv([1, 24, 25], 8, 3, 64, F32)
    q = rand(3, 9, 64, dtype=F32)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=q.device)

    extend = paged_extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.125, 1
    )
    decode = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, 1)

    torch.testing.assert_close(extend, decode, atol=1e-5, rtol=1e-5)


def test_extend_leaves_padding_rows_alone(paged_kv, rand, assert_close):
    """Rows of q past query_start_loc[-1] (a padded step) belong to no sequence: nothing is written there."""
    kv = paged_kv([9, 30], 16, 2, 64, F32)
    query_start_loc = torch.tensor([0, 4, 7], dtype=torch.int32, device=kv.seq_lens.device)
    q = rand(12, 4, 64, dtype=F32)
    out = torch.full_like(q, float("nan"))
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.125, 4)

    paged_extend_attention(*args, out=out)

    assert out[7:].isnan().all()
    assert_close(out[:7], paged_extend_attention_ref(*args)[:7])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "max_query_len", "tile"),
    [
        (32, 8, 1793, (64, 16)),  # Llama-8B, a long chunk: 64 rows, 16 query tokens of 4 heads
        (32, 8, 1, (16, 4)),  # decodes only: the smallest tile that tl.dot takes
        (32, 8, 5, (32, 8)),
        (9, 3, 40, (64, 21)),  # a group of 3: 63 of 64 rows used
        (32, 1, 1, (32, 1)),  # a group larger than 16 rows sets the floor
        (128, 1, 64, (128, 1)),
    ],
)
def test_extend_tile(num_heads, num_kv_heads, max_query_len, tile):
    assert extend_tile(num_heads, num_kv_heads, max_query_len) == tile


def test_mixed_step_grid_is_sized_by_tokens_not_by_longest_chunk_times_batch():
    """One 1,793-token chunk beside 255 decodes, Llama-8B heads (32 / 8 kv): the issue's mixed step."""
    q_lens = [1793] + [1] * 255
    _, block_q = extend_tile(32, 8, max(q_lens))
    tiles, kv_heads = extend_grid(sum(q_lens), len(q_lens), 8, block_q)
    assert (tiles, kv_heads) == (2048 // 16 + 256, 8)
    assert tiles * kv_heads == 3_072
    # The grid before: ceil(max_query_len / block_q) tiles for every sequence.
    assert -(-1793 // block_q) * len(q_lens) * kv_heads == 231_424
    # Programs that do work: 113 tiles of the chunk and one per decode, for each kv head.
    assert (-(-1793 // block_q) + 255) * kv_heads == 2_944


@pytest.mark.parametrize("seed", range(20))
def test_every_tile_of_every_chunk_has_exactly_one_program(seed):
    """The kernel's search, replayed on the host: program t serves tile t - first_tile(b) of sequence b,
    the last b with first_tile(b) = query_start_loc[b] // block_q + b <= t; together the programs of the
    grid must cover each chunk's tiles once (empty chunks included)."""
    rng = random.Random(seed)
    block_q = rng.choice([1, 4, 5, 16, 21])
    q_lens = [rng.choice([0, 1, 1, 2, rng.randrange(1, 100)]) for _ in range(rng.randrange(1, 30))]
    starts = [sum(q_lens[:b]) for b in range(len(q_lens) + 1)]
    first_tile = [starts[b] // block_q + b for b in range(len(q_lens))]
    served = []
    for t in range(extend_grid(starts[-1], len(q_lens), 1, block_q)[0]):
        b = max(i for i, first in enumerate(first_tile) if first <= t)
        if (t - first_tile[b]) * block_q < q_lens[b]:
            served.append((b, t - first_tile[b]))
    assert served == [(b, i) for b, n in enumerate(q_lens) for i in range(-(-n // block_q))]
