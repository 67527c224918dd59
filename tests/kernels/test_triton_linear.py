"""Quantized linear layers on the Triton path against ``x.float() @ weight.dequantize().T``."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from llmserve_kernels.quantized import Int4Weight, Int8Weight
from llmserve_kernels.triton.linear import (
    CHUNK,
    DEQUANTIZE_ROWS,
    MAX_SPLIT_K,
    dequantize,
    dequantize_rows,
    embedding,
    linear,
    matmul_config,
    pack,
    quantized_matmul,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Relative to the largest output: the GPU rounds each dequantized weight to the activation dtype before
# tl.dot (the interpreter keeps fp32), and the output is rounded once.
TOLERANCE = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}

# (in_features, out_features): SmolLM2-135M's projections, a 4096 -> 11008-like MLP scaled down for the
# interpreter, and widths that are no multiple of a chunk or of a tile.
SHAPES = [(576, 960), (1536, 576), (512, 1376), (160, 100)]
ROWS = [1, 3, 16, 70]


def int4_weight(gen, out_features, in_features, group_size, act_order=False, gguf=False) -> Int4Weight:
    """GGUF-like (fp16 d and m, stored exactly in fp16 by `pack`) or AWQ/GPTQ-like (offset -s * z in fp32)."""
    groups = in_features // group_size
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3
    if gguf:
        scale = scale.half().float()
        offset = (-8 * scale + torch.randn(out_features, groups, generator=gen) * 1e-3).half().float()
    else:
        offset = -scale * torch.randint(0, 16, (out_features, groups), generator=gen).float()
    perm = torch.randperm(in_features, generator=gen) if act_order else None
    return Int4Weight(q=q, scale=scale, offset=offset, group_size=group_size, perm=perm)


def int8_weight(gen, out_features, in_features, group_size) -> Int8Weight:
    groups = in_features // group_size
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, groups, generator=gen) * 0.002 + 1e-4
    return Int8Weight(q=q, scale=scale, group_size=group_size)


FORMATS = {
    "int4-g32-gguf": lambda gen, n, k: int4_weight(gen, n, k, 32, gguf=True),
    "int4-g128": lambda gen, n, k: int4_weight(gen, n, k, 128 if k % 128 == 0 else 32),
    "int4-g128-act-order": lambda gen, n, k: int4_weight(
        gen, n, k, 128 if k % 128 == 0 else 32, act_order=True
    ),
    "int8-g16": lambda gen, n, k: int8_weight(gen, n, k, 16),
    "int8-g32": lambda gen, n, k: int8_weight(gen, n, k, 32),
    "int8-per-channel": lambda gen, n, k: int8_weight(gen, n, k, k),
}


def _to(weight, device):
    names = ("q", "scale", "offset", "perm") if isinstance(weight, Int4Weight) else ("q", "scale")
    return replace(
        weight, **{n: getattr(weight, n).to(device) for n in names if getattr(weight, n) is not None}
    )


def _assert_matmul_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOLERANCE[out.dtype] * float(ref.abs().max())
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), atol=tol, rtol=0)


# Every format meets every row count and every shape, in 4 x 6 cases rather than 4 x 4 x 6 (the interpreter
# takes seconds a case).
MATMUL_CASES = [
    (fmt, *SHAPES[(i + j) % len(SHAPES)], rows)
    for i, fmt in enumerate(FORMATS)
    for j, rows in enumerate(ROWS)
]


@pytest.mark.parametrize(("fmt", "in_features", "out_features", "rows"), MATMUL_CASES)
def test_quantized_linear_matches_dequantized_reference(
    gen, rand, device, fmt, in_features, out_features, rows
):
    weight = _to(FORMATS[fmt](gen, out_features, in_features), device)
    x = rand(rows, in_features, dtype=BF16)

    out = linear(x, pack(weight, BF16))

    assert out.shape == (rows, out_features) and out.dtype == BF16
    _assert_matmul_close(out, x.float() @ weight.dequantize().T)


@pytest.mark.parametrize(
    ("fmt", "dtype", "split_k"),
    [
        ("int4-g128-act-order", F16, 1),
        ("int4-g32-gguf", F32, 1),
        ("int8-g16", F16, 3),
        ("int8-per-channel", F32, 2),
    ],
)
def test_dtypes_bias_and_fixed_splits(gen, rand, device, fmt, dtype, split_k):
    """Bias added once (in the epilogue, or after the splits are summed); results independent of the split."""
    in_features, out_features, rows = 384, 200, 19
    weight = _to(FORMATS[fmt](gen, out_features, in_features), device)
    packed = pack(weight, dtype)
    x = rand(rows, in_features, dtype=dtype)
    bias = rand(out_features, dtype=dtype)
    chunks = in_features // CHUNK
    config = replace(
        matmul_config(rows, out_features, in_features, num_sms=132),
        split_k=split_k,
        chunks_per_split=-(-chunks // split_k),
    )

    out = quantized_matmul(x, packed, bias, config=config)

    assert out.dtype == dtype
    _assert_matmul_close(out, x.float() @ weight.dequantize().T + bias.float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_large_steps_multiply_the_dequantized_weight(gen, rand, device, fmt):
    """From DEQUANTIZE_ROWS rows the weight is dequantized once (each value as the fused kernel computes
    it, rows in stored order) and multiplied densely: the same result, bias added once."""
    in_features, out_features = 160, 200  # K padded to 192, N past one column block
    weight = _to(FORMATS[fmt](gen, out_features, in_features), device)
    packed = pack(weight, BF16)
    x = rand(DEQUANTIZE_ROWS, in_features, dtype=BF16)
    bias = rand(out_features, dtype=BF16)

    stored = dequantize(packed, torch.float32)
    assert stored.shape == (192, out_features) and not stored[in_features:].any()
    reference = weight.dequantize().T
    if weight.perm is not None:
        reference = reference[weight.perm]
    torch.testing.assert_close(stored[:in_features], reference, rtol=1e-6, atol=1e-7)
    out = linear(x, packed, bias)
    _assert_matmul_close(out, x.float() @ weight.dequantize().T + bias.float())


def test_linear_keeps_leading_dimensions_and_strided_rows(gen, rand, device):
    weight = _to(FORMATS["int4-g32-gguf"](gen, 96, 128), device)
    x = rand(2, 5, 256, dtype=BF16)[..., :128]  # rows of a wider buffer

    out = linear(x, pack(weight, BF16))

    assert out.shape == (2, 5, 96)
    _assert_matmul_close(out, x.float() @ weight.dequantize().T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_keeps_every_value_and_embedding_reads_rows(gen, device, fmt):
    """The repacked layout dequantizes to exactly the original weight (padding, nibble halves, fp16 scales
    and act order undone), and `embedding` returns its rows."""
    weight = _to(FORMATS[fmt](gen, 50, 160), device)
    packed = pack(weight, BF16)

    assert torch.equal(dequantize_rows(packed, torch.arange(50, device=device)), weight.dequantize())
    ids = torch.tensor([[3, 0], [49, 3]], device=device)
    rows = embedding(ids, packed, BF16)
    assert rows.shape == (2, 2, 160) and rows.dtype == BF16
    assert torch.equal(rows, weight.dequantize()[ids].to(BF16))


def test_pack_takes_shards_of_a_weight(gen, rand, device):
    """Tensor-parallel shards and fused parts arrive as narrowed views (strided along the features)."""
    full = _to(FORMATS["int4-g128"](gen, 64, 512), device)
    shard = full.narrow(1, 128, 256)
    packed = pack(shard, BF16)

    assert torch.equal(dequantize_rows(packed, torch.arange(64, device=device)), shard.dequantize())
    x = rand(3, 256, dtype=BF16)
    _assert_matmul_close(linear(x, packed), x.float() @ shard.dequantize().T)


def test_packed_sizes(gen, device):
    """Q4 with fp16 scales: half a byte per weight plus 4 bytes per group of 32, as in a GGUF Q4_1 block."""
    gguf = pack(_to(int4_weight(gen, 960, 576, 32, gguf=True), device), BF16)
    assert gguf.quantized.scale.dtype == F16
    assert gguf.nbytes == 960 * 576 // 2 + 2 * 960 * (576 // 32) * 2
    assert gguf.nbytes == 960 * 576 // 32 * 20  # GGUF Q4_1: 20 bytes per block of 32 weights

    gptq = pack(_to(int4_weight(gen, 960, 576, 64, act_order=True), device), BF16)
    assert gptq.quantized.scale.dtype == F32  # -s * z is not exact in fp16: kept in fp32
    assert gptq.nbytes == 960 * 576 // 2 + 2 * 960 * 9 * 4 + 576 * 4

    per_channel = pack(_to(int8_weight(gen, 960, 100, 100), device), BF16)
    assert per_channel.quantized.q.shape == (2 * CHUNK, 960)  # 100 features padded to two chunks
    assert per_channel.nbytes == 2 * CHUNK * 960 + 960 * 4

    dense = pack(torch.zeros(960, 576, device=device), BF16)
    assert dense.nbytes == 960 * 576 * 2 and linear(
        torch.ones(1, 576, device=device).to(BF16), dense
    ).shape == (1, 960)


def test_linear_rejects_wrong_width(gen, rand, device):
    packed = pack(_to(int8_weight(gen, 8, 64, 64), device), F32)
    with pytest.raises(ValueError, match="features"):
        linear(rand(2, 32, dtype=F32), packed)


@pytest.mark.parametrize("rows", [1, 2, 16, 33, 70, 256, 4096])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(4096, 4096), (4096, 28672), (14336, 4096), (576, 960)]
)
def test_matmul_config_splits_cover_every_chunk_once(rows, in_features, out_features):
    config = matmul_config(rows, out_features, in_features, num_sms=132)
    chunks = -(-in_features // CHUNK)
    assert 1 <= config.split_k <= MAX_SPLIT_K
    assert (config.split_k - 1) * config.chunks_per_split < chunks <= config.split_k * config.chunks_per_split
    tiles = -(-rows // config.block_m) * -(-out_features // config.block_n)
    assert config.split_k == 1 or tiles < 132  # splits only where the tiles alone leave SMs idle


def test_decode_spreads_a_weight_over_the_gpu():
    """Batch-1 decode of Llama-8B's 4096 x 4096 projection: 64 column tiles alone would use half the SMs."""
    config = matmul_config(1, 4096, 4096, num_sms=132)
    assert (config.block_m, config.block_n) == (16, 64)
    assert config.split_k * 64 >= 264  # about two programs per SM
    assert matmul_config(4096, 4096, 4096, num_sms=132).split_k == 1
