"""Fused elementwise layers for CUDA: residual add + RMSNorm, rotary embedding, SiLU-and-multiply.

Each replaces several PyTorch ops (and as many launches and round trips through memory) of a decoder
layer with one kernel that reads its inputs once, computes in fp32 and rounds once per stored value,
where rounding must match transformers' own order of operations (RMSNorm rounds the sum and the
normalised value before the weight, as ``LlamaRMSNorm`` does in bf16). References: kernels/reference.py.
"""

import torch

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The new residual is stored in the activation dtype, and the norm reads that rounded sum.
        h = (h + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, h, mask=mask)
        h = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, hidden] view with unit stride along hidden (the kernels take one row stride)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, hidden)
    res_rows = res_out_rows = rows  # unused without a residual
    res_out = None
    if residual is not None:
        res_rows = _rows(residual)
        res_out = torch.empty_like(out)
        res_out_rows = res_out.view(-1, hidden)
    if rows.shape[0] == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        res_rows,
        weight,
        out_rows,
        res_out_rows,
        hidden,
        eps,
        rows.stride(0),
        res_rows.stride(0),
        out_rows.stride(0),
        res_out_rows.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dimension, fp32 inside, in ``x``'s dtype."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(x + residual), x + residual)``: a decoder layer's norm with the residual add
    of the sublayer before it, in one pass over the row."""
    out, new_residual = _norm(x, residual, weight, eps)
    return out, new_residual


@triton.jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    # Both buffers repeat their frequencies over the two halves; sin's first half is negated, so the
    # second half holds +sin.
    c = tl.load(cos_ptr + pos * stride_cos + cols, mask=col_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + HALF + cols, mask=col_mask, other=0.0)[None, :]
    mask = (heads[:, None] < num_heads) & col_mask[None, :]
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_embedding_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotates ``x [tokens, heads, head_dim]`` in place (rotate-half / NeoX layout) and returns it.

    ``x`` holds queries and keys together (a view of the fused QKV projection: rows may be strided, heads
    must be contiguous); ``positions [tokens]`` index ``cos``/``sin`` ``[max_position, head_dim]``, laid out
    as `inference_engine.layers.rotary.RotaryEmbedding` builds them: each frequency twice, and sin's first
    half negated. The rotation is computed in fp32 and rounded once.
    """
    tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"heads of x must be contiguous, got strides {tuple(x.stride())}")
    if cos.shape != sin.shape or cos.shape[-1] != head_dim or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(
            f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [max_position, {head_dim}]"
        )
    if tokens == 0:
        return x
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        x,
        positions,
        cos,
        sin,
        num_heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return x


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate_up projection ``[..., 2 * width]`` (gate first), fp32 inside."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {gate_up.shape[-1]}")
    width = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or width == 0:
        return out
    out_rows = out.view(-1, width)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, SILU_BLOCK))](
        rows, out_rows, width, rows.stride(0), out_rows.stride(0), BLOCK=SILU_BLOCK, num_warps=4
    )
    return out
