"""Weights packed for the CPU's linear routines, and the routines that run them.

A linear layer at small batch is bound by reading its weight from memory, so each weight is repacked once
into the layout a native kernel streams best (`csrc/linear_bf16.c` for dense bf16, `csrc/linear_quant.c`
for kernels/quantized.py weights, kept quantized), in memory backed by huge pages (`huge_pages`), or
handed to oneDNN prepacked. Each routine is `routine(x, bias)`; those that keep the rows also serve
embedding lookups (`routine.rows(ids, dtype)`). Which vector routine the bf16 kernel runs from how many
rows is this CPU's own and is timed once, with the kernel (`_amx_rows`, `_fma_rows`); which routine serves
a layer is the layer's choice (linear.py).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import replace
from functools import cache

import torch
import torch.nn.functional as F

from llmserve_kernels.cpu._build import function, i32, i64, ptr
from llmserve_kernels.cpu.huge_pages import on_huge_pages
from llmserve_kernels.cpu.linear_tuning import ALL, timed_plan
from llmserve_kernels.cpu.plan_cache import Plan, remembered
from llmserve_kernels.quantized import Int4Weight, QuantizedWeight
from llmserve_kernels.timing import best_time, interleaved_best

BF16 = torch.bfloat16
_PACK_BATCH_HINT = 32  # oneDNN picks its layout for this many rows; measured as good for 1..2048 rows
_PADDED_ROWS = 33
_TILE = 32  # output rows per tile of the bf16 kernel (TILE in linear_bf16.c)
_QTILE = 16  # output rows per tile of the quantized kernel (QTILE in linear_quant.c)
_XBLOCK = 32  # columns of x per int8 scale (XBLOCK in linear_quant.c)

# Steps of up to this many rows give each row the bits it gets alone (see _amx_rows): the native kernels serve
# them even where oneDNN measures faster, and take AMX only beyond; with `batch_invariant()`, every step.
SAME_BITS_ROWS = 20


def batch_invariant() -> bool:
    """Whether every row of a linear layer gets the bits it gets alone, whatever rows share its step: the
    native kernels then serve every row count, each through one routine (AMX from the first row), and never
    hand a step to oneDNN or to a dequantized copy, whose sums round otherwise. A greedy request then gives
    the same tokens alone, in any batch, and with its prefix from the prefix cache.

    The default where the CPU has AMX tiles, which take a prompt's many rows through that one routine at a
    small cost. Without them (AVX2, AVX-512 without AMX) the routine that gives one row its bits runs a
    prompt's rows several times slower than a dequantized matmul, so there it is off by default.
    LLMSERVE_BATCH_INVARIANT=1 or 0 decides either way."""
    setting = os.environ.get("LLMSERVE_BATCH_INVARIANT")
    return native_amx() if setting is None else setting != "0"


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
    on 24, so a step of 17-32 rows is best padded: it depends on the CPU (AMX or not) and the shape."""
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


def native_amx() -> bool:
    """Whether the bf16 kernel can multiply through AMX tiles here (the CPU has them, Linux allows them)."""
    fn = function("linear_bf16_amx_routine", i32)
    return fn is not None and bool(fn())


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
    row alone, the choice would flip with the timing noise where the two tie. With `batch_invariant()`, AMX
    takes every step: no routine changes with the row count."""
    if not native_amx():
        return 0
    return 1 if batch_invariant() else _timed_amx_rows()


@cache
def _timed_amx_rows() -> int:
    """`_amx_rows` as timed on this machine."""

    def time_it() -> Plan:
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
        return Plan(0 if amx_time <= vector_time else SAME_BITS_ROWS, keep_other=True)

    return (
        int(remembered("bf16 vector rows before amx [3072, 576] x8, 1 and 4 rows", time_it).native_rows) + 1
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

    def time_it() -> Plan:
        weight = torch.randn(3072, 576, generator=torch.Generator().manual_seed(0)).to(BF16)
        vdpbf16, fma = _BF16Tiles(weight, fma_rows=0, amx_rows=0), _BF16Tiles(weight, fma_rows=1, amx_rows=0)
        return timed_plan(vdpbf16, fma, weight.shape[1], BF16, other_costs_memory=False, one_thread=True)

    rows = remembered("bf16 fma [3072, 576]", time_it).native_rows
    return 0 if rows == ALL else int(rows) + 1


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


def native_quant() -> bool:
    """Whether the quantized kernel runs vector code here, AVX512-VNNI or AVX2 (else its plain C loops, or
    nothing)."""
    fn = function("linear_quant_native", i32)
    return fn is not None and bool(fn())
