"""The two weight-only quantized formats every quantized linear kernel takes.

Checkpoint formats are converted to one of these when a model loads (GGUF Q4_0/Q4_1/Q4_K and AWQ/GPTQ
become `Int4Weight`; GGUF Q8_0/Q6_K and on-load int8 become `Int8Weight`), and each backend then
packs them once into the layout its kernels read best (cpu/linear.py, triton/linear.py).
Rows are output features and columns input features, as in a torch linear weight, so tensor-parallel
sharding and the fusing of projections (QKV, gate+up) work on these forms like on dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Int4Weight:
    """w[o, i] = scale[o, i // group_size] * q[o, i] + offset[o, i // group_size], with q in 0..15.

    Both asymmetric forms meet here: GGUF's d * q + m (Q4_1, Q4_K) and AWQ/GPTQ's s * (q - z), whose
    offset -s * z is exact in fp32. `perm` is GPTQ's act-order: the stored columns are the input
    channels in that order (groups contiguous), so the layer multiplies x[:, perm] by them.
    """

    q: torch.Tensor  # uint8 [out, in], one 4-bit value per byte
    scale: torch.Tensor  # float32 [out, in // group_size]
    offset: torch.Tensor  # float32 [out, in // group_size]
    group_size: int
    perm: torch.Tensor | None = None  # int64 [in]

    bits = 4

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, columns in input order (the reference every kernel is tested against)."""
        g = self.group_size
        w = self.q.float() * self.scale.repeat_interleave(g, 1) + self.offset.repeat_interleave(g, 1)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        if dim == 0:
            return replace(
                self,
                q=self.q.narrow(0, start, length),
                scale=self.scale.narrow(0, start, length),
                offset=self.offset.narrow(0, start, length),
            )
        _check_group_split(self, start, length)
        g = self.group_size
        return replace(
            self,
            q=self.q.narrow(1, start, length),
            scale=self.scale.narrow(1, start // g, length // g),
            offset=self.offset.narrow(1, start // g, length // g),
        )

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Fuses projections of the same input (rows of each part one after the other)."""
        first = parts[0]
        _check_fusable(parts)
        return replace(
            first,
            q=torch.cat([p.q for p in parts]),
            scale=torch.cat([p.scale for p in parts]),
            offset=torch.cat([p.offset for p in parts]),
        )


@dataclass
class Int8Weight:
    """w[o, i] = scale[o, i // group_size] * q[o, i], with q in -128..127 (per channel: group = in)."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in // group_size]
    group_size: int
    perm = None

    bits = 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.repeat_interleave(self.group_size, 1)

    def narrow(self, dim: int, start: int, length: int) -> Int8Weight:
        if dim == 0:
            return replace(self, q=self.q.narrow(0, start, length), scale=self.scale.narrow(0, start, length))
        _check_group_split(self, start, length)
        g = self.group_size
        return replace(
            self, q=self.q.narrow(1, start, length), scale=self.scale.narrow(1, start // g, length // g)
        )

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        _check_fusable(parts)
        return replace(parts[0], q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-output-channel int8 of a dense weight (the `int8` on-load quantization)."""
        w = weight.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
        return cls(q=q, scale=scale, group_size=w.shape[1])


QuantizedWeight = Int4Weight | Int8Weight


def _check_group_split(weight: QuantizedWeight, start: int, length: int) -> None:
    g = weight.group_size
    if weight.perm is not None and (start, length) != (0, weight.shape[1]):
        raise ValueError("an act-order (GPTQ desc_act) weight cannot be split along its input features.")
    if start % g or length % g:
        raise ValueError(
            f"cannot split {weight.shape[1]} quantized input features at {start}:{start + length}: the "
            f"split must fall on the quantization groups of {g}."
        )


def _check_fusable(parts: list[QuantizedWeight]) -> None:
    first = parts[0]
    for p in parts[1:]:
        if type(p) is not type(first) or p.group_size != first.group_size or p.shape[1] != first.shape[1]:
            raise ValueError("fused projections must share one quantized format and group size.")
        if (p.perm is None) != (first.perm is None) or (
            p.perm is not None and not torch.equal(p.perm, first.perm)
        ):
            raise ValueError("fused act-order projections must share one input order.")
