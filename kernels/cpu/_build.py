"""Builds the C sources of `csrc/` with the machine's compiler on first use and loads them with ctypes.

Plain C, no PyTorch headers, so the build takes about a second; the shared object is cached per source,
compiler flags and CPU under ~/.cache/llmserve/kernels. Without a compiler, or with
LLMSERVE_CPU_KERNELS=0, `library()` is None and every wrapper declines (returns None or False), so its
caller runs the PyTorch path.
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

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_FLAGS = [
    "-O3",
    "-march=native",
    # Loops the compiler vectorises (SiLU, RMSNorm, RoPE) take 512-bit vectors where the CPU has them: GCC's
    # tuning for AVX-512 CPUs stops at 256 bits, and these loops ran 25-30 % slower so.
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-ffp-contract=off",  # a * b + c rounded as PyTorch rounds it, not fused
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",  # lets the compiler vectorise fp32 dot products (reassociates the sums)
    "-fno-signed-zeros",
    "-Werror=implicit-function-declaration",  # an intrinsic the CPU lacks fails the build, not the load
    "-shared",
    "-fPIC",
]

ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmserve" / "kernels"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@cache
def library_path() -> Path:
    """Where the shared object built from these sources, with this compiler and flags, for this CPU lives."""
    sources = sorted(CSRC.glob("*.c")) + sorted(CSRC.glob("*.h"))
    code = b"".join(path.read_bytes() for path in sources)
    key = hashlib.sha256(code + " ".join([str(_compiler()), *_FLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    return _cache_dir() / f"llmserve-cpu-{key}.so"


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the CPU kernels' layers run in PyTorch (slower)")
        return None
    sources = sorted(CSRC.glob("*.c"))
    target = library_path()
    try:
        if not target.exists():
            _compile(compiler, sources, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:  # no writable cache, compile error, bad .so
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("CPU kernels unavailable, using PyTorch (slower): %s", detail)
        return None


def _compile(compiler: str, sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed, so concurrent engine processes never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *_FLAGS, *map(str, sources), "-o", str(built)]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(built, target)


@cache
def function(name: str, restype, *argtypes):
    """The C function `name` with its signature declared, or None where the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def available() -> bool:
    return library() is not None
