"""Linear layers on CUDA: dense weights through cuBLAS, quantized ones (kernels/quantized.py) through a
Triton GEMM that dequantizes the packed weights in registers and feeds them to ``tl.dot``; a step of
`DEQUANTIZE_ROWS` rows or more (a prompt) dequantizes the weight once and multiplies on cuBLAS instead.

The same interface as `llmserve_kernels.cpu.linear`: `pack` once at load, `linear(x, packed)` every step.

Layout, repacked once in `pack` (``K`` input features padded with zeros to a multiple of ``CHUNK`` = 64,
``N`` output features, every tensor transposed so that a tile's ``N`` columns are contiguous in memory):

* `Int4Weight`: uint8 ``[K / 2, N]``, two values per byte. Within each chunk of 64 input features, byte row
  ``j`` holds feature ``j`` in its low nibble and feature ``j + 32`` in its high nibble, so a chunk unpacks
  into two 32-row halves with one mask and one shift, each half multiplied by its own half of the
  activations: no interleaving of nibbles inside the kernel.
* `Int8Weight`: int8 ``[K, N]``.
* scales (and int4 offsets): ``[groups, N]``, fp16 where that holds every value exactly (GGUF stores them
  in fp16; half the bytes of fp32 to read per group), else fp32. A per-channel int8 weight has one group.
* GPTQ act-order (``perm``): int32 ``[K]``; the kernel gathers the activations' columns in stored order.

A program owns a ``BLOCK_M x BLOCK_N`` output tile and walks the input features a chunk at a time. Where
the output tiles alone would leave SMs idle (decode: one row block, a few hundred columns), the features
are split between programs (split-K) that write fp32 partial sums, added up by a second small kernel:
decode reads the weights once, spread over the whole GPU. Which tiles and how many splits is decided on
the host from the shapes (`matmul_config`), so it is fixed for a CUDA graph captured at a batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import triton
import triton.language as tl
from llmserve_kernels.quantized import QuantizedWeight

from ._common import INTERPRET, dot_precision, sm_count

CHUNK = 64  # input features per step of the kernel: two halves of 32
HALF = CHUNK // 2
MAX_SPLIT_K = 16
# From this many rows a quantized layer dequantizes its weight and multiplies on cuBLAS, as vLLM's AWQ layer
# does from 256 tokens: a prompt-sized matmul runs several times faster there than in the fused kernel (see
# benchmarks/gpu_kernels.py), and one pass over the weight costs about what reading it does in the fused
# kernel.
DEQUANTIZE_ROWS = 256


@dataclass
class PackedQuantized:
    """A quantized weight in the layout of the module docstring."""

    q: torch.Tensor  # int4: uint8 [padded K / 2, N]; int8: int8 [padded K, N]
    scale: torch.Tensor  # [groups, N] fp16 or fp32
    offset: torch.Tensor | None  # [groups, N], int4 only
    perm: torch.Tensor | None  # int32 [K]
    group_size: int  # the padded K when the weight has one group per channel
    bits: int


@dataclass
class PackedLinear:
    out_features: int
    in_features: int
    dense: torch.Tensor | None = None
    quantized: PackedQuantized | None = None

    @property
    def nbytes(self) -> int:
        tensors = [self.dense]
        if self.quantized is not None:
            q = self.quantized
            tensors += [q.q, q.scale, q.offset, q.perm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, keep_rows: bool = False, pad: bool = False
) -> PackedLinear:
    """Packs a weight for activations of `dtype`. `keep_rows` and `pad` are the CPU packer's options:
    every layout here serves `embedding` lookups, and no row count runs faster padded."""
    out_features, in_features = weight.shape
    if isinstance(weight, torch.Tensor):
        return PackedLinear(out_features, in_features, dense=weight.to(dtype))
    return PackedLinear(out_features, in_features, quantized=_pack_quantized(weight))


def _pack_quantized(weight: QuantizedWeight) -> PackedQuantized:
    n, k = weight.shape
    padded_k = triton.cdiv(k, CHUNK) * CHUNK
    # One group spanning every real feature is a per-channel weight: give it the padding too.
    group = padded_k if weight.group_size >= k else weight.group_size
    groups = triton.cdiv(padded_k, group)
    q = F.pad(weight.q, (0, padded_k - k))
    if weight.bits == 4:
        halves = q.view(n, padded_k // CHUNK, 2, HALF)
        q = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [n, chunks, 32]: feature j and j + 32 of a chunk
        q = q.reshape(n, padded_k // 2)
    offset = getattr(weight, "offset", None)
    scales = [weight.scale, offset] if offset is not None else [weight.scale]
    scales = [F.pad(s.float(), (0, groups - s.shape[1])).t().contiguous() for s in scales]
    if all(torch.equal(s.half().float(), s) for s in scales):
        scales = [s.half() for s in scales]
    return PackedQuantized(
        q=q.t().contiguous(),
        scale=scales[0],
        offset=scales[1] if offset is not None else None,
        perm=None if weight.perm is None else weight.perm.to(torch.int32).contiguous(),
        group_size=group,
        bits=weight.bits,
    )


def dequantize_rows(packed: PackedLinear, rows: torch.Tensor) -> torch.Tensor:
    """Output rows ``rows`` of a quantized weight as fp32 ``[len(rows), in_features]``, input order."""
    p = packed.quantized
    q = p.q[:, rows].int()  # [padded K (/ 2), len(rows)]
    if p.bits == 4:
        q = torch.stack(((q & 15).view(-1, HALF, len(rows)), (q >> 4).view(-1, HALF, len(rows))), dim=1)
        q = q.view(-1, len(rows))
    group = torch.arange(q.shape[0], device=q.device) // p.group_size
    w = q.float() * p.scale[:, rows].float()[group]
    if p.offset is not None:
        w += p.offset[:, rows].float()[group]
    w = w[: packed.in_features].t()
    if p.perm is not None:
        w = torch.empty_like(w).index_copy_(1, p.perm.long(), w)
    return w


@triton.jit
def _weight_halves(
    q_ptr,
    scale_ptr,
    offset_ptr,
    chunk,
    offs_n,
    n_mask,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HALF: tl.constexpr,
):
    """The weight of one chunk's two halves of input features for columns ``offs_n`` (``n_mask``: [1, N]),
    dequantized in fp32: [HALF, BLOCK_N] each. The fused kernel and `_dequantize_kernel` both take their
    values from here, so a prompt's dense matmul sees the values a decode step's dots see."""
    offs_h = tl.arange(0, HALF)
    k_lo = chunk * 2 * HALF + offs_h
    k_hi = k_lo + HALF
    if INT4:
        rows = chunk * HALF + offs_h
        packed = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q + offs_n[None, :], mask=n_mask)
        w_lo = (packed & 15).to(tl.float32)
        w_hi = (packed >> 4).to(tl.float32)
    else:
        w_lo = tl.load(q_ptr + k_lo.to(tl.int64)[:, None] * stride_q + offs_n[None, :], mask=n_mask)
        w_hi = tl.load(q_ptr + k_hi.to(tl.int64)[:, None] * stride_q + offs_n[None, :], mask=n_mask)
        w_lo = w_lo.to(tl.float32)
        w_hi = w_hi.to(tl.float32)

    # Scales: one row per half when groups are whole halves, else one per feature.
    if GROUP % HALF == 0:
        g_lo = chunk * 2 * HALF // GROUP
        g_hi = (chunk * 2 * HALF + HALF) // GROUP
    else:
        g_lo = (k_lo // GROUP)[:, None]
        g_hi = (k_hi // GROUP)[:, None]
    w_lo *= tl.load(scale_ptr + g_lo * stride_s + offs_n[None, :], mask=n_mask).to(tl.float32)
    w_hi *= tl.load(scale_ptr + g_hi * stride_s + offs_n[None, :], mask=n_mask).to(tl.float32)
    if HAS_OFFSET:
        w_lo += tl.load(offset_ptr + g_lo * stride_s + offs_n[None, :], mask=n_mask).to(tl.float32)
        w_hi += tl.load(offset_ptr + g_hi * stride_s + offs_n[None, :], mask=n_mask).to(tl.float32)
    return w_lo, w_hi


@triton.jit
def _quantized_matmul_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    chunks_per_split,
    stride_xm,
    stride_q,
    stride_s,
    stride_om,
    stride_split,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    SWIZZLE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Output tiles in column-major groups of SWIZZLE row blocks, so that programs running together share
    # weight columns in L2 (matters when M spans several row blocks).
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    group_first = (tile // (SWIZZLE * tiles_n)) * SWIZZLE
    group_rows = tl.minimum(tiles_m - group_first, SWIZZLE)
    pid_m = group_first + (tile % (SWIZZLE * tiles_n)) % group_rows
    pid_n = (tile % (SWIZZLE * tiles_n)) // group_rows
    split = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    dot_dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * chunks_per_split
    last = tl.minimum(first + chunks_per_split, tl.cdiv(K, 2 * HALF))
    for chunk in range(first, last):
        k_lo = chunk * 2 * HALF + offs_h
        k_hi = k_lo + HALF
        # Activations: the two halves of the chunk (zero past K, where the packed weight is zero too).
        lo_mask = k_lo < K
        hi_mask = k_hi < K
        if HAS_PERM:
            col_lo = tl.load(perm_ptr + k_lo, mask=lo_mask, other=0)
            col_hi = tl.load(perm_ptr + k_hi, mask=hi_mask, other=0)
        else:
            col_lo = k_lo
            col_hi = k_hi
        x_lo = tl.load(x_rows + col_lo[None, :], mask=m_mask[:, None] & lo_mask[None, :], other=0.0)
        x_hi = tl.load(x_rows + col_hi[None, :], mask=m_mask[:, None] & hi_mask[None, :], other=0.0)

        w_lo, w_hi = _weight_halves(
            q_ptr,
            scale_ptr,
            offset_ptr,
            chunk,
            offs_n,
            n_mask[None, :],
            stride_q,
            stride_s,
            GROUP,
            INT4,
            HAS_OFFSET,
            HALF,
        )
        acc = tl.dot(x_lo.to(dot_dtype), w_lo.to(dot_dtype), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_hi.to(dot_dtype), w_hi.to(dot_dtype), acc, input_precision=DOT_PRECISION)

    out_offsets = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + split.to(tl.int64) * stride_split + out_offsets, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    scale_ptr,
    offset_ptr,
    out_ptr,
    N,
    stride_q,
    stride_s,
    stride_o,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One chunk of input features by BLOCK_N output columns of the weight, rounded to the output's dtype as
    the fused kernel rounds them before its dots, to ``out [padded K, N]`` in stored order."""
    chunk = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n[None, :] < N
    w_lo, w_hi = _weight_halves(
        q_ptr, scale_ptr, offset_ptr, chunk, offs_n, n_mask, stride_q, stride_s, GROUP, INT4, HAS_OFFSET, HALF
    )
    k_lo = chunk * 2 * HALF + tl.arange(0, HALF)
    out_rows = out_ptr + k_lo.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_rows, w_lo.to(out_dtype), mask=n_mask)
    tl.store(out_rows + HALF * stride_o, w_hi.to(out_dtype), mask=n_mask)


