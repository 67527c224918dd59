"""The fused mixture-of-experts MLP on the CPU (`csrc/moe.c`): the step's tokens grouped by expert, each
chosen expert's gate/up and down run once over its group; fp32 or bf16 weights, or int8 ones with a scale per
group of inputs (GGUF's Q8_0 experts, kept as they load).

With bf16 activations an expert that has `GROUPED_TOKENS` tokens or more in a step (a prompt's) runs as two
grouped matmuls through the dense bf16 kernel's routines (AMX tiles where the CPU has them, as this
machine's plan for dense layers times them), its weights dequantized a tile at a time; fewer tokens (decode)
multiply the weights as stored in fp32. The two round differently, so a token's output can depend on how
many tokens share its experts in a step once one of them reaches `GROUPED_TOKENS`."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import function, i32, ptr
from llmserve_kernels.cpu.linear_pack import _amx_rows, _fma_rows

_ACTIVATIONS = (torch.bfloat16, torch.float32)
_WEIGHTS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
GROUPED_TOKENS = 16  # an expert's tokens in a step from which it runs grouped (bf16 activations)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """out [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) as `reference.fused_moe_ref`
    defines it (x [T, H], w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]); None where it can't run
    (no native library, another device or dtype). int8 weights come with `scales`: fp32 [E, 2I, H / g] and
    [E, H, I / g'], weight = scale * q over each group of g (g') inputs; float weights in x's dtype."""
    fn = function("moe_forward", i32, *[ptr] * 8, *[i32] * 13)
    quantized = w13.dtype == torch.int8
    tensors = (x, w13, w2, *(scales or ()))
    if (
        fn is None
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
        or x.dtype not in _ACTIVATIONS
        or w2.dtype != w13.dtype
        or (w13.dtype != x.dtype and not quantized)
        or quantized != (scales is not None)
    ):
        return None
    experts, double_inter, hidden = w13.shape
    tokens, top_k = topk_ids.shape
    if x.shape != (tokens, hidden) or w2.shape != (experts, hidden, double_inter // 2):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} disagree"
        )
    groups = (0, 0)
    if quantized:
        groups = (hidden // scales[0].shape[-1], double_inter // 2 // scales[1].shape[-1])
        if (
            scales[0].shape != (experts, double_inter, hidden // groups[0])
            or scales[1].shape != (experts, hidden, double_inter // 2 // groups[1])
            or hidden % groups[0]
            or double_inter // 2 % groups[1]
        ):
            raise ValueError(f"fused_moe: scales {[tuple(s.shape) for s in scales]} do not group the weights")
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    status = fn(
        x.data_ptr(),
        w13.data_ptr(),
        w2.data_ptr(),
        scales[0].data_ptr() if quantized else None,
        scales[1].data_ptr() if quantized else None,
        ids.data_ptr(),
        weights.data_ptr(),
        out.data_ptr(),
        tokens,
        hidden,
        double_inter // 2,
        experts,
        top_k,
        int(x.dtype == torch.bfloat16),
        _WEIGHTS[w13.dtype],
        *groups,
        *((GROUPED_TOKENS, _fma_rows(), _amx_rows()) if x.dtype == torch.bfloat16 else (0, 0, 0)),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("fused_moe: no memory for the kernel's scratch buffers")
    return out
