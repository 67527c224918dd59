"""Fused elementwise layers on the CPU, bf16 (`csrc/fused_ops.c`): residual add + RMSNorm, rotary; the gated
MLP's activations (`csrc/decoder.c`, which the native decoder runs too, so both paths give the same bits)."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import f32, function, i32, i64, ptr


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight * rmsnorm(x + residual), x + residual) for bf16 rows, or None where it can't run."""
    fn = function("add_rms_norm_bf16", None, ptr, ptr, ptr, ptr, ptr, i32, i32, f32, i32)
    if fn is None or not _bf16_rows(x, residual, weight) or x.shape != residual.shape:
        return None
    new_residual, out = torch.empty_like(x), torch.empty_like(x)
    hidden = x.shape[-1]
    fn(
        x.data_ptr(),
        residual.data_ptr(),
        new_residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return out, new_residual


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates x [tokens, heads, rotary_dim] in place, with cos/sin [positions, rotary_dim]; False where it
    can't run. Rows and heads may be strided: x may be the first rotary_dim features of each head (partial
    rotation, ``x[..., :rotary_dim]``), the rest left alone."""
    fn = function("rotary_heads_bf16", None, ptr, i64, i64, ptr, ptr, ptr, i32, i32, i32, i32)
    if (
        fn is None
        or x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or x.stride(2) != 1
        or x.stride(1) < x.shape[2]
        or positions.dtype != torch.int64
        or not (positions.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
        or cos.dtype != torch.float32
        or cos.shape[-1] != x.shape[2]
    ):
        return False
    tokens, heads, rotary_dim = x.shape
    fn(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        rotary_dim,
        torch.get_num_threads(),
    )
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * rmsnorm(x) for bf16 rows, rounded as `add_rms_norm` rounds, or None where it can't run."""
    fn = function("rms_norm_bf16", None, ptr, ptr, ptr, i32, i32, f32)
    if fn is None or not _bf16_rows(x, weight):
        return None
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of bf16 rows [..., 2 * width] (gate first), rounded as F.silu(gate).mul_(up) (within
    a bf16 ulp: its own exp), or None where it can't run."""
    return _gated("silu_mul_bf16", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up of bf16 rows [..., 2 * width] (gate first, Gemma's MLP), rounded as
    F.gelu(gate, approximate="tanh").mul_(up) rounds, or None where it can't run. Within a bf16 ulp of the
    exact GELU: where PyTorch's 1 + tanh cancels (gate below about -3) it keeps more digits than PyTorch."""
    return _gated("gelu_tanh_mul_bf16", gate_up)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    """act(gate) * up through the native kernel `kernel`, which both gated activations share the shape of."""
    fn = function(kernel, None, ptr, ptr, i32, i32, i32)
    if fn is None or not _bf16_rows(gate_up) or gate_up.shape[-1] % 2:
        return None
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width), width, torch.get_num_threads())
    return out