@triton.jit
def _sum_splits_kernel(
    partial_ptr, bias_ptr, out_ptr, size, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    total = tl.zeros([BLOCK], tl.float32)
    for split in range(0, splits):
        total += tl.load(partial_ptr + split * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    split_k: int
    chunks_per_split: int
    num_warps: int
    num_stages: int


def matmul_config(m: int, n: int, k: int, num_sms: int) -> MatmulConfig:
    """Tile sizes for ``m`` rows, and enough K splits for about two programs per SM when the output tiles
    alone are fewer; every split gets at least one chunk (a function of shapes only: no device sync)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 128 else 128
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    chunks = triton.cdiv(k, CHUNK)
    split_k = max(1, min(triton.cdiv(2 * num_sms, tiles), chunks, MAX_SPLIT_K)) if tiles < num_sms else 1
    chunks_per_split = triton.cdiv(chunks, split_k)
    split_k = triton.cdiv(chunks, chunks_per_split)  # no split left without a chunk
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return MatmulConfig(block_m, block_n, split_k, chunks_per_split, num_warps, num_stages=3)


def quantized_matmul(
    x: torch.Tensor,
    packed: PackedLinear,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` for a quantized ``packed`` weight, in ``x``'s dtype with fp32 accumulation.

    Reference: ``x.float() @ weight.dequantize().T``. ``config`` overrides `matmul_config`'s choice.
    """
    p = packed.quantized
    m, k = x.shape
    n = packed.out_features
    if k != packed.in_features:
        raise ValueError(f"x has {k} features, the weight takes {packed.in_features}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    config = config or matmul_config(m, n, k, sm_count(x.device))
    partial = config.split_k > 1
    target = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k)
    _quantized_matmul_kernel[grid](
        x,
        p.q,
        p.scale,
        p.scale if p.offset is None else p.offset,
        x if p.perm is None else p.perm,
        x if bias is None else bias,
        target,
        m,
        n,
        k,
        config.chunks_per_split,
        x.stride(0),
        p.q.stride(0),
        p.scale.stride(0),
        target.stride(-2),
        target.stride(0) if partial else 0,
        GROUP=p.group_size,
        INT4=p.bits == 4,
        HAS_OFFSET=p.offset is not None,
        HAS_PERM=p.perm is not None,
        HAS_BIAS=bias is not None,
        PARTIAL=partial,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HALF=HALF,
        SWIZZLE=8,
        UPCAST=INTERPRET,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if partial:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target,
            target if bias is None else bias,
            out,
            m * n,
            n,
            config.split_k,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out


def dequantize(packed: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """A quantized weight as ``dtype [padded K, out]``, its rows in stored order (act-order rows stay
    permuted), each value rounded as the fused kernel rounds it before its dots."""
    p = packed.quantized
    padded_k = p.q.shape[0] * (2 if p.bits == 4 else 1)
    n = packed.out_features
    out = torch.empty(padded_k, n, dtype=dtype, device=p.q.device)
    block_n = 128
    _dequantize_kernel[(padded_k // CHUNK, triton.cdiv(n, block_n))](
        p.q,
        p.scale,
        p.scale if p.offset is None else p.offset,
        out,
        n,
        p.q.stride(0),
        p.scale.stride(0),
        out.stride(0),
        GROUP=p.group_size,
        INT4=p.bits == 4,
        HAS_OFFSET=p.offset is not None,
        HALF=HALF,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def dequantized_matmul(
    x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`quantized_matmul` for many rows: the weight dequantized once, then one dense matmul."""
    p = packed.quantized
    if x.shape[1] != packed.in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes {packed.in_features}")
    weight = dequantize(packed, x.dtype)[: packed.in_features]
    if p.perm is not None:  # stored row k multiplies input feature perm[k]
        x = x.index_select(1, p.perm)
    return torch.addmm(bias, x, weight) if bias is not None else x @ weight


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype."""
    if packed.quantized is None:
        return F.linear(x, packed.dense, bias)
    rows = x.reshape(-1, x.shape[-1])
    matmul = dequantized_matmul if rows.shape[0] >= DEQUANTIZE_ROWS else quantized_matmul
    return matmul(rows, packed, bias).view(*x.shape[:-1], packed.out_features)


def embedding(ids: torch.Tensor, packed: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized to `dtype` (embedding lookups of a tied weight)."""
    if packed.quantized is not None:
        return dequantize_rows(packed, ids.reshape(-1)).to(dtype).view(*ids.shape, packed.in_features)
    return F.embedding(ids, packed.dense)
