"""Rotary position embeddings (rotate-half layout): rope_theta, partial rotation and the scaling variants
checkpoints declare (`linear`, `dynamic`, `llama3`, `yarn`, `longrope`), computed as transformers computes
them so fp32 runs match it."""

from __future__ import annotations

import math

import torch
from torch import nn

from inference_engine.layers.norm import triton_fused
from llmserve_kernels.cpu import fused as cpu_fused

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(dim: int, theta: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def rope_angles(
    dim: int, theta: float, scaling: dict | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """The rotation angle of every (position, frequency) [max_position, dim / 2] and the factor cos and sin
    are scaled by. `dynamic` equals the default up to the checkpoint's max_position_embeddings, the longest
    sequence the engine serves; `longrope` takes its short factors below original_max_position_embeddings
    and its long ones from there (as vLLM does: transformers switches every position of a sequence at once,
    which a KV cache cannot)."""
    s = scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    positions = torch.arange(max_position, dtype=torch.float32)
    attention = 1.0
    if kind == "longrope":
        old_len = s["original_max_position_embeddings"]
        factor = s.get("factor") or max_position / old_len
        attention = s.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta**shape)
        long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * theta**shape)
        angles = torch.outer(positions, short)
        angles[old_len:] = torch.outer(positions[old_len:], long)
        return angles, float(attention)
    inv_freq = _base_inv_freq(dim, theta)
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, s)
    elif kind == "yarn":
        inv_freq, attention = _yarn(dim, theta, s, max_position)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (supported: {ROPE_TYPES}).")
    return torch.outer(positions, inv_freq), attention


class RotaryEmbedding(nn.Module):
    """Shared by the layers that rotate alike; the cos/sin rows of a step's positions are looked up once.
    With `rotary_dim` below head_dim (partial rotation, Phi-4-mini) only each head's first rotary_dim
    features turn."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.partial = self.rotary_dim != head_dim
        angles, attention = rope_angles(self.rotary_dim, theta, scaling, max_position)
        cos, sin = angles.cos() * attention, angles.sin() * attention
        # Laid out for the rotate-half form x * cos + rotate_half(x) * sin, with its sign folded into sin.
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1), persistent=False)
        self._positions: torch.Tensor | None = None
        self.triton = triton_fused() if torch.get_default_device().type == "cuda" else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim], queries and keys together. Computed in fp32, as transformers does;
        in place where a fused kernel runs (x is then returned), else into a new tensor."""
        if self.triton is not None and not self.partial:
            return self.triton.rotary_embedding_(x, positions, self.cos, self.sin)
        turning = x[..., : self.rotary_dim] if self.partial else x
        if cpu_fused.rotary_(turning, positions, self.cos, self.sin):
            return x
        if self.partial:
            x[..., : self.rotary_dim] = self._rotate(positions, turning)
            return x
        return self._rotate(positions, x)

    def _rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if positions is not self._positions:
            self._positions = positions
            self._cos, self._sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * self._cos + rotated * self._sin).to(x.dtype)
