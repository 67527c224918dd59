"""A GGUF file's header: its metadata as Python values and its tensors mapped from the file.

`gguf.GGUFReader` keeps every element of a metadata array as its own memory-mapped slice; a tokenizer's
~50k tokens and ~50k merges then take it seconds to parse (3.4 s on a 2-core EPYC), which every engine
start paid. Here an array of strings is decoded in one pass over the bytes. Tensor data is what
`GGUFReader` gives: a typed array for F16/F32/F64 and the integer types, else the raw bytes shaped
[rows, bytes per row] (`gguf.quant_shape_to_byte_shape`), which `gguf.dequantize` and `gguf_quant` take.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_T = gguf.GGUFValueType
_SCALARS = {
    _T.UINT8: np.dtype("<u1"),
    _T.INT8: np.dtype("<i1"),
    _T.UINT16: np.dtype("<u2"),
    _T.INT16: np.dtype("<i2"),
    _T.UINT32: np.dtype("<u4"),
    _T.INT32: np.dtype("<i4"),
    _T.FLOAT32: np.dtype("<f4"),
    _T.BOOL: np.dtype("?"),
    _T.UINT64: np.dtype("<u8"),
    _T.INT64: np.dtype("<i8"),
    _T.FLOAT64: np.dtype("<f8"),
}
_Q = gguf.GGMLQuantizationType
_TYPED = {
    _Q.F16: np.float16,
    _Q.F32: np.float32,
    _Q.F64: np.float64,
    _Q.I8: np.int8,
    _Q.I16: np.int16,
    _Q.I32: np.int32,
    _Q.I64: np.int64,
}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: fastest-varying dimension first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray


@dataclass
class GGUFFile:
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        return self.buffer[start : self.offset].tobytes().decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _T.STRING:
            return self.string()
        if kind == _T.ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in _SCALARS:
                dtype = _SCALARS[_T(item_kind)]
                start, self.offset = self.offset, self.offset + count * dtype.itemsize
                return self.buffer[start : self.offset].view(dtype).tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.offset}")
        dtype = _SCALARS[_T(kind)]
        start, self.offset = self.offset, self.offset + dtype.itemsize
        return self.buffer[start : self.offset].view(dtype)[0].item()


def read(path: Path | str) -> GGUFFile:
    """Parses `path`'s header (little-endian GGUF version 2 or 3); tensor data stays mapped, read-only."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    cursor = _Cursor(buffer)
    magic, version = cursor.unpack("<4sI")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3.")
    tensor_count, kv_count = cursor.unpack("<QQ")
    fields = {}
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        fields[key] = cursor.value(kind)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        (dims,) = cursor.unpack("<I")
        shape = cursor.unpack(f"<{dims}Q")
        kind, offset = cursor.unpack("<IQ")
        infos.append((name, shape, _Q(kind), offset))
    alignment = fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * type_size // block_size
        raw = buffer[start + offset : start + offset + nbytes]
        dims = tuple(reversed(shape))
        if kind in _TYPED:
            data = raw.view(_TYPED[kind]).reshape(dims)
        else:
            data = raw.reshape(gguf.quant_shape_to_byte_shape(dims, kind))
        tensors.append(GGUFTensor(name, shape, kind, data))
    return GGUFFile(fields, tensors)
