"""Compile the Triton kernels for a CUDA GPU on a machine without one, through their real launchers.

The interpreter (``TRITON_INTERPRET=1``) checks what a kernel computes but not whether it compiles for the
GPU: it accepts a ``tl.dot`` narrower than 16, and it cannot tell whether a tile fits in registers. This
module stands a stand-in driver in for CUDA's, so that each launcher runs unchanged on CPU tensors and
Triton compiles every kernel it launches for the chosen architecture with its bundled ``ptxas``; nothing
is launched. For each compiled kernel it reports registers, the local-memory stack (non-zero: the
kernel spills) and shared memory, read from the cubin with the bundled ``cuobjdump``.

    python -m llmserve_kernels.triton.compile_check # the production variants of every kernel, for sm_90

It must run without ``TRITON_INTERPRET`` (the interpreter replaces the compiler when triton is imported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

H100_SHARED_MEMORY = 232448  # bytes a block may use on sm_90


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    registers: int
    stack_bytes: int  # local memory per thread: register spills (or local arrays)
    shared_bytes: int


class _NoLaunch:
    """Stands in for a kernel launcher: compiling is the whole point, so launching does nothing."""

    def __init__(self, src, metadata) -> None:
        pass

    def __call__(self, *args, **kwargs) -> None:
        pass


class _Utils:
    def __init__(self, record: Callable[[str, bytes, int], None]) -> None:
        self._record = record

    def get_device_properties(self, device: int) -> dict:
        return {"max_shared_mem": H100_SHARED_MEMORY, "multiprocessor_count": 132}

    def load_binary(self, name: str, cubin: bytes, shared: int, device: int):
        registers = self._record(name, cubin, shared)
        return None, None, registers, 0, 1024

    def unload_module(self, module) -> None:
        pass


class _CompileOnlyDriver:
    """The parts of Triton's CUDA driver a launch touches, answering for a GPU of ``arch``."""

    launcher_cls = _NoLaunch

    def __init__(self, arch: int, record: Callable[[str, bytes, int], int]) -> None:
        self.target = GPUTarget("cuda", arch, 32)
        self.utils = _Utils(record)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the cubin's one kernel, as ``cuobjdump --dump-resource-usage`` says."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], check=True, capture_output=True, text=True
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if usage is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{text}")
    return int(usage.group(1)), int(usage.group(2))


