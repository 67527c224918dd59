"""The fused mixture-of-experts MLP on the CPU (`csrc/moe.c`): the step's tokens grouped by expert, each
chosen expert's gate/up and down run once over its group, bf16 or fp32 weights."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import function, i32, ptr

_DTYPES = (torch.bfloat16, torch.float32)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """out [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) as `reference.fused_moe_ref`
    defines it (x [T, H], w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]); None where it can't run
    (no native library, another device or dtype)."""
    fn = function("moe_forward", i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32)
    tensors = (x, w13, w2)
    if (
        fn is None
        or any(t.device.type != "cpu" or t.dtype != x.dtype or not t.is_contiguous() for t in tensors)
        or x.dtype not in _DTYPES
    ):
        return None
    experts, double_inter, hidden = w13.shape
    tokens, top_k = topk_ids.shape
    if x.shape != (tokens, hidden) or w2.shape != (experts, hidden, double_inter // 2):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} disagree"
        )
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    status = fn(
        x.data_ptr(),
        w13.data_ptr(),
        w2.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        out.data_ptr(),
        tokens,
        hidden,
        double_inter // 2,
        experts,
        top_k,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("fused_moe: no memory for the kernel's scratch buffers")
    return out
