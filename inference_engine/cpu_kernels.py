"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

Why not PyTorch: decode attention over a paged cache in PyTorch must first gather every sequence's
blocks into a padded copy and then run a masked SDPA that handles a handful of query rows per head
poorly, and a decode step of a small model is hundreds of elementwise ops that each cost more in
dispatch than in arithmetic. On this project's 2-core reference machine those were over half of a
step. `csrc/paged_decode.c` reads the cache in place; `csrc/kv_store.c` writes a step's K/V into it;
`csrc/fused_ops.c` fuses the residual add with RMSNorm, and the rotary embedding (bf16);
`csrc/argmax.c` is greedy sampling's argmax, which torch runs on one core. Plain C, no PyTorch
headers, so the build takes about a second; the shared object is cached per source, compiler flags and
CPU. Without a compiler, or with LLMSERVE_CPU_KERNELS=0, every function here declines (returns None or
False) and callers use their PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "paged_decode.c", _CSRC / "fused_ops.c", _CSRC / "argmax.c", _CSRC / "kv_store.c"]
_HEADERS = [_CSRC / "bf16.h"]
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",  # a * b + c rounded as PyTorch rounds it, not fused
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",  # lets the compiler vectorise fp32 dot products (reassociates the sums)
    "-fno-signed-zeros",
    "-shared",
    "-fPIC",
]
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmserve" / "kernels"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: CPU attention and elementwise layers run in PyTorch (slower)")
        return None
    source = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"llmserve-cpu-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:  # no writable cache, compile error, bad .so
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("CPU kernels unavailable, using PyTorch (slower): %s", detail)
        return None
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        *[ctypes.c_int] * 6,
        ctypes.c_float,
        ctypes.c_int,
    ]
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.add_rms_norm_bf16.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, ctypes.c_float, i32]
    lib.rotary_bf16.argtypes = [ptr, ctypes.c_long, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.argmax_rows_f32.argtypes = [ptr, i32, i32, ptr, i32]
    lib.store_kv.restype = ctypes.c_int
    lib.store_kv.argtypes = [ptr, ctypes.c_long, ptr, ctypes.c_long, ptr, ptr, ptr, i32, ctypes.c_long, i32]
    for fn in (lib.add_rms_norm_bf16, lib.rotary_bf16, lib.argmax_rows_f32):
        fn.restype = None
    return lib


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed, so concurrent engine processes never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built)]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(built, target)


def available() -> bool:
    return _library() is not None


def paged_decode(
    q: torch.Tensor,  # [batch, heads, head_dim], rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    scale: float,
) -> torch.Tensor | None:
    """Attention of one new token per sequence over its paged K/V, or None where this kernel can't run."""
    lib = _library()
    if (
        lib is None
        or q.device.type != "cpu"
        or q.dtype not in _DTYPES
        or k_cache.dtype != q.dtype
        or q.stride(2) != 1
        or q.stride(1) != q.shape[2]
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    batch, heads, head_dim = q.shape
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype)
    status = lib.paged_decode(
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
    lib = _library()
    dtype, (kv_heads, head_dim) = k_cache.dtype, k_cache.shape[2:]
    if (
        lib is None
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
    status = lib.store_kv(
        k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(),
        v_cache.data_ptr(), slots.data_ptr(), len(slots), k_cache.shape[0] * k_cache.shape[1],
        k.shape[1] * k.shape[2] * size,
    )
    if status != 0:
        raise IndexError("a KV cache slot is out of range")
    return True


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight * rmsnorm(x + residual), x + residual) for bf16 rows, or None where it can't run."""
    lib = _library()
    if lib is None or not _bf16_rows(x, residual, weight) or x.shape != residual.shape:
        return None
    new_residual, out = torch.empty_like(x), torch.empty_like(x)
    hidden = x.shape[-1]
    lib.add_rms_norm_bf16(
        x.data_ptr(), residual.data_ptr(), new_residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // hidden, hidden, eps, torch.get_num_threads(),
    )
    return out, new_residual


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates x [tokens, heads, head_dim] (rows may be strided) in place; False where it can't run."""
    lib = _library()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or positions.dtype != torch.int64
        or not (positions.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
        or cos.dtype != torch.float32
    ):
        return False
    tokens, heads, head_dim = x.shape
    lib.rotary_bf16(
        x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads,
        head_dim, torch.get_num_threads(),
    )
    return True


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Index of each row's maximum (first one; a NaN counts as the maximum) of fp32 [rows, vocab] logits,
    as torch.argmax(dim=-1) gives it, or None where this kernel can't run."""
    lib = _library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or not logits.is_contiguous()
        or logits.shape[1] == 0
    ):
        return None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_rows_f32(logits.data_ptr(), rows, vocab, out.data_ptr(), torch.get_num_threads())
    return out
