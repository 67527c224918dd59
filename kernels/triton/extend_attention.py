"""Causal attention of a step's query tokens over their sequences' paged K/V, on one grid for mixed steps.

One kernel covers prefill (no cached prefix), chunked prefill, prefix-cache hits and single-token decode:
query token ``i`` of a chunk of ``q_len`` tokens sits at position ``seq_len - q_len + i`` and sees cache
positions ``0..position``. The chunk's own K/V are already in the cache, so the kernel reads only the cache.

A program owns a tile of ``BLOCK_M`` rows for one kv head: ``BLOCK_Q = BLOCK_M // GROUP`` consecutive query
tokens of one sequence times the ``GROUP`` query heads that share the kv head (GQA), so each K/V chunk is
loaded once for the whole group. It streams the sequence's K/V in ``BLOCK_N`` chunks through the block
table, flash-attention style, from the first position any of its rows can see (0, or with a sliding
window its first row's window start) to the last.

The grid is sized by the step's total query tokens plus its sequences, as vLLM's unified attention does,
rather than by the longest chunk times the batch: sequence ``b`` owns the tiles from
``query_start_loc[b] // BLOCK_Q + b`` on, which leaves it at least ``ceil(q_len / BLOCK_Q)`` of them, and a
program finds its sequence by a binary search over ``query_start_loc`` on the device. One 1,793-token chunk
beside 255 single-token decodes (32 heads, 8 kv heads) thus launches 384 x 8 programs instead of
113 x 256 x 8, so mixed prefill+decode steps no longer pay for a mostly idle grid; the grid depends only on
host-side shapes, so building it needs no device sync.
"""

import torch

import triton
import triton.language as tl

from ._common import INTERPRET, LOG2E, dot_precision, head_block, require_last_dim_contiguous, tanh

MIN_BLOCK_M = 16  # tl.dot needs 16 rows
MAX_BLOCK_M = 64  # rows per tile for long chunks; more when a GQA group is larger
BLOCK_N = 64


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2e,
    softcap_log2e,
    window,
    batch,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence of this tile: the last b whose first tile, query_start_loc[b] // BLOCK_Q + b, is <= tile.
    # First tiles strictly increase with b, so the search is well defined even for empty chunks.
    lo = tl.full([], 0, tl.int32)
    hi = lo + batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        starts_at_or_before = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(starts_at_or_before, mid, lo)
        hi = tl.where(starts_at_or_before, hi, mid)
    seq = lo

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = tile - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # a sequence may own one tile more than its chunk needs
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    # Row r of the tile: query token q_block * BLOCK_Q + r // GROUP of the chunk, head r % GROUP of the group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + q_idx
    tokens = (q_start + q_idx).to(tl.int64)
    q_offsets = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    o_offsets = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    io_mask = row_mask[:, None] & d_mask[None, :]

    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The tile's last query token sees up to (and including) its own position; with a window, its first
    # token nothing before its window's start.
    kv_end = prefix_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    kv_start = tl.maximum(prefix_len + q_block * BLOCK_Q - window + 1, 0) if USE_WINDOW else 0

    # Without a window position 0 is visible to every row, so m_i is finite after the first iteration (no
    # inf - inf later); with one, a row may see nothing in the first iterations (see m_shift).
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = pos % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kb + in_page * stride_ks + kv_head * stride_kh
        v_rows = page * stride_vb + in_page * stride_vs + kv_head * stride_vh

        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        if USE_SOFTCAP:  # c tanh(x / c) of the natural score x, in base 2 as s is
            s = softcap_log2e * tanh(s / softcap_log2e)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf: shift by 0 there, so its weights are 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new) if USE_WINDOW else m_new
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if USE_WINDOW:  # a padding row past the chunk's end may see no key at all
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def extend_tile(num_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int]:
    """(rows, query tokens) of a tile: just enough rows for the longest chunk's GQA group, 16 to 64.

    Steps of short chunks (speculative verification, small chunked-prefill pieces) take small tiles and
    waste fewer rows; long chunks take 64 rows, so that each K/V chunk read serves more queries.
    """
    group = num_heads // num_kv_heads
    smallest = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    largest = max(MAX_BLOCK_M, smallest)
    block_m = min(max(smallest, triton.next_power_of_2(group * max(1, max_query_len))), largest)
    return block_m, block_m // group


def extend_grid(num_tokens: int, batch: int, num_kv_heads: int, block_q: int) -> tuple[int, int]:
    """The launch grid, (query tiles, kv heads): every sequence gets ``query_start_loc[b] // block_q + b``
    as its first tile, so ``num_tokens // block_q + batch`` tiles cover every chunk of the step."""
    return num_tokens // block_q + batch, num_kv_heads


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of the concatenated chunks ``q [num_tokens, num_heads, head_dim]`` over the cache.

    ``query_start_loc`` (``[batch+1]``, int32) delimits each sequence's chunk; rows of ``q`` past
    ``query_start_loc[-1]`` (padding) are left unwritten in ``out``. ``seq_lens[b]`` counts its cached tokens
    after this chunk was stored. ``max_query_len``, the longest chunk, only picks the tile size (the result
    does not depend on it). ``out`` (optional) receives the result. ``window`` > 0: a query at position p
    sees keys p - window + 1 to p; ``softcap`` > 0: scores are ``softcap * tanh(score / softcap)`` after
    scaling (0: neither).
    Reference: `llmserve_kernels.reference.paged_extend_attention_ref`.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    require_last_dim_contiguous(q, k_cache, v_cache)
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must not be negative, got {window} and {softcap}")
    block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    require_last_dim_contiguous(out)

    block_m, block_q = extend_tile(num_heads, num_kv_heads, max_query_len)
    _extend_kernel[extend_grid(num_tokens, batch, num_kv_heads, block_q)](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        softcap * LOG2E,
        window,
        batch,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        PAGE_SIZE=page_size,
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        UPCAST=INTERPRET,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
