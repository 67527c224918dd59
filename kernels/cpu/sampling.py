"""Sampling on the CPU (`csrc/argmax.c`): greedy argmax, which torch runs on one core."""

from __future__ import annotations

import torch

from kernels.cpu._build import function, i32, ptr


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Index of each row's maximum (first one; a NaN counts as the maximum) of fp32 [rows, vocab] logits,
    as torch.argmax(dim=-1) gives it, or None where this kernel can't run."""
    fn = function("argmax_rows_f32", None, ptr, i32, i32, ptr, i32)
    if (
        fn is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or not logits.is_contiguous()
        or logits.shape[1] == 0
    ):
        return None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    fn(logits.data_ptr(), rows, vocab, out.data_ptr(), torch.get_num_threads())
    return out
