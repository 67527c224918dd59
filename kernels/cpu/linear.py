"""Linear layers on the CPU: weights packed once at load, then `linear(x, packed)` every step.

Dense bf16 weights are prepacked into oneDNN's blocked layout, which `F.linear` otherwise redoes on
every call; quantized weights (`kernels.quantized`) are kept in their packed form and multiplied from
it. Which routine runs for a given number of rows is decided when the weight is packed, not per call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

from kernels.quantized import QuantizedWeight
from kernels.timing import best_time

_PACK_BATCH_HINT = 32  # oneDNN picks its layout for this many rows; measured as good for 1..2048 rows
_PADDED_ROWS = 33


@cache
def prepacking_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear is present and gives F.linear's exact result for `dtype`."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(5, 64, dtype=dtype), torch.randn(48, 64, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        return torch.equal(_onednn(x, packed, None), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@cache
def _padding_pays(out_features: int, in_features: int, runs: int = 5) -> bool:
    """Whether this CPU's oneDNN runs a packed [out, in] weight a tenth or more faster on 33 rows than
    on 24 (with AMX it does for the LM head: [26, 576] x [576, 49152] 6.7 ms, [33, 576] 3.9 ms; on an
    AVX512-BF16 CPU without AMX padding is the slower one), so a step of 17-32 rows is best padded."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    plain, padded = (
        torch.randn(n, in_features, generator=gen).to(torch.bfloat16) for n in (24, _PADDED_ROWS)
    )
    plain_time = best_time(lambda: _onednn(plain, packed, None), runs)
    return best_time(lambda: _onednn(padded, packed, None), runs) < 0.9 * plain_time


@dataclass
class PackedLinear:
    """A weight in the layout this module's kernels read; `plain` keeps a dense weight for row lookups
    (a tied embedding) where the packed layout cannot serve them."""

    out_features: int
    in_features: int
    dense: torch.Tensor | None = None  # plain or oneDNN-packed dense weight
    onednn: bool = False
    quantized: QuantizedWeight | None = None
    plain: torch.Tensor | None = None
    padded_rows: range = range(0)  # row counts run padded to _PADDED_ROWS (oneDNN, where faster)

    @property
    def nbytes(self) -> int:
        tensors = [self.dense, self.plain]
        if self.quantized is not None:
            tensors += [getattr(self.quantized, name, None) for name in ("q", "scale", "offset", "perm")]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, keep_rows: bool = False, pad: bool = False
) -> PackedLinear:
    """Packs a weight for activations of `dtype`. `keep_rows`: the weight also serves `embedding`
    lookups. `pad`: time whether steps of 17-32 rows run faster padded to 33 (large heads)."""
    out_features, in_features = weight.shape
    if not isinstance(weight, torch.Tensor):
        return PackedLinear(out_features, in_features, quantized=weight)
    weight = weight.to(dtype)
    if dtype != torch.bfloat16 or not prepacking_works(dtype):
        return PackedLinear(out_features, in_features, dense=weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    result = PackedLinear(out_features, in_features, dense=packed, onednn=True)
    if keep_rows:
        result.plain = weight
    if pad and _padding_pays(out_features, in_features):
        result.padded_rows = range(17, _PADDED_ROWS)
    return result


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] -> [rows, out] in x's dtype."""
    if packed.quantized is not None:
        w = packed.quantized.dequantize().to(x.dtype)
        return F.linear(x, w, bias)
    if not packed.onednn:
        return F.linear(x, packed.dense, bias)
    rows = x.shape[0]
    if rows in packed.padded_rows:
        return _onednn(F.pad(x, (0, 0, 0, _PADDED_ROWS - rows)), packed.dense, bias)[:rows]
    return _onednn(x, packed.dense, bias)


def embedding(ids: torch.Tensor, packed: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized to `dtype` (embedding lookups of a tied weight)."""
    if packed.quantized is not None:
        q = packed.quantized
        return replace(q, **_rows(q, ids)).dequantize().to(dtype)
    weight = packed.plain if packed.plain is not None else packed.dense
    if packed.onednn and packed.plain is None:
        raise ValueError("pack(..., keep_rows=True) keeps the rows a oneDNN-packed weight cannot serve.")
    return F.embedding(ids, weight)


def _rows(q: QuantizedWeight, ids: torch.Tensor) -> dict:
    names = ("q", "scale", "offset") if hasattr(q, "offset") else ("q", "scale")
    return {name: getattr(q, name).index_select(0, ids) for name in names}
