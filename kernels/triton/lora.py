"""The batched LoRA update on CUDA: a segmented gather matmul in the manner of Punica's SGMV.

The step's rows are sorted by adapter slot on the device, each slot's run padded to a multiple of
``BLOCK_M`` with an invalid row id, so every row block belongs to one slot (`block_slot`; the fused-MoE
kernels group by expert the same way: ``_common.group_rows``). The shrink launch gives each row block its
rows' ``x A_s^T`` (fp32, scaled); the expand launch gives each (row block, column block) ``B_s`` times that
and adds it to its rows of ``y``. Rows without an adapter (slot -1) are left out of the sort, so they cost
nothing.
Reference: ``reference.lora_ref``.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from ._common import INTERPRET, dot_precision, group_rows


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    scales_ptr,
    sorted_rows_ptr,
    block_slot_ptr,
    num_rows,
    stride_x,
    in_features,
    rank,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """t [sorted positions, rank] (fp32) = scales[s] * x[rows] A_s^T for this block's rows, s its slot."""
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    positions = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + positions).to(tl.int64)
    valid = rows < num_rows
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    a_rows = a_ptr + slot * rank * in_features + ranks.to(tl.int64) * in_features
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + ks
        k_ok = k < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        a = tl.load(a_rows[None, :] + k[:, None], mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    acc *= tl.load(scales_ptr + slot)
    out = t_ptr + positions.to(tl.int64)[:, None] * rank + ranks[None, :]
    tl.store(out, acc, mask=valid[:, None] & rank_ok[None, :])


@triton.jit
def _expand_kernel(
    t_ptr,
    b_ptr,
    y_ptr,
    sorted_rows_ptr,
    block_slot_ptr,
    num_rows,
    stride_y,
    out_features,
    rank,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[rows, cols] += t[positions] B_s^T for this block's rows and column block, s its slot."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    positions = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + positions).to(tl.int64)
    valid = rows < num_rows
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    t = tl.load(
        t_ptr + positions.to(tl.int64)[:, None] * rank + ranks[None, :],
        mask=valid[:, None] & rank_ok[None, :],
        other=0.0,
    )
    b_rows = b_ptr + slot * out_features * rank + cols.to(tl.int64) * rank
    b = tl.load(b_rows[None, :] + ranks[:, None], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
    delta = tl.dot(t, b.to(tl.float32), input_precision=PRECISION)
    out = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = valid[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """y [T, out] += scales[s] * (x @ lora_a[s].T) @ lora_b[s].T row by row with s = slots[t] (-1: none), as
    ``lora_ref`` defines it (x [T, in], lora_a [S, R, in], lora_b [S, out, R], scales [S] fp32); `y` may be
    a column slice of a wider output (its rows strided). Returns `y`."""
    num_slots, rank, in_features = lora_a.shape
    rows, out_features = y.shape
    if x.shape != (rows, in_features) or lora_b.shape != (num_slots, out_features, rank):
        raise ValueError(
            f"lora_add_: y {tuple(y.shape)}, x {tuple(x.shape)}, A {tuple(lora_a.shape)}, "
            f"B {tuple(lora_b.shape)} disagree"
        )
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("lora_add_: x and y need contiguous rows")
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    block_m = 16
    block_r = max(16, triton.next_power_of_2(rank))
    block_n, block_k = (32, 32) if INTERPRET else (64, 64)
    sorted_rows, block_slot = group_rows(slots, num_slots, block_m)
    blocks = block_slot.numel()
    if blocks == 0:
        return y
    t = torch.empty(blocks * block_m, rank, dtype=torch.float32, device=x.device)
    scales = scales.to(device=x.device, dtype=torch.float32).contiguous()
    precision = dot_precision(x.dtype)
    _shrink_kernel[(blocks,)](
        x, lora_a, t, scales, sorted_rows, block_slot, rows, x.stride(0), in_features, rank,
        PRECISION=precision, UPCAST=INTERPRET, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    _expand_kernel[(blocks, triton.cdiv(out_features, block_n))](
        t, lora_b, y, sorted_rows, block_slot, rows, y.stride(0), out_features, rank,
        PRECISION="ieee", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
    return y
