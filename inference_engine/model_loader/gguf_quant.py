"""GGUF block formats to the engine's quantized weights (kernels/quantized.py), straight from the bytes.

This is where a GGUF file's quantized tensors are repacked, once, at load: each llama.cpp block holds
its scale(s) beside 32 (or 256) packed values; the kernels want the values of a row contiguous and the
scales in a separate fp32 matrix. The repacking is a handful of vectorised numpy operations over the
whole tensor (no loop over blocks), and it replaces the `gguf.dequantize` a dense load runs: on the
bundled SmolLM2-135M Q4_1 file it takes about an eighth of that step's time (see the commit that added
this module for the measurement).

    Q4_0  w = d * (q - 8)              -> Int4Weight, group 32, offset -8d
    Q4_1  w = d * q + m                -> Int4Weight, group 32
    Q4_K  w = d*sc[j] * q - dmin*m[j]  -> Int4Weight, group 32 (6-bit sc, m times fp16 d: exact in fp32)
    Q8_0  w = d * q                    -> Int8Weight, group 32
    Q6_K  w = d*sc[j] * (q - 32)       -> Int8Weight, group 16 (q - 32 fits int8)

Each function takes the tensor's raw bytes as `gguf_file` maps them, [rows, bytes per row], and gives
exactly the values `gguf.dequantize` computes, in the same fp32 arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmserve_kernels.quantized import Int4Weight, Int8Weight, QuantizedWeight


def _blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """[rows, blocks per row, bytes per block] view of a tensor's bytes."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    return data.reshape(data.shape[0], -1, type_size)


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp16 fields ([..., 2] bytes) as fp32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's 32-value layout: byte k holds value k in its low nibble and value k + 16 in its high one."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _rows(values: np.ndarray) -> np.ndarray:
    """[rows, blocks, per block] -> [rows, blocks * per block]."""
    return values.reshape(values.shape[0], -1)


def q4_0(data: np.ndarray) -> Int4Weight:
    b = _blocks(data, GGMLQuantizationType.Q4_0)
    d = _f16(b[..., 0:2])
    return _int4(_nibbles(b[..., 2:]), d, -8 * d, 32)


def q4_1(data: np.ndarray) -> Int4Weight:
    b = _blocks(data, GGMLQuantizationType.Q4_1)
    return _int4(_nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32)


def q4_k(data: np.ndarray) -> Int4Weight:
    """Super-blocks of 256: fp16 d and dmin, eight 6-bit (scale, min) pairs in 12 bytes, 128 bytes of
    nibbles where each 32-byte run holds sub-block 2i in its low nibbles and 2i + 1 in its high ones."""
    b = _blocks(data, GGMLQuantizationType.Q4_K)
    d, dmin, s = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16]
    # Bytes 0-3: scales 0-3 (low 6 bits); 4-7: mins 0-3; 8-11: low 4 bits of scale / min 4-7 in the low /
    # high nibble, whose top 2 bits are the top bits of bytes 0-3 / 4-7.
    scales = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    packed = b[..., 16:].reshape(*b.shape[:2], 4, 32)
    q = np.stack([packed & 0x0F, packed >> 4], axis=3)  # [rows, blocks, 4, 2, 32]: sub-blocks in order
    scale = d[..., None] * scales.astype(np.float32)
    offset = -(dmin[..., None] * mins.astype(np.float32))
    return _int4(q, scale, offset, 32)


def q8_0(data: np.ndarray) -> Int8Weight:
    b = _blocks(data, GGMLQuantizationType.Q8_0)
    return _int8(np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b[..., 0:2]), 32)


def q6_k(data: np.ndarray) -> Int8Weight:
    """Super-blocks of 256 in two halves of 128: 64 bytes of low nibbles (values 0-63 low, 64-127 high),
    32 bytes of 2-bit high parts (values 0-31, 32-63, 64-95, 96-127 at bits 0, 2, 4, 6), then 16 int8
    sub-block scales and the fp16 d."""
    b = _blocks(data, GGMLQuantizationType.Q6_K)
    rows, blocks = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, blocks, 2, 64)
    qh = b[..., 128:192].reshape(rows, blocks, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [rows, blocks, 2, 128]
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3).reshape(rows, blocks, 2, 128)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return _int8(q, _f16(b[..., 208:210])[..., None] * scales, 16)


CONVERTERS = {
    GGMLQuantizationType.Q4_0: q4_0,
    GGMLQuantizationType.Q4_1: q4_1,
    GGMLQuantizationType.Q4_K: q4_k,
    GGMLQuantizationType.Q8_0: q8_0,
    GGMLQuantizationType.Q6_K: q6_k,
}


def convert(data: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """The engine form of one quantized tensor's bytes ([rows, bytes per row]); KeyError if unsupported."""
    return CONVERTERS[qtype](data)


def permute_rows(weight: QuantizedWeight, order: np.ndarray) -> QuantizedWeight:
    """The weight with its rows (output features) in `order` (for llama.cpp's Q/K row permutation)."""
    index = torch.from_numpy(order)
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q[index], weight.scale[index], weight.offset[index], weight.group_size)
    return Int8Weight(weight.q[index], weight.scale[index], weight.group_size)


def _int4(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int) -> Int4Weight:
    return Int4Weight(
        q=torch.from_numpy(np.ascontiguousarray(_rows(q), dtype=np.uint8)),
        scale=torch.from_numpy(np.ascontiguousarray(_rows(scale), dtype=np.float32)),
        offset=torch.from_numpy(np.ascontiguousarray(_rows(offset), dtype=np.float32)),
        group_size=group,
    )


def _int8(q: np.ndarray, scale: np.ndarray, group: int) -> Int8Weight:
    return Int8Weight(
        q=torch.from_numpy(np.ascontiguousarray(_rows(q), dtype=np.int8)),
        scale=torch.from_numpy(np.ascontiguousarray(_rows(scale), dtype=np.float32)),
        group_size=group,
    )
