"""AWQ and GPTQ checkpoints (Hugging Face folders) to the engine's `Int4Weight`.

Both store, per linear layer `<prefix>`, int32 words of eight 4-bit values plus per-group scales and
zero points; a layer's weight is w = scale * (q - zero) over groups of `group_size` input features. The
layouts differ:

    AWQ (GEMM)  qweight [in, out/8]   words run along output features, nibbles in AutoAWQ's order
                                      (nibble i holds feature 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i])
                qzeros  [in/G, out/8] same packing;  scales [in/G, out] fp16
    GPTQ        qweight [in/8, out]   words run along input features, nibble i holds feature 8r + i
                qzeros  [in/G, out/8] nibble i holds output feature 8c + i, stored as zero - 1 in the
                                      original ("gptq", v1) checkpoint format, as is in "gptq_v2"
                scales  [in/G, out];  g_idx [in]: the group of each input feature

A GPTQ `g_idx` that is not `i // G` (act-order, desc_act) becomes `perm`, the input features sorted by
group, with the columns stored in that order so groups are contiguous again. A final partial group
(an input size that G does not divide, as GPTQ allows) is handled by splitting every group into
gcd(G, in)-sized ones with the same scale, which is exact.
"""

from __future__ import annotations

import math

import torch

from llmserve_kernels.quantized import Int4Weight

METHODS = ("awq", "gptq")
SUPPORTED = "4-bit AWQ (GEMM packing, zero points) and 4-bit GPTQ (checkpoint_format gptq or gptq_v2)"
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # feature offset held by nibble i of an AWQ word
_AWQ_UNDO = tuple(_AWQ_ORDER.index(i) for i in range(8))  # nibble holding feature offset i
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def declared_method(raw_config: dict) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (lower case), None for a dense checkpoint."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    return str(qc.get("quant_method", "unknown")).lower()


class QuantConfig:
    """The parts of an AWQ/GPTQ `quantization_config` the loader needs, validated."""

    def __init__(self, method: str, qc: dict) -> None:
        self.method = method
        self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        self.zero_offset = 0
        if self.bits != 4:
            raise ValueError(
                f"{method.upper()} checkpoints with {self.bits} bits are not supported ({SUPPORTED})."
            )
        if self.group_size <= 0:
            raise ValueError(
                f"{method.upper()} group_size {self.group_size} (one group per row) is not supported "
                f"({SUPPORTED}, with a positive group size)."
            )
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r} is not supported ({SUPPORTED}).")
            if not qc.get("zero_point", True):
                raise ValueError(f"AWQ without zero points is not supported ({SUPPORTED}).")
        else:
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported ({SUPPORTED}).")
            self.zero_offset = 1 if fmt == "gptq" else 0


def convert_layer(tensors: dict[str, torch.Tensor], config: QuantConfig) -> Int4Weight:
    """One layer's tensors (`qweight`, `qzeros`, `scales`, GPTQ's `g_idx`) as an Int4Weight [out, in]."""
    if config.method == "awq":
        return awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], config.group_size)
    return gptq_weight(
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        tensors.get("g_idx"),
        config.group_size,
        config.zero_offset,
    )


def awq_weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Weight:
    q = _unpack_columns(qweight)[:, :, _AWQ_UNDO].flatten(1)  # [in, out]
    zeros = _unpack_columns(qzeros)[:, :, _AWQ_UNDO].flatten(1)  # [groups, out]
    _check_shapes("AWQ", q, zeros, scales, group_size)
    return _int4(q.t(), zeros.t(), scales.t(), group_size, perm=None)


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int = 1,
) -> Int4Weight:
    """`zero_offset`: what the checkpoint subtracted from each zero point before packing it (1 in the
    original GPTQ format; a stored 15 then means 0, as GPTQ's own unpacking wraps it)."""
    q = _unpack_columns(qweight.t().contiguous()).flatten(1)  # [out, in]
    zeros = ((_unpack_columns(qzeros).flatten(1) + zero_offset) & 15).t()  # [out, groups]
    _check_shapes("GPTQ", q.t(), zeros.t(), scales, group_size)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(q.shape[1]) // group_size):
            perm = torch.sort(g_idx, stable=True).indices
            counts = torch.bincount(g_idx, minlength=scales.shape[0])
            expected = torch.full_like(counts, group_size)
            expected[-1] = q.shape[1] - group_size * (len(counts) - 1)
            if not torch.equal(counts, expected):
                raise ValueError(
                    "GPTQ g_idx does not put group_size input features in every group; such a checkpoint "
                    f"is not supported ({SUPPORTED})."
                )
            q = q[:, perm]
    return _int4(q, zeros, scales.t(), group_size, perm)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, words] -> uint8 [rows, words, 8]: nibble i (bits 4i..4i+3) of each word."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def _check_shapes(
    method: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
) -> None:
    """q [in, out], zeros and scales [groups, out]."""
    groups = math.ceil(q.shape[0] / group)
    if zeros.shape != (groups, q.shape[1]) or tuple(scales.shape) != (groups, q.shape[1]):
        raise ValueError(
            f"{method} layer of {q.shape[0]} inputs and {q.shape[1]} outputs with group_size {group} needs "
            f"{groups} groups of scales and zeros; the checkpoint has {tuple(scales.shape)} scales and "
            f"{tuple(zeros.shape)} zeros."
        )


def _int4(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, perm: torch.Tensor | None
) -> Int4Weight:
    """From q [out, in] and per-group zeros, scales [out, groups]: w = s * q + (-s * z), exact in fp32."""
    scale = scales.float()
    offset = -scale * zeros.float()
    in_features = q.shape[1]
    if in_features % group:
        # GPTQ's last group is partial: split every group into gcd-sized ones (the same scale repeated).
        split = math.gcd(group, in_features)
        repeats = torch.full((scale.shape[1],), group // split)
        repeats[-1] = (in_features - group * (scale.shape[1] - 1)) // split
        scale, offset = scale.repeat_interleave(repeats, 1), offset.repeat_interleave(repeats, 1)
        group = split
    return Int4Weight(
        q=q.contiguous(), scale=scale.contiguous(), offset=offset.contiguous(), group_size=group, perm=perm
    )
