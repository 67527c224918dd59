"""Causal attention of a chunk of new query tokens over a sequence's paged K/V.

One kernel covers prefill (no cached prefix), chunked prefill, prefix-cache hits and single-token decode:
query token ``i`` of a chunk of ``q_len`` tokens sits at position ``seq_len - q_len + i`` and sees cache
positions ``0..position``. The chunk's own K/V are already in the cache, so the kernel reads only the cache.

A program owns a tile of ``BLOCK_M`` rows for one kv head: ``BLOCK_M // GROUP`` consecutive query tokens
times the ``GROUP`` query heads that share the kv head (GQA), so each K/V chunk is loaded once for the whole
group and short chunks (decode, small chunked-prefill steps) still fill the tile. It streams the sequence's
K/V in ``BLOCK_N`` chunks through the block table, flash-attention style, and stops at the last position any
of its rows can see.
"""

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, LOG2E, dot_precision, require_last_dim_contiguous

MIN_BLOCK_M = 64  # rows per tile; more when a GQA group is larger
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
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest chunk
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
    # The tile's last query token sees up to (and including) its own position.
    kv_end = prefix_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)

    # Position 0 is visible to every row, so m_i is finite after the first iteration (no inf - inf later).
    for n0 in range(0, kv_end, BLOCK_N):
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
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


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
) -> torch.Tensor:
    """Causal attention of the concatenated chunks ``q [num_tokens, num_heads, head_dim]`` over the cache.

    ``query_start_loc`` (``[batch+1]``) delimits each sequence's chunk; ``seq_lens[b]`` counts its cached
    tokens after this chunk was stored. ``out`` (optional) receives the result.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    require_last_dim_contiguous(q, k_cache, v_cache)
    block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    require_last_dim_contiguous(out)

    group = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group  # query tokens per tile
    grid = (triton.cdiv(max_query_len, block_q), batch, num_kv_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
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
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        UPCAST=INTERPRET,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
