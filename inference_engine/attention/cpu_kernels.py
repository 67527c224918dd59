"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

Why not PyTorch: decode attention over a paged cache in PyTorch must first gather every sequence's
blocks into a padded copy and then run a masked SDPA that handles a handful of query rows per head
poorly; on this project's 2-core reference machine that was half of a decode step. The C kernel in
`csrc/` reads the cache in place. It is plain C (no PyTorch headers), so building it takes about a
second; the shared object is cached per source, compiler flags and CPU. Without a compiler, or with
LLMSERVE_CPU_KERNELS=0, `paged_decode` returns None and callers use their PyTorch path.
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

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
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
        logger.warning("no C compiler found: CPU decode attention runs in plain PyTorch (slower)")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename, so concurrent engine processes never load a partial file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, text=True
            )
            if result.returncode != 0:
                logger.warning("building the CPU decode kernel failed, using PyTorch:\n%s", result.stderr)
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
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
    return lib


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
