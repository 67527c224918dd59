"""The fused mixture-of-experts MLP on CUDA: one launch per projection over every chosen expert.

The step's (token, expert) pairs are sorted by expert on the host, each expert's run padded to a multiple of
``BLOCK_M`` with an invalid pair id, so that every row block of the sorted list belongs to one expert
(`block_expert`). A program owns one row block and a ``BLOCK_N`` slice of the projection's outputs: it
gathers its tokens' rows, multiplies them by its expert's weight tile and scatters the results back to the
pairs' own rows. An expert no token chose owns no block, so its weights are never read. Reference:
``reference.fused_moe_ref``.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from ._common import INTERPRET, dot_precision, group_rows


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    top_k,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """act [pairs, inter] (fp32) = silu(x gate_e^T) * (x up_e^T) for this block's pairs, e its expert."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    gate_rows = w13_ptr + expert * 2 * inter * hidden + cols.to(tl.int64) * hidden
    up_rows = gate_rows + inter * hidden
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden
        x = tl.load(
            x_ptr + tokens[:, None] * hidden + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(gate_rows[None, :] + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(up_rows[None, :] + k[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(x, wg, gate, input_precision=PRECISION)
        up = tl.dot(x, wu, up, input_precision=PRECISION)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = act_ptr + pairs.to(tl.int64)[:, None] * inter + cols[None, :]
    tl.store(out, act, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    y_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y [pairs, hidden] (fp32) = weight_pair * act down_e^T for this block's pairs, e its expert."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    down_rows = w2_ptr + expert * hidden * inter + cols.to(tl.int64) * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        k_ok = k < inter
        a = tl.load(
            act_ptr + pairs[:, None] * inter + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(down_rows[None, :] + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        else:  # the activations in the weights' dtype, as a dense down projection takes them
            a = a.to(w.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    scale = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
    out = y_ptr + pairs[:, None] * hidden + cols[None, :]
    tl.store(out, acc * scale[:, None], mask=valid[:, None] & col_ok[None, :])


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), as ``fused_moe_ref`` defines
    it (x [T, H], w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I])."""
    experts, double_inter, hidden = w13.shape
    inter = double_inter // 2
    tokens, top_k = topk_ids.shape
    if x.shape != (tokens, hidden) or w2.shape != (experts, hidden, inter):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} disagree"
        )
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if pairs <= 64 * experts else 64
    block_n, block_k = (32, 32) if INTERPRET else (64, 64)
    sorted_pairs, block_expert = group_rows(topk_ids, experts, block_m)
    blocks = block_expert.numel()
    act = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.to(torch.float32).flatten().contiguous()
    common = dict(
        PRECISION=dot_precision(x.dtype), UPCAST=INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k
    )
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, act, sorted_pairs, block_expert, pairs, hidden, inter, top_k, **common
    )
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, w2, y, weights, sorted_pairs, block_expert, pairs, hidden, inter, **common
    )
    return y.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
