"""Linear layers on the CPU: weights packed once at load, then `linear(x, packed)` every step.

Each weight is packed into the routines of `linear_pack` (native bf16 or quantized kernel, oneDNN's
prepacked linear, dequantize and matmul). Which routine serves which number of rows is measured once per
weight shape when the weight is packed (`linear_tuning`, remembered across starts by `plan_cache`) and fixed
then: `linear` only compares the row count with a number. With batch invariance (the default, see
`linear_pack.batch_invariant`) there is no such choice: the native kernel serves every row count. The same
packed layout serves embedding lookups of a tied weight, so no second plain copy is kept.

With LLMSERVE_CPU_KERNELS=0 or without a compiler, dense bf16 weights run through oneDNN's prepacked
linear and quantized weights are dequantized on every call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from llmserve_kernels.cpu._build import available, function, i32, i64, ptr
from llmserve_kernels.cpu.linear_pack import (
    SAME_BITS_ROWS,
    _amx_rows,
    _BF16Tiles,
    _Dequantize,
    _fma_rows,
    _OneDNN,
    _Plain,
    _QuantTiles,
    batch_invariant,
    native_amx,
    native_bf16,
    native_quant,
    prepacking_works,
)
from llmserve_kernels.cpu.linear_tuning import ALL, timed_plan
from llmserve_kernels.cpu.plan_cache import Plan, remembered
from llmserve_kernels.quantized import Int4Weight, QuantizedWeight

BF16 = torch.bfloat16
# Up to this many rows, a quantized weight's tiles dequantized one at a time into AMX beat the weight
# dequantized whole for oneDNN; beyond, oneDNN's AMX matmul, blocked for many rows, outruns our AMX routine
# (measured on the bundled model: benchmarks/results/kernel-and-runner-timings.md).
_AMX_TILE_ROWS = 2048

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


def _dense_plan(n: int, k: int) -> Plan:
    """Native bf16 kernel or oneDNN, timed once per machine, weight shape and thread count (see
    `linear_tuning.timed_plan`) on a random weight."""
    return _dense_plan_on(n, k, torch.get_num_threads(), batch_invariant())


@cache
def _dense_plan_on(n: int, k: int, threads: int, invariant: bool) -> Plan:
    if not available():
        return Plan(0, keep_other=True)
    if not prepacking_works(BF16) or (invariant and native_bf16()):
        return Plan(ALL, keep_other=False)

    floor = _forced_rows(native_bf16(), dense=True)

    def time_it() -> Plan:
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(BF16)
        native, onednn = _BF16Tiles(weight, portable=not native_bf16()), _OneDNN(weight, pad=False)
        return timed_plan(native, onednn, k, BF16, other_costs_memory=True, floor=floor)

    return remembered(f"bf16 [{n}, {k}] above {floor} rows on {threads} threads", time_it)


def _forced_rows(native: bool, dense: bool = False) -> int:
    """Up to how many rows a native kernel with vector code serves a step whatever the timing (none without
    vector code): `SAME_BITS_ROWS` (see `_amx_rows`), and for a dense weight every step the native decoder
    may take (`NATIVE_STEP_ROWS`) where AMX takes every bf16 step, else `FORCED_DENSE_ROWS`, a batch of 32
    decoding sequences. Where oneDNN took such a step for one layer, the whole step would leave the decoder
    for the layer-by-layer path, some 300 Python calls, which cost more than oneDNN saves there: with AMX
    our routine stays close to oneDNN's up to 256 rows, and without it the two kernels' crossover lies where
    timing noise moves it from one timing to the next (measured: benchmarks/results/
    kernel-and-runner-timings.md). A quantized weight's larger steps go through its dequantized tiles, which
    the decoder runs too."""
    if not native:
        return 0
    if not dense:
        return SAME_BITS_ROWS
    return max(SAME_BITS_ROWS, NATIVE_STEP_ROWS if cheap_bf16_rows() else FORCED_DENSE_ROWS)


def _pack_dense(weight: torch.Tensor, keep_rows: bool, pad: bool) -> PackedLinear:
    n, k = weight.shape
    if weight.dtype != BF16 or not (prepacking_works(BF16) or available()):
        plain = _Plain(weight)
        return PackedLinear(n, k, plain, plain, ALL, plain.rows, (weight,))
    plan = _dense_plan(n, k)
    if plan.native_rows == 0:
        onednn = _OneDNN(weight, pad)
        rows = _Plain(weight).rows if keep_rows else None
        return PackedLinear(
            n, k, onednn, onednn, 0, rows, (onednn.resident, *([weight] if keep_rows else []))
        )
    tiles = _BF16Tiles(weight, portable=not native_bf16())
    if not plan.keep_other:
        return PackedLinear(n, k, tiles, tiles, ALL, tiles.rows, (tiles.tiles,))
    onednn = _OneDNN(weight, pad)
    small_rows = max(plan.native_rows, _forced_rows(native_bf16(), dense=True))
    return PackedLinear(n, k, tiles, onednn, small_rows, tiles.rows, (tiles.tiles, onednn.resident))


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
        elif native_bf16() and _dense_plan(tiles.n, tiles.k_in).native_rows == ALL:
            self.tile_rows = ALL
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


def cheap_bf16_rows() -> bool:
    """Whether a few more rows a step cost the bf16 kernel little here: AMX takes every step (`_amx_rows`),
    each of its tile products serving up to 16 rows."""
    return _amx_rows() == 1


def cheap_quant_rows() -> bool:
    """Whether a few more rows a step cost the quantized kernel little here (AVX512-VNNI). On AVX2 a step of
    a few rows costs several times one row, so speculation's verification steps cost about what their
    accepted tokens save."""
    fn = function("linear_quant_vnni", i32)
    return fn is not None and bool(fn())


def time_quant_prefetch(weights: Iterable[PackedLinear], rounds: int = 5) -> dict[int, float]:
    """Sets how far ahead of its loads the quantized kernel prefetches its weight stream: the fastest of
    `QUANT_PREFETCH_BYTES` on one row through the quantized weights among `weights` (a model's own, so the
    stream is as long as a decode step's and as cold), interleaved, best of `rounds`. Which distance wins
    depends on the machine (timings: benchmarks/results/kernel-and-runner-timings.md). Returns each
    distance's best seconds (empty, and nothing set, without quantized weights on the native kernel). The
    setting is the process's: the last model loaded sets it for all, on the same machine."""
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
) -> Plan:
    """Native kernel or dequantize + matmul, timed once per machine, format, shape and thread count on a
    random weight."""

    floor = _forced_rows(native_quant())

    def time_it() -> Plan:
        tiles = _QuantTiles(_random_weight(kind, n, k, group, act_order), portable=not native_quant())
        return timed_plan(tiles, _DequantizedMatmul(tiles), k, dtype, other_costs_memory=False, floor=floor)

    key = f"{kind.__name__} [{n}, {k}] group {group} act-order {act_order} {dtype} above {floor} rows"
    key += f" on {threads} threads"
    return remembered(key, time_it)


def _pack_quantized(weight: QuantizedWeight, dtype: torch.dtype) -> PackedLinear:
    n, k = weight.shape
    fallback = _Dequantize(weight)
    if not available():
        return PackedLinear(n, k, fallback, fallback, ALL, fallback.rows, fallback.resident)
    try:
        tiles = _QuantTiles(weight, portable=not native_quant())
    except ValueError:
        return PackedLinear(n, k, fallback, fallback, ALL, fallback.rows, fallback.resident)
    if batch_invariant() and native_quant():  # with AMX-INT8, many rows at a time through its tiles
        return PackedLinear(n, k, tiles, tiles, ALL, tiles.rows, tiles.resident)
    plan = _quant_plan(
        type(weight), n, k, weight.group_size, weight.perm is not None, dtype, torch.get_num_threads()
    )
    large = tiles if plan.native_rows == ALL else _DequantizedMatmul(tiles)
    small_rows = max(plan.native_rows, _forced_rows(native_quant()))
    return PackedLinear(n, k, tiles, large, small_rows, tiles.rows, tiles.resident)
