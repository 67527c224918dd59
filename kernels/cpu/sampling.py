"""Sampling on the CPU (`csrc/sampling.c`): greedy argmax, which torch runs on one core, and batched
temperature / top-k / top-p / min-p sampling with speculative verification's acceptance test, which in
PyTorch would sort or cumsum every row of the vocabulary."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import function, i32, ptr


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Index of each row's maximum (first one; a NaN counts as the maximum) of fp32 [rows, vocab] logits,
    as torch.argmax(dim=-1) gives it, or None where this kernel can't run."""
    fn = function("argmax_rows_f32", None, ptr, i32, i32, ptr, i32)
    if fn is None or not _runs_on(logits):
        return None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    fn(logits.data_ptr(), rows, vocab, out.data_ptr(), _threads(rows, vocab))
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    draft: torch.Tensor,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token per row of fp32 [rows, vocab] logits, or None where this kernel can't run.

    Per row: temperature (f32, 0 for greedy), top_k (i32, 0 for off), top_p (f32), min_p (f32), draft (i64,
    the proposed token to verify, -1 for none) and uniforms ([rows, 2] f64: the acceptance test's and the
    draw's; None when every row is greedy). Returns (tokens i64, accepted bool): where a row's draft was
    accepted its token is the draft, else a draw from the row's distribution without the draft. The kept
    set and the draw are defined in `csrc/sampling.c`.
    """
    fn = function("sample_rows_f32", None, ptr, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32)
    if fn is None or not _runs_on(logits):
        return None
    rows, vocab = logits.shape
    expected = {
        "temperature": (temperature, torch.float32),
        "top_k": (top_k, torch.int32),
        "top_p": (top_p, torch.float32),
        "min_p": (min_p, torch.float32),
        "draft": (draft, torch.int64),
    }
    for name, (tensor, dtype) in expected.items():
        if tensor.dtype != dtype or tensor.shape != (rows,) or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{rows}] {dtype} tensor")
    if uniforms is None:
        if bool((temperature != 0).any()):
            raise ValueError("uniforms are needed where a row samples")
    elif uniforms.dtype != torch.float64 or uniforms.shape != (rows, 2) or not uniforms.is_contiguous():
        raise ValueError(f"uniforms must be a contiguous [{rows}, 2] float64 tensor")
    tokens = torch.empty(rows, dtype=torch.int64)
    accepted = torch.empty(rows, dtype=torch.bool)
    fn(
        logits.data_ptr(),
        rows,
        vocab,
        temperature.data_ptr(),
        top_k.data_ptr(),
        top_p.data_ptr(),
        min_p.data_ptr(),
        draft.data_ptr(),
        uniforms.data_ptr() if uniforms is not None else None,
        tokens.data_ptr(),
        accepted.data_ptr(),
        _threads(rows, vocab),
    )
    return tokens, accepted


def _threads(rows: int, vocab: int) -> int:
    """A thread per 256k logits (1 MiB), up to torch's thread count: starting and joining threads costs more
    than a smaller share of work saves, and every parallel region waits for its slowest thread."""
    return max(1, min(torch.get_num_threads(), rows, rows * vocab >> 18))


def _runs_on(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_contiguous()
        and logits.shape[1] > 0
    )