@contextmanager
def compiling_for(arch: int = 90) -> Iterator[list[CompiledKernel]]:
    """Within this block, Triton launches compile for ``sm_<arch>`` and launch nothing; the list it yields
    fills with one entry per kernel compiled (a variant already compiled in this process is not repeated).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile checks need TRITON_INTERPRET unset: the interpreter compiles nothing")
    compiled: list[CompiledKernel] = []

    def record(name: str, cubin: bytes, shared: int) -> int:
        registers, stack = _resource_usage(cubin)
        compiled.append(CompiledKernel(name, registers, stack, shared))
        return registers

    previous = driver._active  # None until a launch asks for CUDA's driver, which this machine may lack
    driver.set_active(_CompileOnlyDriver(arch, record))
    cache_dir = knobs.cache.dir
    try:
        with tempfile.TemporaryDirectory() as tmp:
            knobs.cache.dir = tmp  # a cached cubin would skip the compile this module is here to run
            yield compiled
    finally:
        knobs.cache.dir = cache_dir
        driver.set_active(previous)


def _attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_query_lens: tuple[int, ...]):
    from llmserve_kernels.triton import paged_decode_attention, paged_extend_attention, store_kvcache

    def launch() -> None:
        batch, block_size = 4, 16
        k_cache = torch.zeros(16, block_size, kv_heads, head_dim, dtype=dtype)
        q = torch.zeros(batch, heads, head_dim, dtype=dtype)
        tables = torch.zeros(batch, 4, dtype=torch.int32)
        lens = torch.ones(batch, dtype=torch.int32)
        store_kvcache(k_cache[0], k_cache[0], k_cache, k_cache, torch.zeros(block_size, dtype=torch.int32))
        paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.1, 4)
        starts = torch.arange(batch + 1, dtype=torch.int32)
        for max_query_len in max_query_lens:  # one tile size each
            paged_extend_attention(q, k_cache, k_cache, tables, starts, lens, 0.1, max_query_len)
        # Sliding window and soft-capping (Mistral, Gemma): the largest tile, where registers are tightest.
        paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.1, 4, window=8, softcap=30.0)
        paged_extend_attention(
            q, k_cache, k_cache, tables, starts, lens, 0.1, max(max_query_lens), window=8, softcap=30.0
        )

    return launch


def _fused(hidden: int, heads: int, head_dim: int, intermediate: int):
    from llmserve_kernels.triton.fused import add_rms_norm, rms_norm, rotary_embedding_, silu_and_mul

    def launch() -> None:
        x, weight = torch.zeros(4, hidden, dtype=torch.bfloat16), torch.zeros(hidden, dtype=torch.bfloat16)
        rms_norm(x, weight, 1e-5)
        add_rms_norm(x, x, weight, 1e-5)
        cache = torch.zeros(64, head_dim)
        rotary_embedding_(
            torch.zeros(4, heads, head_dim, dtype=torch.bfloat16),
            torch.zeros(4, dtype=torch.long),
            cache,
            cache,
        )
        silu_and_mul(torch.zeros(4, 2 * intermediate, dtype=torch.bfloat16))

    return launch


def _quantized(bits: int, group_size: int, rows: tuple[int, ...], act_order: bool = False):
    from llmserve_kernels.quantized import Int4Weight, Int8Weight
    from llmserve_kernels.triton.linear import dequantize, linear, pack

    def launch() -> None:
        n = k = 4096
        groups = k // group_size
        if bits == 4:
            perm = torch.arange(k) if act_order else None
            scale = torch.rand(n, groups)  # not exact in fp16: fp32 scales
            weight = Int4Weight(torch.zeros(n, k, dtype=torch.uint8), scale, scale, group_size, perm)
        else:
            weight = Int8Weight(torch.zeros(n, k, dtype=torch.int8), torch.rand(n, groups), group_size)
        packed = pack(weight, torch.bfloat16)
        for m in rows:
            linear(torch.zeros(m, k, dtype=torch.bfloat16), packed)
        dequantize(packed, torch.bfloat16)  # what steps of DEQUANTIZE_ROWS rows or more run first

    return launch


# Production shapes in bf16 (Llama-8B and SmolLM2-135M attention and layers), and the head_dim < 16 that
# tl.dot could not take before the head was padded to 16 columns.
CASES: list[tuple[str, Callable[[], None]]] = [
    ("attention llama-8b bf16", _attention(32, 8, 128, torch.bfloat16, (2048, 8, 1))),
    ("attention llama-8b fp16", _attention(32, 8, 128, torch.float16, (2048,))),
    ("attention smollm2 bf16", _attention(9, 3, 64, torch.bfloat16, (2048, 1))),
    ("attention head_dim 8 bf16", _attention(4, 2, 8, torch.bfloat16, (2048,))),
    ("fused llama-8b bf16", _fused(4096, 40, 128, 14336)),
    ("int4 g128 M=1/64/255", _quantized(4, 128, (1, 64, 255))),
    ("int4 g32 M=16", _quantized(4, 32, (16,))),
    ("int4 g128 act-order M=1", _quantized(4, 128, (1,), act_order=True)),
    ("int8 per-channel M=1/32", _quantized(8, 4096, (1, 32))),
    ("int8 g16 M=128", _quantized(8, 16, (128,))),
]


def check(cases: list[tuple[str, Callable[[], None]]] = CASES) -> list[str]:
    """Compiles every case; returns one line per compiled kernel (or failure), failures first-word FAILED
    or SPILLS."""
    lines = []
    for label, launch in cases:
        with compiling_for() as compiled:
            try:
                launch()
            except Exception as error:  # report every failing case, not just the first
                lines.append(
                    f"FAILED  {label}: {type(error).__name__}: {str(error).strip().splitlines()[-1]}"
                )
                continue
        for kernel in compiled:
            status = "SPILLS" if kernel.stack_bytes else "ok"
            lines.append(
                f"{status:7} {label}: {kernel.name} registers={kernel.registers} stack={kernel.stack_bytes} "
                f"shared={kernel.shared_bytes}"
            )
    return lines


def main() -> int:
    lines = check()
    print("\n".join(lines))
    return 1 if any(line.split()[0] in ("FAILED", "SPILLS") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
