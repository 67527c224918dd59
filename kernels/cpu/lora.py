"""The batched LoRA update on the CPU (`csrc/lora.c`): rows grouped by adapter slot, one shrink and one
expand over each adapter's rows, bf16 or fp32."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import function, i32, i64, ptr

_DTYPES = (torch.bfloat16, torch.float32)


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
) -> bool:
    """y [T, out] += scales[s] * (x @ lora_a[s].T) @ lora_b[s].T row by row with s = slots[t] (-1: none), as
    `reference.lora_ref` defines it (x [T, in], lora_a [S, R, in], lora_b [S, out, R]); `y` may be a column
    slice of a wider output. False where it can't run (no native library, another device or dtype)."""
    fn = function("lora_add", i32, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32)
    if (
        fn is None
        or any(t.device.type != "cpu" or t.dtype != x.dtype for t in (y, lora_a, lora_b))
        or x.dtype not in _DTYPES
        or x.stride(-1) != 1
        or y.stride(-1) != 1
        or not (lora_a.is_contiguous() and lora_b.is_contiguous())
    ):
        return False
    num_slots, rank, in_features = lora_a.shape
    rows, out_features = y.shape
    if x.shape != (rows, in_features) or lora_b.shape != (num_slots, out_features, rank):
        raise ValueError(
            f"lora_add_: y {tuple(y.shape)}, x {tuple(x.shape)}, A {tuple(lora_a.shape)}, "
            f"B {tuple(lora_b.shape)} disagree"
        )
    if rows == 0:
        return True
    slot_ids = slots.to(torch.int32).contiguous()
    scale = scales.to(torch.float32).contiguous()
    status = fn(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        slot_ids.data_ptr(),
        scale.data_ptr(),
        rows,
        in_features,
        out_features,
        rank,
        num_slots,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("lora_add_: no memory for the kernel's scratch buffers")
    return True
