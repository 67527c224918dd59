"""Rotary position embeddings (rotate-half layout) with rope_theta and Llama-3 / linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from inference_engine.layers.norm import triton_fused
from kernels.cpu import fused as cpu_fused


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # Computed in fp32 exactly as transformers does, so fp32 runs match it bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not supported.")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Shared by every layer; the cos/sin rows of a step's positions are looked up once, by the first."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Laid out for the rotate-half form x * cos + rotate_half(x) * sin, with its sign folded into sin.
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), -1), persistent=False)
        self._positions: torch.Tensor | None = None
        self.triton = triton_fused() if torch.get_default_device().type == "cuda" else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim], queries and keys together. Computed in fp32, as transformers does;
        in place where a fused kernel runs (x is then returned), else into a new tensor."""
        if self.triton is not None:
            return self.triton.rotary_embedding_(x, positions, self.cos, self.sin)
        if cpu_fused.rotary_(x, positions, self.cos, self.sin):
            return x
        if positions is not self._positions:
            self._positions = positions
            self._cos, self._sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * self._cos + rotated * self._sin).to(x.dtype)
