"""Linear layers on CUDA: dense weights through cuBLAS, quantized ones (`kernels.quantized`) kept packed.

The same interface as `kernels.cpu.linear`: `pack` once at load, `linear(x, packed)` every step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels.quantized import QuantizedWeight


@dataclass
class PackedLinear:
    out_features: int
    in_features: int
    dense: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None

    @property
    def nbytes(self) -> int:
        tensors = [self.dense]
        if self.quantized is not None:
            tensors += [getattr(self.quantized, name, None) for name in ("q", "scale", "offset", "perm")]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, keep_rows: bool = False, pad: bool = False
) -> PackedLinear:
    out_features, in_features = weight.shape
    if isinstance(weight, torch.Tensor):
        return PackedLinear(out_features, in_features, dense=weight.to(dtype))
    return PackedLinear(out_features, in_features, quantized=weight)


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed.quantized is not None:
        return F.linear(x, packed.quantized.dequantize().to(x.dtype), bias)
    return F.linear(x, packed.dense, bias)


def embedding(ids: torch.Tensor, packed: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    if packed.quantized is not None:
        q = packed.quantized
        names = ("q", "scale", "offset") if hasattr(q, "offset") else ("q", "scale")
        return replace(q, **{n: getattr(q, n).index_select(0, ids) for n in names}).dequantize().to(dtype)
    return F.embedding(ids, packed.dense)
