"""Paged decode attention with split-K ("flash decoding").

Decode is bound by reading K/V, so the kernel is shaped around reading each cached K/V row exactly once:

* one program per (sequence, kv head, split) serves all query heads of that kv head (GQA grouping), the
  group padded to 16 rows so that both products run on tensor cores;
* each iteration gathers ``BLOCK_N`` tokens through the block table (several pages when pages are small);
* with a sliding window (``window`` > 0) the splits cover only the window's keys, so a long context with a
  short window reads no more than the window;
* a long context is cut into up to ``num_splits`` parts so that a few long sequences still occupy every SM;
  each part writes its running max, softmax denominator and unnormalised accumulator, and a second small
  kernel merges the parts.

``num_splits`` only sizes the grid; each sequence's own split length is decided on the device from its
length (never below ``MIN_TOKENS_PER_SPLIT``), and the splits past its end store nothing to merge. So one
``num_splits`` per batch size, chosen once from the longest context the engine allows, serves every step:
that is what a CUDA graph captured for that batch size needs, since nothing host-side may change per replay.
"""

import torch

import triton
import triton.language as tl

from ._common import (
    INTERPRET,
    LOG2E,
    dot_precision,
    head_block,
    require_last_dim_contiguous,
    sm_count,
    tanh,
)

BLOCK_N = 64  # tokens gathered per iteration
MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows
MIN_TOKENS_PER_SPLIT = 128  # a multiple of BLOCK_N; below it a split costs more in merging than it wins
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    scale_log2e,
    softcap_log2e,
    window,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # The keys the query sees: the last `window` of them with a window, else all.
    first = tl.maximum(seq_len - window, 0) if USE_WINDOW else 0
    # Whole BLOCK_N chunks per split, so only a split's last chunk is ragged; a short sequence takes fewer,
    # longer splits than the grid has (merging costs more than the parallelism wins below the minimum).
    tokens_per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    start = first + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Every iteration holds at least one valid token, so m_i is finite after the first one (no inf - inf).
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
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
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Partial buffers are [batch, num_heads, num_splits] (+ [HEAD_DIM] for acc), contiguous.
    # An empty split (start >= end) stores max=-inf, sum=0, acc=0, which the merge weighs as zero.
    row = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
    tl.store(part_max_ptr + row, m_i, mask=h_mask)
    tl.store(part_sum_ptr + row, l_i, mask=h_mask)
    tl.store(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        acc,
        mask=h_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    row = (seq * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Empty splits (max -inf) weigh zero. All splits are empty only for seq_len 0 (a padding row of a
    # captured batch): its output is zero rather than NaN.
    m_all = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0))
    denominator = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denominator > 0, denominator, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Enough splits for about two programs per SM, but no split shorter than ``MIN_TOKENS_PER_SPLIT``.

    A host-side function of shapes only. For CUDA graphs the engine calls it once per captured batch size
    with the longest context it serves (``max_model_len``) and ``sm_count(device)``, and passes the result
    to every replay of that size: shorter sequences then use fewer of the splits, as the kernel decides on
    the device.
    """
    wanted = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V; returns ``[batch, num_heads, head_dim]``.

    ``seq_lens[b]`` counts cached tokens including the current one; a row with ``seq_lens[b] == 0`` (batch
    padding) gets zeros. ``num_splits`` (at least 1) sizes the grid; by default it comes from the block
    table's width, see `choose_num_splits`. ``out`` (optional) receives the result. ``window`` > 0: the
    query sees only the last ``window`` keys (itself included); ``softcap`` > 0: scores are
    ``softcap * tanh(score / softcap)`` after scaling (0: neither).
    Reference: `llmserve_kernels.reference.paged_decode_attention_ref`.
    """
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    require_last_dim_contiguous(q, k_cache, v_cache)
    block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    require_last_dim_contiguous(out)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, num_kv_heads, block_tables.shape[1] * page_size, sm_count(q.device)
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must not be negative, got {window} and {softcap}")
    group = num_heads // num_kv_heads

    part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    block_d = head_block(head_dim)

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_max,
        part_sum,
        part_acc,
        scale * LOG2E,
        softcap * LOG2E,
        window,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_H=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        MIN_SPLIT=MIN_TOKENS_PER_SPLIT,
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        UPCAST=INTERPRET,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=3,  # K/V loads in flight; with 2, ptxas for sm_90 spills at head_dim 64 (compile_check)
    )
    _decode_merge_kernel[(batch, num_heads)](
        part_max,
        part_sum,
        part_acc,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=1 if head_dim <= 64 else 2,
    )
    return out
