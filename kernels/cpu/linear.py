"""Linear layers on the CPU: weights packed once at load, then `linear(x, packed)` every step.

A linear layer at small batch is bound by reading its weight from memory, so each weight is repacked once
into the layout a native kernel streams best (`csrc/linear_bf16.c` for dense bf16, `csrc/linear_quant.c`
for kernels/quantized.py weights, kept quantized), in memory backed by huge pages (`huge_pages`). Which
routine serves which number of rows is measured once per weight shape when the weight is packed (native
kernel, oneDNN's prepacked bf16 linear, or for a quantized weight what a bf16 copy of it would run) and
fixed then: `linear` only compares the row count with a number. The same packed layout serves embedding
lookups of a tied weight, so no second plain copy is kept.

With LLMSERVE_CPU_KERNELS=0 or without a compiler, dense bf16 weights run through oneDNN's prepacked
linear and quantized weights are dequantized on every call.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve_kernels.cpu._build import available, function, i32, i64, library_path, ptr
from llmserve_kernels.cpu.huge_pages import on_huge_pages
from llmserve_kernels.quantized import Int4Weight, QuantizedWeight
from llmserve_kernels.timing import best_time, interleaved_best

BF16 = torch.bfloat16
_PACK_BATCH_HINT = 32  # oneDNN picks its layout for this many rows; measured as good for 1..2048 rows
_PADDED_ROWS = 33
_TILE = 32  # output rows per tile of the bf16 kernel (TILE in linear_bf16.c)
_QTILE = 16  # output rows per tile of the quantized kernel (QTILE in linear_quant.c)
_XBLOCK = 32  # columns of x per int8 scale (XBLOCK in linear_quant.c)
_LARGE_ROWS = 512  # the row count at which a routine for prompts (many rows) is timed
_CANDIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)  # where a crossover is looked for
_ALL = math.inf
# Up to this many rows, a quantized weight's tiles dequantized one at a time into AMX beat the weight
# dequantized whole for oneDNN (Q4_1 layer of the bundled model, two threads: 1,000 rows 2.7 ms against 4.3,
# 2,048 rows 5.6 against 5.8); beyond, oneDNN's AMX matmul, blocked for many rows, outruns our AMX routine
# (gate_up at 3,000 rows: 4.6 ms against 3.7).
_AMX_TILE_ROWS = 2048
# Steps of up to this many rows give each row the bits it gets alone (see _amx_rows): the native kernels serve
# them even where oneDNN measures faster, and take AMX only beyond.
SAME_BITS_ROWS = 20
# A step of up to this many rows may run whole in the native decoder (kernels/cpu/decoder.py), where every
# layer's linear takes one of our routines for it; layer by layer through Python, a step is some 300 calls.
NATIVE_STEP_ROWS = 256
# A dense weight's steps of up to this many rows run on our kernels whatever the timing, where AMX does not
# take every bf16 step (`_forced_rows`).
FORCED_DENSE_ROWS = 32
# How far ahead the quantized kernel may prefetch its weight stream, in bytes (`time_quant_prefetch`).
QUANT_PREFETCH_BYTES = (1024, 2048, 4096)


@dataclass(eq=False)
class PackedLinear:
    """A weight packed for this module's routines: `small` runs up to `small_rows` rows, `large` more;
    `rows` serves `embedding` lookups (None where the packed form cannot); `resident` is what it keeps."""

    out_features: int
    in_features: int
    small: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    large: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    small_rows: float
    rows: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None
    resident: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of weight memory this packing holds, every copy counted."""
        return sum(t.numel() * t.element_size() for t in self.resident)


def pack(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, keep_rows: bool = False, pad: bool = False
) -> PackedLinear:
    """Packs a weight [out, in] for activations of `dtype`. `keep_rows`: the weight also serves
    `embedding` lookups. `pad`: where oneDNN runs 17-32 rows, time whether padding them to 33 is faster
    (large heads)."""
    if isinstance(weight, torch.Tensor):
        return _pack_dense(weight.to(dtype), keep_rows, pad)
    return _pack_quantized(weight, dtype)


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), packed, bias).reshape(*x.shape[:-1], packed.out_features)
    routine = packed.small if x.shape[0] <= packed.small_rows else packed.large
    return routine(x, bias)


