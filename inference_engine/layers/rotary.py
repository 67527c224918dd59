"""Rotary position embeddings (rotate-half layout) with rope_theta and Llama-3 / linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


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
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
