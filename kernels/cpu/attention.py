"""Paged attention and the KV-cache store on the CPU (`csrc/paged_decode.c`, `csrc/kv_store.c`)."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu._build import f32, function, i32, i64, ptr

_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _check_options(window: int, softcap: float) -> None:
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must not be negative, got {window} and {softcap}")


def _reads_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """What both attention kernels read: CPU tensors, caches in q's dtype and contiguous, and each query
    head's row contiguous (a token's rows may be strided, as views of the fused qkv output are)."""
    return (
        q.device.type == "cpu"
        and k_cache.dtype == q.dtype
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_decode(
    q: torch.Tensor,  # [batch, heads, head_dim], rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor | None:
    """Attention of one new token per sequence over its paged K/V, or None where this kernel can't run.
    `window` > 0: each query sees only its sequence's last `window` keys, and blocks wholly before them are
    not read; `softcap` > 0: scores become softcap * tanh(score / softcap) after scaling (0: neither)."""
    fn = function("paged_decode", i32, ptr, i64, ptr, ptr, ptr, i32, ptr, ptr, *[i32] * 6, f32, i32, f32, i32)
    if fn is None or q.dtype not in _DTYPES or not _reads_in_place(q, k_cache, v_cache):
        return None
    _check_options(window, softcap)
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    batch, heads, head_dim = q.shape
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype)
    status = fn(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        _DTYPES[q.dtype],
        scale,
        window,
        softcap,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def store_kv(
    k: torch.Tensor,  # [tokens, kv_heads, head_dim], rows may be strided
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [tokens] int64 flat slot of each token
) -> bool:
    """Writes each token's K and V row into its cache slot; False where this kernel can't run."""
    fn = function("store_kv", i32, ptr, i64, ptr, i64, ptr, ptr, ptr, i32, i64, i32)
    dtype, (kv_heads, head_dim) = k_cache.dtype, k_cache.shape[2:]
    if (
        fn is None
        or not (k.is_cpu and k_cache.is_cpu)
        or v_cache.shape != k_cache.shape
        or k.dtype != dtype
        or v.dtype != dtype
        or v_cache.dtype != dtype
        or k.stride()[1:] != (head_dim, 1)
        or v.stride()[1:] != (head_dim, 1)
        or k.shape != v.shape
        or k.shape[1:] != (kv_heads, head_dim)
        or slots.dtype != torch.int64
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous())
    ):
        return False
    size = k.element_size()
    status = fn(
        k.data_ptr(),
        k.stride(0) * size,
        v.data_ptr(),
        v.stride(0) * size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        len(slots),
        k_cache.shape[0] * k_cache.shape[1],
        k.shape[1] * k.shape[2] * size,
    )
    if status != 0:
        raise IndexError("a KV cache slot is out of range")
    return True


def paged_extend(
    q: torch.Tensor,  # [tokens, heads, head_dim], rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], this step's rows stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32, the new tokens included
    scale: float,
    out: torch.Tensor,  # [tokens, heads, head_dim]
    query_lens: tuple[int, int] = (1, 2**31 - 1),
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> bool:
    """Causal attention of the new tokens of every sequence that brings `query_lens` (inclusive bounds) of
    them, over its paged K/V, into their rows of `out`; False where this kernel can't run (then nothing is
    written). `window` > 0: a query at position p sees keys p - window + 1 to p, and blocks before every
    query's window are not read; `softcap` > 0: scores become softcap * tanh(score / softcap) after
    scaling (0: neither)."""
    fn = function(
        "paged_extend", i32, ptr, i64, ptr, ptr, ptr, i32, ptr, ptr, ptr, *[i32] * 7, f32, i32, f32, i32
    )
    if (
        fn is None
        or q.dtype != torch.bfloat16
        or not _reads_in_place(q, k_cache, v_cache)
        or out.dtype != q.dtype
        or out.shape != q.shape
        or not out.is_contiguous()
    ):
        return False
    _check_options(window, softcap)
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    _, heads, head_dim = q.shape
    status = fn(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        len(seq_lens),
        heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        *query_lens,
        scale,
        window,
        softcap,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("no memory for the extend attention's key tiles")
    return status == 0


def extend_through_amx(on: bool) -> bool:
    """Lets the extend kernel multiply through AMX tiles where the CPU has them (on, the default) or makes it
    take its vdpbf16ps routine (off: tests run both on AMX CPUs). Returns whether it now runs on AMX."""
    fn = function("paged_extend_set_amx", i32, i32)
    return fn is not None and bool(fn(int(on)))


def decode_through_amx(on: bool) -> bool:
    """Lets the decode kernel run strips of query rows through AMX tiles where the CPU has them (on, the
    default) or makes it take its vdpbf16ps routine (off: tests run both on AMX CPUs). Returns whether it now
    runs on AMX."""
    fn = function("paged_decode_set_amx", i32, i32)
    return fn is not None and bool(fn(int(on)))