def embedding(ids: torch.Tensor, packed: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized to `dtype` (embedding lookups of a tied weight)."""
    if packed.rows is None:
        raise ValueError("pack(..., keep_rows=True) keeps the rows a oneDNN-packed weight cannot serve.")
    return packed.rows(ids, dtype)


# ------------------------------------------------------------------------------------------ dense weights


@cache
def prepacking_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear is present and gives F.linear's exact result for `dtype`."""
    if dtype != BF16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(5, 64, dtype=dtype), torch.randn(48, 64, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        return torch.equal(
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w)
        )
    except (AttributeError, RuntimeError):
        return False


class _Plain:
    """F.linear on the weight as it is (fp32 weights, or no oneDNN)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(dtype)


class _OneDNN:
    """oneDNN's linear on its prepacked bf16 weight (which F.linear would otherwise reorder every call)."""

    def __init__(self, weight: torch.Tensor, pad: bool) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        # The storage size oneDNN's layout takes is not visible; its blocks pad the weight slightly.
        self.resident = torch.empty(weight.shape, dtype=BF16, device="meta")
        self.padded_rows = range(17, _PADDED_ROWS) if pad and _padding_pays(*weight.shape) else range(0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows in self.padded_rows:
            return _onednn(F.pad(x, (0, 0, 0, _PADDED_ROWS - rows)), self.weight, bias)[:rows]
        return _onednn(x, self.weight, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@cache
def _padding_pays(out_features: int, in_features: int, runs: int = 5) -> bool:
    """Whether this CPU's oneDNN runs a packed [out, in] weight a tenth or more faster on 33 rows than
    on 24 (with AMX it does for the LM head: [26, 576] x [576, 49152] 6.7 ms, [33, 576] 3.9 ms; on an
    AVX512-BF16 CPU without AMX padding is the slower one), so a step of 17-32 rows is best padded."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(BF16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    plain, padded = (torch.randn(n, in_features, generator=gen).to(BF16) for n in (24, _PADDED_ROWS))
    plain_time = best_time(lambda: _onednn(plain, packed, None), runs)
    return best_time(lambda: _onednn(padded, packed, None), runs) < 0.9 * plain_time


class _BF16Weight(ctypes.Structure):
    _fields_ = [
        ("tiles", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("portable", ctypes.c_int),
        ("fma_rows", ctypes.c_int),
        ("amx_rows", ctypes.c_int),
    ]


class _BF16Tiles:
    """The native bf16 kernel on the weight repacked into its pair tiles (see csrc/linear_bf16.c)."""

    def __init__(
        self,
        weight: torch.Tensor,
        portable: bool = False,
        fma_rows: int | None = None,
        amx_rows: int | None = None,
    ) -> None:
        n, k = weight.shape
        self.n, self.k, self.k_even = n, k, k + k % 2
        tiles = -(-n // _TILE)
        padded = F.pad(weight, (0, self.k_even - k, 0, tiles * _TILE - n))
        self.tiles = on_huge_pages(padded.view(tiles, _TILE, self.k_even // 2, 2).transpose(1, 2))
        fma_rows = _fma_rows() if fma_rows is None else fma_rows
        amx_rows = _amx_rows() if amx_rows is None else amx_rows
        self.desc = _BF16Weight(self.tiles.data_ptr(), n, self.k_even, int(portable), fma_rows, amx_rows)
        self.desc_ptr = ctypes.addressof(self.desc)
        self.fn = function("linear_bf16", None, ptr, ptr, i64, i32, ptr, ptr, i32)
        self.rows_fn = function("bf16_rows", i32, ptr, ptr, i32, i32, ptr)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != BF16 or x.shape[1] != self.k or (bias is not None and bias.dtype != BF16):
            raise ValueError(f"a bf16-packed [{self.n}, {self.k}] weight takes bf16 [rows, {self.k}] inputs.")
        if x.stride(1) != 1 or self.k_even != self.k:
            x = F.pad(x, (0, self.k_even - self.k))  # contiguous, and zero in the odd column
        if bias is not None:
            bias = bias.contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=BF16)
        self.fn(
            self.desc_ptr,
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.flatten().to(torch.int64).contiguous()
        out = torch.empty(*ids.shape, self.k, dtype=BF16)
        if self.rows_fn(self.desc_ptr, flat.data_ptr(), flat.numel(), self.k, out.data_ptr()) != 0:
            raise _bad_ids(self.n)
        return out.to(dtype)


def _bad_ids(rows: int) -> IndexError:
    return IndexError(f"row ids must lie in [0, {rows}).")


def native_bf16() -> bool:
    """Whether the bf16 kernel runs vector code here, AVX512-BF16 or AVX2 (else plain C loops, or nothing)."""
    fn = function("linear_bf16_native", i32)
    return fn is not None and bool(fn())


@dataclass(frozen=True)
class _Plan:
    """Up to how many rows the native routine runs, and whether the other one is kept for more."""

    native_rows: float
    keep_other: bool


def _timed_plan(
    native: Callable,
    other: Callable,
    k: int,
    dtype: torch.dtype,
    other_costs_memory: bool,
    floor: int = 0,
    one_thread: bool = False,
) -> _Plan:
    """Times two routines on random rows (interleaved, best of a few) and finds up to how many rows the
    native one is the faster: all of them if it is at half `_LARGE_ROWS` and at `_LARGE_ROWS` rows (its lead
    shrinks as rows grow), else by halving the candidates above `floor`, the rows the native routine serves
    whatever the timing (below `floor` its lead need not shrink with rows: where its AMX routine takes only
    steps of more than 20 rows, see `_amx_rows`, the bf16 kernel loses to oneDNN from about 8 rows and wins
    again from 21). Where the other routine needs its own copy of the weight, the native one serves every
    row count if it is within a tenth of the other at both row counts, sparing that copy: oneDNN's rate
    varies from one row count to the next, so one count alone could land in one of its slow splits
    ([3072, 576] on two threads: within a tenth of ours at 512 rows, 15-30 % ahead at 256 and 1,000).

    Timed on the threads the engine runs with: oneDNN does not split every shape's work evenly over them
    (two threads on [1000, 1536] x [1536, 576] took as long as one, and on 384-1000 rows of [576, 576] or
    [960, 576] ran at half the rate of 256 rows), which a one-thread timing cannot see. With two threads any
    other busy process makes a call wait for a descheduled thread, so each routine keeps its best of five
    calls: one call free of other processes is enough. `one_thread`: two routines that split their work over
    threads alike, timed where that noise cannot reach them."""
    gen = torch.Generator().manual_seed(0)

    def native_faster(rows: int, margin: float = 1.0) -> bool:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        native_time, other_time = interleaved_best([lambda: native(x, None), lambda: other(x, None)])
        return native_time <= margin * other_time

    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        return _search(native_faster, other_costs_memory, floor)
    finally:
        torch.set_num_threads(threads)


def _search(native_faster: Callable[..., bool], other_costs_memory: bool, floor: int = 0) -> _Plan:
    margin = 1.1 if other_costs_memory else 1.0
    if all(native_faster(rows, margin) for rows in (_LARGE_ROWS // 2, _LARGE_ROWS) if rows > floor):
        return _Plan(_ALL, keep_other=False)
    candidates = [rows for rows in _CANDIDATE_ROWS if rows > floor]  # none above the largest: the floor
    low, high = 0, len(candidates)  # candidates[:low] measured faster, candidates[high:] not
    while low < high:
        middle = (low + high) // 2
        if native_faster(candidates[middle]):
            low = middle + 1
        else:
            high = middle
    if candidates and low == len(candidates):
        return _Plan(_ALL, keep_other=False)
    return _Plan(candidates[low - 1] if low else floor, keep_other=True)


def _remembered(key: str, time_it: Callable[[], _Plan]) -> _Plan:
    """A plan timed once per machine: kept in a file beside the built kernels (whose name changes with their
    sources, compiler flags and CPU), so later engine starts skip the seconds of timing. Delete the file
    to time again."""
    path = library_path().with_suffix(".plans.json")
    key = f"{key} torch {torch.__version__}"
    plans = _read_plans(path)
    if key in plans:
        return _Plan(*plans[key])
    plan = time_it()
    plans = _read_plans(path)  # again: another engine may have added plans meanwhile
    plans[key] = [plan.native_rows, plan.keep_other]
    try:
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(plans))
        scratch.replace(path)
    except OSError:  # no writable cache: the plan serves this process only
        pass
    return plan


def _read_plans(path: Path) -> dict:
    """The plans file's contents; empty where it is missing or damaged (its plans are then timed again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def native_amx() -> bool:
    """Whether the bf16 kernel can multiply through AMX tiles here (the CPU has them, Linux allows them)."""
    fn = function("linear_bf16_amx_routine", i32)
    return fn is not None and bool(fn())


@cache
def _amx_rows() -> int:
    """From how many rows the bf16 kernel multiplies through AMX tiles (0: it cannot here): 1 or
    `SAME_BITS_ROWS` + 1.

    Each routine gives a row the bits it gets alone, but AMX adds a sum's products in another order than
    vdpbf16ps, so the two may round a sum differently in its last bit. Were the routine to change at some row
    count below `SAME_BITS_ROWS`, a token's logits would depend on how many tokens share its step, and
    speculative verification (steps of up to 20 rows by a CPU's default) would no longer give the tokens
    plain decoding gives. So AMX takes either every step or only those of more rows (prompts). Each of its
    tile products serves 16 rows where vdpbf16ps spends an instruction per row, so from a few rows on it is
    the faster by far, while at one row the two stream a weight at about the same speed, either a little
    ahead depending on the CPU. AMX takes every step where a step of one row and one of four (a lone
    decode, then a short prompt, a small batch or a verification) cost it no more together than they cost
    vdpbf16ps, timed once per machine: a small loss at one row is repaid, a large one is not. Judged at one
    row alone, the choice would flip with the timing noise where the two tie."""
    if not native_amx():
        return 0

    def time_it() -> _Plan:
        # 28 MB, more than a core's L2, as decoding streams its weights.
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(3072, 576, generator=gen).to(BF16) for _ in range(8)]
        vector = [_BF16Tiles(w, fma_rows=0, amx_rows=0) for w in weights]
        amx = [_BF16Tiles(w, fma_rows=0, amx_rows=1) for w in weights]
        xs = [torch.randn(rows, 576, generator=gen).to(BF16) for rows in (1, 4)]
        times = interleaved_best(
            [lambda t=t, x=x: [w(x, None) for w in t] for t in (vector, amx) for x in xs]
        )
        vector_time, amx_time = sum(times[:2]), sum(times[2:])
        return _Plan(0 if amx_time <= vector_time else SAME_BITS_ROWS, keep_other=True)

    return (
        int(_remembered("bf16 vector rows before amx [3072, 576] x8, 1 and 4 rows", time_it).native_rows) + 1
    )


@cache
def _fma_rows() -> int:
    """From how many rows the bf16 kernel multiplies in fp32 rather than pair by pair (0: never), timed once
    per machine. Both give the same bits, and either wins once enough rows share each weight's conversion
    to fp32: with AVX512-BF16, chunks of rows through FMAs beat vdpbf16ps where it issues once every two
    cycles and FMAs twice; with AVX2, a step's rows against each tile converted once keep every sum in a
    register, where the pair routine converts each pair again for every four rows."""
    fma_routine = function("linear_bf16_fma_routine", i32)
    if fma_routine is None or not fma_routine():
        return 0  # the kernel has no FMA routine here: nothing to time

    def time_it() -> _Plan:
        weight = torch.randn(3072, 576, generator=torch.Generator().manual_seed(0)).to(BF16)
        vdpbf16, fma = _BF16Tiles(weight, fma_rows=0, amx_rows=0), _BF16Tiles(weight, fma_rows=1, amx_rows=0)
        return _timed_plan(vdpbf16, fma, weight.shape[1], BF16, other_costs_memory=False, one_thread=True)

    rows = _remembered("bf16 fma [3072, 576]", time_it).native_rows
    return 0 if rows == _ALL else int(rows) + 1


def _dense_plan(n: int, k: int) -> _Plan:
    """Native bf16 kernel or oneDNN, timed once per machine, weight shape and thread count (see
    `_timed_plan`) on a random weight."""
    return _dense_plan_on(n, k, torch.get_num_threads())


@cache
def _dense_plan_on(n: int, k: int, threads: int) -> _Plan:
    if not available():
        return _Plan(0, keep_other=True)
    if not prepacking_works(BF16):
        return _Plan(_ALL, keep_other=False)

    floor = _forced_rows(native_bf16(), dense=True)

    def time_it() -> _Plan:
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(BF16)
        native, onednn = _BF16Tiles(weight, portable=not native_bf16()), _OneDNN(weight, pad=False)
        return _timed_plan(native, onednn, k, BF16, other_costs_memory=True, floor=floor)

    return _remembered(f"bf16 [{n}, {k}] above {floor} rows on {threads} threads", time_it)


def _forced_rows(native: bool, dense: bool = False) -> int:
    """Up to how many rows a native kernel with vector code serves a step whatever the timing (none without
    vector code): `SAME_BITS_ROWS` (see `_amx_rows`), and for a dense weight every step the native decoder
    may take (`NATIVE_STEP_ROWS`) where AMX takes every bf16 step, else `FORCED_DENSE_ROWS`, a batch of 32
    decoding sequences. Where oneDNN took such a step for one layer, the whole step would leave the decoder
    for the layer-by-layer path, some 300 Python calls, which cost more than oneDNN saves there: with AMX
    our routine stays within a sixth of oneDNN's up to 256 rows, and without it the two kernels' crossover
    lies near 32 rows, where timing noise moves it by a third from one timing to the next. A quantized
    weight's larger steps go through its dequantized tiles, which the decoder runs too."""
    if not native:
        return 0
    if not dense:
        return SAME_BITS_ROWS
    return max(SAME_BITS_ROWS, NATIVE_STEP_ROWS if cheap_bf16_rows() else FORCED_DENSE_ROWS)


def _pack_dense(weight: torch.Tensor, keep_rows: bool, pad: bool) -> PackedLinear:
    n, k = weight.shape
    if weight.dtype != BF16 or not (prepacking_works(BF16) or available()):
        plain = _Plain(weight)
        return PackedLinear(n, k, plain, plain, _ALL, plain.rows, (weight,))
    plan = _dense_plan(n, k)
    if plan.native_rows == 0:
        onednn = _OneDNN(weight, pad)
        rows = _Plain(weight).rows if keep_rows else None
        return PackedLinear(
            n, k, onednn, onednn, 0, rows, (onednn.resident, *([weight] if keep_rows else []))
        )
    tiles = _BF16Tiles(weight, portable=not native_bf16())
    if not plan.keep_other:
        return PackedLinear(n, k, tiles, tiles, _ALL, tiles.rows, (tiles.tiles,))
    onednn = _OneDNN(weight, pad)
    small_rows = max(plan.native_rows, _forced_rows(native_bf16(), dense=True))
    return PackedLinear(n, k, tiles, onednn, small_rows, tiles.rows, (tiles.tiles, onednn.resident))


# -------------------------------------------------------------------------------------- quantized weights


class _Dequantize:
    """Dequantizes the weight on every call (no native kernel here, or a format it does not take)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize().to(x.dtype), bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.weight
        names = ("q", "scale", "offset") if isinstance(q, Int4Weight) else ("q", "scale")
        picked = {name: getattr(q, name).index_select(0, ids.flatten()) for name in names}
        return replace(q, **picked).dequantize().to(dtype).view(*ids.shape, q.shape[1])

    @property
    def resident(self) -> tuple[torch.Tensor, ...]:
        q = self.weight
        return tuple(t for t in (q.q, q.scale, getattr(q, "offset", None), q.perm) if t is not None)


def _fits_half(t: torch.Tensor) -> bool:
    return bool((t.half().float() == t).all())


class _QuantWeight(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("perm", ctypes.c_void_p),
        *(
            (name, ctypes.c_int)
            for name in ("n", "k", "k_in", "group", "sub", "bits", "half", "symmetric", "portable")
        ),
    ]


class _QuantTiles:
    """The native quantized kernel on the weight repacked into its tiles (see csrc/linear_quant.c):
    int4 stays 4 bits and int8 8 bits a weight, scales and offsets fp16 where that is exact, and no
    offsets kept where every one is -8 scales (symmetric int4: GGUF Q4_0, GPTQ's default)."""

    def __init__(self, weight: QuantizedWeight, portable: bool = False) -> None:
        n, k_in = weight.shape
        g, bits = weight.group_size, weight.bits
        k = -(-k_in // _XBLOCK) * _XBLOCK
        group = k if g == k_in else g
        sub = 16 if g == 16 else 32
        if group % sub or k % group:
            raise ValueError(f"groups of {g} columns are not a layout of the native quantized kernel.")
        self.n, self.k, self.k_in = n, k, k_in
        tiles, groups = -(-n // _QTILE), k // group
        q = torch.zeros(tiles * _QTILE, k, dtype=torch.uint8)
        q[:n, :k_in] = weight.q if bits == 4 else weight.q.view(torch.uint8) ^ 0x80
        if bits == 4:  # byte 4j + i of unit u: columns 8u + i (low nibble) and 8u + 4 + i (high)
            units = q.view(tiles, _QTILE, groups, group // 8, 2, 4)
            data = units[..., 0, :] | (units[..., 1, :] << 4)
        else:  # byte 4j + i of unit u: column 4u + i
            data = q.view(tiles, _QTILE, groups, group // 4, 4)
        symmetric = bits == 4 and torch.equal(weight.offset.float(), -8 * weight.scale.float())
        values = [weight.scale] + ([weight.offset] if bits == 4 and not symmetric else [])
        # [tiles * 16, groups] per value, zero where padded, then each tile's 16 values per group.
        values = [F.pad(v.float(), (0, groups - v.shape[1], 0, tiles * _QTILE - n)) for v in values]
        half = all(_fits_half(v) for v in values)
        values = [v.view(tiles, _QTILE, groups).transpose(1, 2).contiguous() for v in values]
        values = [(v.half() if half else v).view(torch.uint8).view(tiles, groups, -1) for v in values]
        self.packed = on_huge_pages(
            torch.cat([data.permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1), *values], dim=2).flatten()
        )
        self.perm = None if weight.perm is None else weight.perm.to(torch.int32).contiguous()
        perm_ptr = None if self.perm is None else self.perm.data_ptr()
        self.desc = _QuantWeight(
            self.packed.data_ptr(), perm_ptr, n, k, k_in, group, sub, bits, half, symmetric, portable
        )
        self.desc_ptr = ctypes.addressof(self.desc)
        self.fn = function("linear_quant", i32, ptr, ptr, i64, i32, i32, ptr, ptr, i32)
        self.rows_fn = function("quant_rows", i32, ptr, ptr, i32, i32, ptr, i32)

    @property
    def resident(self) -> tuple[torch.Tensor, ...]:
        return (self.packed,) if self.perm is None else (self.packed, self.perm)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype not in (BF16, torch.float32) or x.shape[1] != self.k_in:
            raise ValueError(
                f"a quantized [{self.n}, {self.k_in}] weight takes bf16 or fp32 [rows, {self.k_in}]."
            )
        if x.stride(1) != 1:
            x = x.contiguous()
        return self.run(self.fn, x, bias, x.dtype == BF16)

    def run(self, fn: Callable, x: torch.Tensor, bias: torch.Tensor | None, *flags: int) -> torch.Tensor:
        """out [rows, n] in x's dtype from the C routine `fn` (this weight, x's rows, `flags`, bias, out)."""
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        bias_ptr = None if bias is None else bias.data_ptr()
        args = (self.desc_ptr, x.data_ptr(), x.stride(0), x.shape[0], *flags, bias_ptr, out.data_ptr())
        if fn(*args, torch.get_num_threads()) != 0:
            raise MemoryError("no memory for the quantized linear layer's scratch buffers.")
        return out

    def rows(self, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (None: all) dequantized exactly as `dequantize()` gives them, in `dtype`."""
        flat = None if ids is None else ids.flatten().to(torch.int64).contiguous()
        count = self.n if flat is None else flat.numel()
        out_dtype = dtype if dtype in (BF16, torch.float32) else torch.float32
        out = torch.empty(count, self.k_in, dtype=out_dtype)
        ids_ptr = None if flat is None else flat.data_ptr()
        threads = torch.get_num_threads()
        if self.rows_fn(self.desc_ptr, ids_ptr, count, out_dtype == BF16, out.data_ptr(), threads) != 0:
            raise _bad_ids(self.n)
        if self.perm is not None:  # stored column c is input column perm[c]
            out = torch.empty_like(out).index_copy_(1, self.perm.long(), out)
        return out.to(dtype) if ids is None else out.to(dtype).view(*ids.shape, self.k_in)


class _DequantizedMatmul:
    """For many rows: what a bf16 copy of the weight would run. Where the bf16 kernel serves a weight of this
    shape at every row count (`_dense_plan`), the C side dequantizes one tile of outputs at a time into its
    pair tiles and runs it there, a tile's worth of memory a thread (`linear_quant_bf16`; with AMX, a step
    whose rows run in several groups keeps a thread's share of the tiles for the call). With AMX it does
    so up to `_AMX_TILE_ROWS` rows: there that beats dequantizing the whole weight for oneDNN, which must
    also reorder it on every call, even where oneDNN beats the bf16 kernel on a prepacked copy. Elsewhere
    (and beyond) the weight is dequantized whole for the call (C, all threads), then F.linear (oneDNN or
    MKL): in bf16 where oneDNN has a fast bf16 path (`prepacking_works`), else in fp32, several times faster
    on a CPU without AVX-512."""

    def __init__(self, tiles: _QuantTiles) -> None:
        self.tiles = tiles
        self.tile_rows: float = 0  # up to how many rows the tile-wise route runs
        if native_bf16() and native_amx():
            self.tile_rows = _AMX_TILE_ROWS
        elif native_bf16() and _dense_plan(tiles.n, tiles.k_in).native_rows == _ALL:
            self.tile_rows = _ALL
        self.fn = function("linear_quant_bf16", i32, ptr, ptr, i64, i32, i32, i32, ptr, ptr, i32)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype == BF16 and x.shape[0] <= self.tile_rows:
            return self._tiles_in_bf16(x, bias)
        if x.dtype == BF16 and not prepacking_works(BF16):
            bias = None if bias is None else bias.float()
            return F.linear(x.float(), self.tiles.rows(None, torch.float32), bias).to(BF16)
        return F.linear(x, self.tiles.rows(None, x.dtype), bias)

    def rows_taken_as_given(self) -> float:
        """Up to how many bf16 rows go through the tiles with x as it is (no permutation of its columns, no
        padding): the steps the native decoder may send there itself (0: none)."""
        tiles = self.tiles
        return self.tile_rows if tiles.perm is None and tiles.k == tiles.k_in else 0

    def _tiles_in_bf16(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tiles = self.tiles
        if tiles.perm is not None:  # stored column c multiplies x[perm[c]]
            x = x.index_select(1, tiles.perm.long())
        if x.stride(1) != 1 or tiles.k != tiles.k_in:
            x = F.pad(x, (0, tiles.k - tiles.k_in))  # contiguous, and zero in the padded columns
        return tiles.run(self.fn, x, bias, _fma_rows(), _amx_rows())


def native_quant() -> bool:
    """Whether the quantized kernel runs vector code here, AVX512-VNNI or AVX2 (else its plain C loops, or
    nothing)."""
    fn = function("linear_quant_native", i32)
    return fn is not None and bool(fn())


def cheap_bf16_rows() -> bool:
    """Whether a few more rows a step cost the bf16 kernel little here: AMX takes every step (`_amx_rows`),
    each of its tile products serving up to 16 rows."""
    return _amx_rows() == 1


def cheap_quant_rows() -> bool:
    """Whether a few more rows a step cost the quantized kernel little here (AVX512-VNNI). On AVX2 a step
    of 5 rows through the bundled model's Q4_1 layers took 3.2x one row, so speculation's verification steps
    cost about what their accepted tokens save."""
    fn = function("linear_quant_vnni", i32)
    return fn is not None and bool(fn())


def time_quant_prefetch(weights: Iterable[PackedLinear], rounds: int = 5) -> dict[int, float]:
    """Sets how far ahead of its loads the quantized kernel prefetches its weight stream: the fastest of
    `QUANT_PREFETCH_BYTES` on one row through the quantized weights among `weights` (a model's own, so the
    stream is as long as a decode step's and as cold), interleaved, best of `rounds`. Which distance wins
    depends on the machine, by a third of a step where it does. Returns each distance's best seconds (empty,
    and nothing set, without quantized weights on the native kernel). The setting is the process's: the
    last model loaded sets it for all, on the same machine."""
    tiles = [w.small for w in weights if isinstance(w.small, _QuantTiles)]
    set_distance = function("linear_quant_set_prefetch", None, i32)
    if not tiles or set_distance is None:
        return {}
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, t.k_in, generator=gen).to(BF16) for t in tiles]
    best = dict.fromkeys(QUANT_PREFETCH_BYTES, math.inf)
    for _ in range(rounds):
        for distance in best:
            set_distance(distance)
            start = time.perf_counter()
            for t, x in zip(tiles, inputs, strict=True):
                t(x, None)
            best[distance] = min(best[distance], time.perf_counter() - start)
    set_distance(min(best, key=best.__getitem__))
    return best


def _random_weight(kind: type, n: int, k: int, group: int, act_order: bool) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(n, k // group, generator=gen).half().float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    if kind is Int4Weight:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return Int4Weight(q, scale, -8 * scale, group, perm)
    return kind(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), scale, group)


@cache
def _quant_plan(
    kind: type, n: int, k: int, group: int, act_order: bool, dtype: torch.dtype, threads: int
) -> _Plan:
    """Native kernel or dequantize + matmul, timed once per machine, format, shape and thread count on a
    random weight."""

    floor = _forced_rows(native_quant())

    def time_it() -> _Plan:
        tiles = _QuantTiles(_random_weight(kind, n, k, group, act_order), portable=not native_quant())
        return _timed_plan(tiles, _DequantizedMatmul(tiles), k, dtype, other_costs_memory=False, floor=floor)

    key = f"{kind.__name__} [{n}, {k}] group {group} act-order {act_order} {dtype} above {floor} rows"
    key += f" on {threads} threads"
    return _remembered(key, time_it)


def _pack_quantized(weight: QuantizedWeight, dtype: torch.dtype) -> PackedLinear:
    n, k = weight.shape
    fallback = _Dequantize(weight)
    if not available():
        return PackedLinear(n, k, fallback, fallback, _ALL, fallback.rows, fallback.resident)
    try:
        tiles = _QuantTiles(weight, portable=not native_quant())
    except ValueError:
        return PackedLinear(n, k, fallback, fallback, _ALL, fallback.rows, fallback.resident)
    plan = _quant_plan(
        type(weight), n, k, weight.group_size, weight.perm is not None, dtype, torch.get_num_threads()
    )
    large = tiles if plan.native_rows == _ALL else _DequantizedMatmul(tiles)
    small_rows = max(plan.native_rows, _forced_rows(native_quant()))
    return PackedLinear(n, k, tiles, large, small_rows, tiles.rows, tiles.resident)
