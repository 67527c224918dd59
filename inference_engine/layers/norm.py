from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve_kernels.cpu import fused as cpu_fused


def triton_fused():
    """The Triton fused layers (imported only where the model is built for CUDA)."""
    from llmserve_kernels.triton import fused

    return fused


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, with the residual add fused in (returns the new residual too): one Triton
    kernel on CUDA, the native kernel on a CPU in bf16, PyTorch otherwise."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.triton = triton_fused() if torch.get_default_device().type == "cuda" else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.triton is not None:
            if residual is None:
                return self.triton.rms_norm(x, self.weight, self.eps)
            return self.triton.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            fused = cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = x + residual
            residual = x
        else:
            normed = cpu_fused.rms_norm(x, self.weight, self.eps)
            if normed is not None:
                return normed
        # One op instead of seven small ones, fp32 inside. Identical to transformers' LlamaRMSNorm in fp32;
        # in bf16 it rounds once where transformers rounds twice (the native kernels above round twice).
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else (out, residual)
