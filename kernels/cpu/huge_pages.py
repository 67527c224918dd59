"""Packed weights and the KV cache in memory that Linux backs with 2 MiB pages (transparent huge pages).

A decode step streams every weight once. With 4 KiB pages that stream crosses a page, and needs a TLB entry,
every 4 KiB; with 2 MiB pages it needs one every 2 MiB. Where transparent huge pages are in ``madvise`` mode
(a common default) memory gets them only when asked, so the packed weights are copied into mappings that
ask. Weights are placed one after another in shared chunks, so that a small weight does not round up to a
whole 2 MiB page of its own. Attention reads a sequence's KV blocks from anywhere in the cache, a few KiB
each: on 4 KiB pages most blocks miss the TLB, and the stream of weights has pushed the page tables their
walks read out to memory, so the cache gets a mapping of its own too (`zeros_on_huge_pages`).
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

_PAGE = 2 << 20
_CHUNK = 64 << 20  # bytes asked of the kernel at a time (a larger weight gets a mapping of its own)
_ALIGN = 64  # a cache line: where each weight starts

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # bytes of the current chunk, 2 MiB-aligned
_used = 0


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` in huge-page-backed memory; `t` itself where the system cannot give any."""
    global _chunk, _used
    size = t.numel() * t.element_size()
    if size == 0:
        return t.contiguous()
    with _lock:
        start = -(-_used // _ALIGN) * _ALIGN
        if _chunk is None or start + size > _chunk.numel():
            fresh = _mapping(max(size, _CHUNK))
            if fresh is None:
                return t.contiguous()
            if size >= _CHUNK:  # a weight of its own size: the current chunk stays current
                return fresh[:size].view(t.dtype).view(t.shape).copy_(t)
            _chunk, start = fresh, 0
        _used = start + size
        placed = _chunk[start : start + size]
    return placed.view(t.dtype).view(t.shape).copy_(t)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in a mapping of its own that asks for huge pages, written once, so that its memory
    is the process's from the start (as torch.zeros's is), not taken page by page while serving. torch.zeros
    where the system cannot give such a mapping."""
    size = math.prod(shape) * dtype.itemsize
    memory = _mapping(size)
    if memory is None:
        return torch.zeros(shape, dtype=dtype)
    return memory.view(dtype).view(shape).zero_()


def _mapping(size: int) -> torch.Tensor | None:
    """`size` bytes of a private anonymous mapping that asks for huge pages, from a 2 MiB boundary (the
    tensor keeps the mapping alive); None where the mapping or the advice is refused, or where this Python
    cannot give the advice."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        memory = mmap.mmap(-1, size + _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(memory, dtype=torch.uint8)
    offset = -raw.data_ptr() % _PAGE
    return raw[offset : offset + size]
