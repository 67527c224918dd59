"""The CPU linear kernels (kernels/cpu/linear.py) against the fp32 matmul of the weight they were given
(`x.float() @ w.dequantize().T` for quantized weights), on fresh random inputs.

Every routine is run by itself (the native AVX-512 kernels, their plain C loops, oneDNN, dequantize and
matmul), so a CPU on which `pack` prefers one routine still tests the others. The tolerance is a bf16
matmul's: each output within 2^-8 of the sum of its products' magnitudes (|x| @ |w|^T), which covers
rounding the output to bf16 (2^-9); fp32 outputs within 2^-12.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from llmserve_kernels.cpu import huge_pages, linear_pack, linear_tuning, plan_cache
from llmserve_kernels.cpu import linear as cpu_linear
from llmserve_kernels.cpu._build import available, function, i32
from llmserve_kernels.quantized import Int4Weight, Int8Weight

BF16, FP32 = torch.bfloat16, torch.float32
ROWS = (1, 2, 3, 4, 5, 8, 16, 33, 300)
# SmolLM2-135M's projections (out, in): qkv, o, gate_up, down; then shapes that fill no whole tile
# (N not a multiple of 32 or 16, odd K).
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ODD_SHAPES = [(45, 33), (1, 7), (100, 64)]
LM_HEAD = (49152, 576)

needs_native = pytest.mark.skipif(not available(), reason="no C compiler: the native kernels cannot build")
needs_bf16 = pytest.mark.skipif(
    not cpu_linear.native_bf16(), reason="the bf16 kernel has no vector code for this CPU"
)
needs_vnni = pytest.mark.skipif(
    not cpu_linear.native_quant(), reason="the quantized kernel has no vector code for this CPU"
)
needs_amx = pytest.mark.skipif(not cpu_linear.native_amx(), reason="no AMX here")
needs_onednn = pytest.mark.skipif(not cpu_linear.prepacking_works(BF16), reason="no oneDNN prepacked linear")


def assert_matches(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
):
    """`out` is x @ weight^T (+ bias) to the tolerance of its dtype, with every element written."""
    reference = x.float() @ weight.float().T
    magnitude = x.float().abs() @ weight.float().abs().T
    if bias is not None:
        reference += bias.float()
        magnitude += bias.float().abs()
    assert out.shape == reference.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    tolerance = 2**-8 if out.dtype == BF16 else 2**-12
    error = (out.float() - reference).abs()
    worst = int((error - tolerance * magnitude).argmax())
    assert (error <= tolerance * magnitude + 1e-6).all(), (
        f"error {error.flatten()[worst]:.3g} where |x| @ |w| is {magnitude.flatten()[worst]:.3g}"
    )


def int4_weight(
    n: int, k: int, group: int, gen: torch.Generator, act_order=False, fp16=True, symmetric=False
) -> Int4Weight:
    """Q4_1-like (fp16 scales and offsets, exact in fp16), AWQ-like (fp32 offsets -scale * zero) or
    symmetric, Q4_0- and GPTQ-like (every offset -8 scales)."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) / 8).half().float()
    if symmetric:
        offset = -8 * scale
    elif fp16:
        offset = (-8 * scale + torch.randn(n, k // group, generator=gen) / 100).half().float()
    else:
        offset = -scale * torch.randint(0, 16, (n, k // group), generator=gen) * (1 + 1 / 3)
    perm = torch.randperm(k, generator=gen) if act_order else None
    return Int4Weight(q, scale, offset, group, perm)


def int8_weight(n: int, k: int, group: int, gen: torch.Generator) -> Int8Weight:
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return Int8Weight(q, (torch.rand(n, k // group, generator=gen) / 64).half().float(), group)


def rand(gen: torch.Generator, *shape: int, dtype=BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def spread(gen: torch.Generator, rows: int, k: int) -> torch.Tensor:
    """bf16 rows whose magnitudes spread over decades: where two routines' sums could round apart."""
    return rand(gen, rows, k) * torch.rand(rows, k, generator=gen).to(BF16) * 8


# -------------------------------------------------------------------------------------------- dense bf16

DENSE_ROUTINES = {
    "native": (lambda w: cpu_linear._BF16Tiles(w), [needs_native, needs_bf16]),
    "portable": (lambda w: cpu_linear._BF16Tiles(w, portable=True), [needs_native]),
    "vdpbf16": (lambda w: cpu_linear._BF16Tiles(w, fma_rows=0), [needs_native, needs_bf16]),
    "fma": (lambda w: cpu_linear._BF16Tiles(w, fma_rows=1), [needs_native, needs_bf16]),
    "amx": (lambda w: cpu_linear._BF16Tiles(w, amx_rows=1), [needs_native, needs_amx]),
    "onednn": (lambda w: cpu_linear._OneDNN(w, pad=False), [needs_onednn]),
}


@pytest.mark.parametrize(
    "routine", [pytest.param(name, marks=marks) for name, (_, marks) in DENSE_ROUTINES.items()]
)
@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_dense_bf16_routines_match_the_matmul(gen, routine, shape, rows):
    weight = rand(gen, *shape)
    x = rand(gen, rows, shape[1])
    assert_matches(DENSE_ROUTINES[routine][0](weight)(x, None), x, weight)


@needs_native
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_dense_bf16_bias_strided_rows_and_two_threads(gen, portable):
    if not portable and not cpu_linear.native_bf16():
        pytest.skip("the bf16 kernel has no vector code for this CPU")
    torch.set_num_threads(2)  # the tiles split between threads (restored by the conftest fixture)
    weight, bias = rand(gen, 200, 97), rand(gen, 200)
    wide = rand(gen, 7, 130)
    x = wide[:, 5:102]  # rows 130 elements apart
    routine = cpu_linear._BF16Tiles(weight, portable=portable)
    assert_matches(routine(x, bias), x, weight, bias)


@needs_native
@needs_bf16
@pytest.mark.parametrize("shape", [*MODEL_SHAPES, (200, 98), (45, 2)], ids=str)
def test_dense_bf16_fma_and_vdpbf16_give_the_same_bits(gen, shape):
    """The engine takes either routine by row count (timed per CPU): a token's logits must not depend on how
    many other tokens share its step, or speculative decoding and batching would change greedy outputs."""
    n, k = shape
    weight, bias = rand(gen, n, k), rand(gen, n)
    vdpbf16 = cpu_linear._BF16Tiles(weight, fma_rows=0, amx_rows=0)
    fma = cpu_linear._BF16Tiles(weight, fma_rows=1, amx_rows=0)
    wide = spread(gen, 40, k + 9)
    for rows in (1, 4, 13, 40):
        x = wide[:rows, 3 : 3 + k]  # strided rows, magnitudes spread over decades
        assert torch.equal(fma(x, bias), vdpbf16(x, bias)), rows
        assert torch.equal(fma(x, None), vdpbf16(x, None)), rows


@needs_native
@needs_amx
@pytest.mark.parametrize("shape", [(200, 96), (45, 64), (33, 1536)], ids=str)
def test_dense_bf16_amx_bias_strided_rows_and_two_threads(gen, shape):
    """AMX takes K in blocks of 32 columns and rows in even passes of up to 32, read in place but for a
    shorter last pass (a zero-padded copy): row counts around a pass, passes all whole (64), partial tiles of
    outputs, and rows of x further apart than K."""
    torch.set_num_threads(2)
    n, k = shape
    weight, bias = rand(gen, n, k), rand(gen, n)
    routine = cpu_linear._BF16Tiles(weight, amx_rows=1)
    wide = rand(gen, 70, k + 40)
    for rows in (1, 16, 17, 32, 33, 64, 70):
        x = wide[:rows, 7 : 7 + k]
        assert_matches(routine(x, bias), x, weight, bias)


@needs_native
@needs_amx
@pytest.mark.parametrize("shape, most", [((200, 576), 601), ((70, 1536), 301)], ids=str)
def test_dense_bf16_amx_passes_in_groups_give_a_row_the_bits_of_one_pass(gen, shape, most):
    """A step of many rows runs its passes in groups that share L2 (two groups here, with a short last pass
    in the larger row count); each sum still adds the same products in the same order, so a row gets the
    bits a single pass of 25 rows gives it."""
    torch.set_num_threads(2)
    n, k = shape
    weight, bias = rand(gen, n, k), rand(gen, n)
    routine = cpu_linear._BF16Tiles(weight, amx_rows=1)
    x = spread(gen, most, k)
    one_pass = torch.cat([routine(x[r : r + 25], bias) for r in range(0, most, 25)])
    for rows in (most - 1, most):
        assert torch.equal(routine(x[:rows], bias), one_pass[:rows]), rows
    assert_matches(one_pass, x, weight, bias)


@needs_native
@needs_bf16
def test_dense_bf16_rows_get_their_own_bits_in_steps_of_up_to_20(gen):
    """With the routines the kernel picks by row count on this CPU (vdpbf16ps, FMAs, AMX), a row's output
    does not depend on how many rows share its step, up to a speculative verification step of 4 sequences
    with 4 proposals each."""
    weight, bias = rand(gen, 576, 1536), rand(gen, 576)
    routine = cpu_linear._BF16Tiles(weight)
    most = cpu_linear.SAME_BITS_ROWS
    x = spread(gen, most, 1536)
    alone = torch.cat([routine(x[r : r + 1], bias) for r in range(most)])
    for rows in (2, 5, 13, most):
        assert torch.equal(routine(x[:rows], bias), alone[:rows]), rows


@pytest.fixture
def fresh_amx_rows(monkeypatch):
    """`_amx_rows` as timed without batch invariance, worked out again in the test and forgotten after it (the
    process keeps its answer)."""
    monkeypatch.setenv("LLMSERVE_BATCH_INVARIANT", "0")
    linear_pack._timed_amx_rows.cache_clear()
    yield cpu_linear._amx_rows
    linear_pack._timed_amx_rows.cache_clear()


@needs_native
@needs_amx
def test_amx_takes_every_step_with_batch_invariance(monkeypatch):
    monkeypatch.setattr(linear_pack, "remembered", lambda key, time_it: plan_cache.Plan(20, True))
    assert cpu_linear._amx_rows() == 1


@needs_native
@needs_bf16
@needs_vnni
@pytest.mark.parametrize("shape", [*MODEL_SHAPES, LM_HEAD], ids=str)
def test_with_batch_invariance_the_native_kernels_serve_every_row_count(gen, shape, monkeypatch):
    """Whatever oneDNN or a dequantized copy would time at: their sums round otherwise."""
    monkeypatch.setenv("LLMSERVE_BATCH_INVARIANT", "1")  # the default only where the CPU has AMX
    for weight in (rand(gen, *shape), int4_weight(*shape, 32, gen)):
        packed = cpu_linear.pack(weight, BF16)
        assert packed.small_rows == linear_tuning.ALL and packed.small is packed.large


@needs_native
@needs_amx
@pytest.mark.parametrize(("vector_rows", "amx_rows"), [(0, 1), (cpu_linear.SAME_BITS_ROWS, 21)])
def test_amx_takes_every_step_or_none_of_up_to_20_rows(monkeypatch, fresh_amx_rows, vector_rows, amx_rows):
    """The timed choice maps to AMX from the first row or from the 21st, never in between, where a row's bits
    would change with the rows sharing its step."""
    monkeypatch.setattr(linear_pack, "remembered", lambda key, time_it: plan_cache.Plan(vector_rows, True))
    assert fresh_amx_rows() == amx_rows


@needs_native
@pytest.mark.parametrize(
    ("times", "amx_rows"),
    [
        ((600, 720, 660, 570), 1),  # a tenth slower at one row, far faster at four: every step
        ((600, 720, 590, 730), 1),  # a tie: every step
        ((600, 720, 800, 600), 21),  # much slower at one row, not repaid at four: prompts only
    ],
)
def test_amx_takes_every_step_where_one_and_four_rows_cost_it_no_more(
    monkeypatch, fresh_amx_rows, times, amx_rows
):
    """The choice weighs a step of one row and one of four together (vdpbf16ps' times, then AMX's)."""
    monkeypatch.setattr(linear_pack, "native_amx", lambda: True)
    monkeypatch.setattr(linear_pack, "remembered", lambda key, time_it: time_it())
    monkeypatch.setattr(linear_pack, "interleaved_best", lambda fns: list(times))
    assert fresh_amx_rows() == amx_rows


@needs_native
@needs_bf16
@needs_vnni
@pytest.mark.parametrize("shape", [*MODEL_SHAPES, LM_HEAD], ids=str)
def test_the_native_kernels_serve_steps_of_up_to_20_rows(gen, shape):
    """Even where oneDNN or a dequantize-then-matmul measures faster: their sums round otherwise."""
    for weight in (rand(gen, *shape), int4_weight(*shape, 32, gen)):
        assert cpu_linear.pack(weight, BF16).small_rows >= cpu_linear.SAME_BITS_ROWS


@needs_native
@needs_bf16
def test_dense_weights_serve_every_step_the_native_decoder_takes(monkeypatch, gen):
    """Steps of up to `FORCED_DENSE_ROWS` rows, even where oneDNN times faster right above the rows the kernel
    serves whatever the timing (batch invariance off): a layer that left such a step to oneDNN would send it
    through the layer-by-layer path instead of the native decoder."""
    monkeypatch.setenv("LLMSERVE_BATCH_INVARIANT", "0")

    def onednn_faster_above_floor(*args, floor: int = 0, **kwargs) -> plan_cache.Plan:
        return plan_cache.Plan(floor, keep_other=True)

    monkeypatch.setattr(cpu_linear, "remembered", lambda key, time_it: time_it())
    monkeypatch.setattr(cpu_linear, "timed_plan", onednn_faster_above_floor)
    cpu_linear._dense_plan_on.cache_clear()
    try:
        packed = cpu_linear.pack(rand(gen, 576, 1536), BF16)
    finally:
        cpu_linear._dense_plan_on.cache_clear()
    assert packed.small_rows >= cpu_linear.FORCED_DENSE_ROWS


@needs_native
@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("amx_rows", [0, 1], ids=["vector", "amx"])
def test_dense_bf16_lm_head(gen, rows, amx_rows):
    if amx_rows and not cpu_linear.native_amx():
        pytest.skip("this CPU has no AMX")
    weight = rand(gen, *LM_HEAD)
    x = rand(gen, rows, LM_HEAD[1])
    assert_matches(cpu_linear._BF16Tiles(weight, amx_rows=amx_rows)(x, None), x, weight)


def test_pack_and_linear_give_the_matmul_for_every_row_count(gen):
    """Through the public interface, whichever routines `pack` chose; leading dims are kept."""
    weight, bias = rand(gen, 96, 64), rand(gen, 96)
    packed = cpu_linear.pack(weight, BF16)
    for rows in ROWS:
        x = rand(gen, rows, 64)
        assert_matches(cpu_linear.linear(x, packed, bias), x, weight, bias)
    x = rand(gen, 2, 3, 64)
    out = cpu_linear.linear(x, packed)
    assert out.shape == (2, 3, 96)
    assert_matches(out.flatten(0, 1), x.flatten(0, 1), weight)


@needs_native
def test_no_rows_give_no_rows(gen):
    for weight in (rand(gen, 40, 64), int4_weight(40, 64, 32, gen), int8_weight(40, 64, 16, gen)):
        packed = cpu_linear.pack(weight, BF16)
        assert cpu_linear.linear(rand(gen, 0, 64), packed).shape == (0, 40)


def test_fp32_weights_run_as_plain_matmul(gen):
    weight = rand(gen, 48, 40, dtype=FP32)
    packed = cpu_linear.pack(weight, FP32)
    x = rand(gen, 5, 40, dtype=FP32)
    assert torch.equal(cpu_linear.linear(x, packed), torch.nn.functional.linear(x, weight))


@needs_native
def test_dense_bf16_declines_other_inputs(gen):
    routine = cpu_linear._BF16Tiles(rand(gen, 64, 32))
    with pytest.raises(ValueError, match="bf16"):
        routine(rand(gen, 3, 32, dtype=FP32), None)
    with pytest.raises(ValueError, match="bf16"):
        routine(rand(gen, 3, 31), None)


# ----------------------------------------------------------------------------------------------- quantized

# name -> (weight maker, shapes it is tested on)
QUANT_FORMATS = {
    "q4_1-g32": (lambda n, k, g: int4_weight(n, k, 32, g), [*MODEL_SHAPES, (45, 96)]),
    "q4_0-g32": (lambda n, k, g: int4_weight(n, k, 32, g, symmetric=True), [*MODEL_SHAPES, (45, 96)]),
    "awq-g128": (
        lambda n, k, g: int4_weight(n, k, 128, g, fp16=False),
        [(3072, 1536), (576, 1536), (45, 256)],
    ),
    "gptq-g128-act-order": (
        lambda n, k, g: int4_weight(n, k, 128, g, act_order=True),
        [(576, 1536), (45, 256)],
    ),
    "gptq-sym-g128-act-order": (
        lambda n, k, g: int4_weight(n, k, 128, g, act_order=True, symmetric=True),
        [(3072, 1536), (45, 256)],
    ),
    "q8_0-g32": (lambda n, k, g: int8_weight(n, k, 32, g), [*MODEL_SHAPES, (45, 96)]),
    "q6_k-like-g16": (lambda n, k, g: int8_weight(n, k, 16, g), [(576, 576), (45, 48)]),
    "int8-per-channel": (lambda n, k, g: int8_weight(n, k, k, g), [(576, 1536), (77, 100), (3, 7)]),
}
QUANT_CASES = [(name, shape) for name, (_, shapes) in QUANT_FORMATS.items() for shape in shapes]


@needs_native
@needs_vnni
@pytest.mark.parametrize(("fmt", "shape"), QUANT_CASES, ids=[f"{n}-{s}" for n, s in QUANT_CASES])
@pytest.mark.parametrize("rows", ROWS)
def test_quantized_native_matches_the_dequantized_matmul(gen, fmt, shape, rows):
    weight = QUANT_FORMATS[fmt][0](*shape, gen)
    routine = cpu_linear._QuantTiles(weight)
    dense = weight.dequantize()
    x = rand(gen, rows, shape[1])
    assert_matches(routine(x, None), x, dense)
    if rows in (1, 5, 33):
        x = rand(gen, rows, shape[1], dtype=FP32)
        assert_matches(routine(x, None), x, dense)


@needs_native
@needs_vnni
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_quantized_rows_get_their_own_bits_at_every_row_count(gen, fmt, dtype):
    """Batch invariance: a row's output is the one it gets alone, in steps below and above the row count
    from which AMX-INT8 tiles take them (16 rows at a time, the last 16 partly padding), with a bias and
    two threads."""
    torch.set_num_threads(2)
    make, shapes = QUANT_FORMATS[fmt]
    n, k = shapes[-1]
    weight, bias = make(n, k, gen), rand(gen, n, dtype=dtype)
    routine = cpu_linear._QuantTiles(weight)
    x = spread(gen, 70, k).to(dtype)
    alone = torch.cat([routine(x[r : r + 1], bias) for r in range(len(x))])
    for rows in (5, 15, 16, 17, 40, 70):
        assert torch.equal(routine(x[:rows], bias), alone[:rows]), rows
    assert_matches(alone, x, weight.dequantize(), bias)


@needs_native
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 9, 33])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_quantized_portable_matches_the_dequantized_matmul(gen, fmt, rows, dtype):
    make, shapes = QUANT_FORMATS[fmt]
    weight = make(*shapes[-1], gen)
    x = rand(gen, rows, shapes[-1][1], dtype=dtype)
    assert_matches(cpu_linear._QuantTiles(weight, portable=True)(x, None), x, weight.dequantize())


@needs_native
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_quantized_bias_strided_rows_and_two_threads(gen, portable):
    if not portable and not cpu_linear.native_quant():
        pytest.skip("this CPU has no AVX512-VNNI")
    torch.set_num_threads(2)
    weight, bias = int4_weight(200, 128, 32, gen), rand(gen, 200)
    x = rand(gen, 7, 150)[:, 10:138]
    assert_matches(cpu_linear._QuantTiles(weight, portable=portable)(x, bias), x, weight.dequantize(), bias)


@needs_native
@needs_vnni
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_quantized_lm_head(gen, rows):
    """The bundled model's embedding is Q8_0 and tied to the LM head."""
    weight = int8_weight(*LM_HEAD, 32, gen)
    x = rand(gen, rows, LM_HEAD[1])
    assert_matches(cpu_linear._QuantTiles(weight)(x, None), x, weight.dequantize())


@pytest.fixture
def prefetch_distance():
    """The quantized kernel's prefetch distance (a process-wide setting), restored after the test."""
    get = function("linear_quant_prefetch", i32)
    set_distance = function("linear_quant_set_prefetch", None, i32)
    before = get()
    yield get, set_distance
    set_distance(before)


@needs_native
@needs_vnni
@pytest.mark.parametrize("fmt", ["q4_1-g32", "q8_0-g32", "gptq-g128-act-order"])
def test_the_prefetch_distance_changes_no_bits(gen, fmt, prefetch_distance):
    _, set_distance = prefetch_distance
    make, shapes = QUANT_FORMATS[fmt]
    routine = cpu_linear._QuantTiles(make(*shapes[0], gen))
    for rows in (1, 5, 33):
        x = rand(gen, rows, shapes[0][1])
        outputs = []
        for distance in (0, *cpu_linear.QUANT_PREFETCH_BYTES, 1 << 16):
            set_distance(distance)
            outputs.append(routine(x, None))
        assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


class _Paced(cpu_linear._QuantTiles):
    """A quantized weight whose calls take longer the farther the distance is from `fastest`."""

    fastest = 0

    def __call__(self, x, bias):
        time.sleep(abs(function("linear_quant_prefetch", i32)() - self.fastest) / 1e6)
        return super().__call__(x, bias)


@needs_native
@pytest.mark.parametrize("fastest", [1024, 2048, 4096])
def test_the_fastest_prefetch_distance_is_set(gen, fastest, prefetch_distance, monkeypatch):
    get, set_distance = prefetch_distance
    monkeypatch.setattr(_Paced, "fastest", fastest)
    paced = _Paced(int4_weight(64, 64, 32, gen))
    quantized = cpu_linear.PackedLinear(64, 64, paced, paced, linear_tuning.ALL, None, ())
    set_distance(7)
    timings = cpu_linear.time_quant_prefetch([cpu_linear.pack(rand(gen, 64, 64), BF16), quantized], rounds=2)
    assert list(timings) == list(cpu_linear.QUANT_PREFETCH_BYTES)
    assert get() == fastest == min(timings, key=timings.__getitem__)


@needs_native
def test_without_quantized_weights_the_prefetch_distance_is_left_alone(gen, prefetch_distance):
    get, set_distance = prefetch_distance
    set_distance(7)
    assert cpu_linear.time_quant_prefetch([cpu_linear.pack(rand(gen, 64, 64), BF16)]) == {}
    assert get() == 7


@needs_native
@pytest.mark.parametrize("rows", [1, 33, 300, 800, 2100])
def test_dequantized_matmul_routine(gen, rows):
    """What `pack` runs instead of the native kernel for many rows where that measures faster: tile by tile,
    or (with AMX, beyond `_AMX_TILE_ROWS` rows) the weight dequantized whole."""
    weight = int4_weight(100, 256, 128, gen, act_order=True)
    routine = cpu_linear._DequantizedMatmul(cpu_linear._QuantTiles(weight))
    x, bias = rand(gen, rows, 256), rand(gen, 100)
    assert_matches(routine(x, None), x, weight.dequantize())
    assert_matches(routine(x, bias), x, weight.dequantize(), bias)


@needs_native
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("rows", [1, 33, 300])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_quantized_tiles_dequantized_to_bf16_give_the_bf16_kernels_bits(gen, fmt, rows, portable):
    """Many rows run as a bf16 copy of the weight would, tile by tile: the same bits as the bf16 kernel on
    the weight dequantized to bf16, where the columns are in the checkpoint's order (act-order sums them in
    the stored order instead)."""
    if not portable and not cpu_linear.native_bf16():
        pytest.skip("the bf16 kernel has no vector code for this CPU")
    torch.set_num_threads(2)
    make, shapes = QUANT_FORMATS[fmt]
    (n, k) = shapes[-1]
    weight = make(n, k, gen)
    routine = cpu_linear._DequantizedMatmul(cpu_linear._QuantTiles(weight, portable=portable))
    x, bias = rand(gen, rows, k + 20)[:, 5 : k + 5], rand(gen, n)
    out = routine._tiles_in_bf16(x, bias)
    dense = weight.dequantize().to(BF16)
    if weight.perm is None:
        assert torch.equal(out, cpu_linear._BF16Tiles(dense, portable=portable)(x, bias))
    assert_matches(out, x, dense, bias)


@needs_native
@needs_amx
def test_quantized_tiles_kept_across_groups_of_passes_give_the_bf16_kernels_bits(gen):
    """A step of many rows runs its passes in groups; each thread dequantizes its tiles in the first group and
    keeps them for the others (301 rows at K = 1536 are two groups): the bits of the bf16 kernel on the
    weight dequantized to bf16."""
    torch.set_num_threads(2)
    weight = int4_weight(70, 1536, 32, gen)
    routine = cpu_linear._DequantizedMatmul(cpu_linear._QuantTiles(weight))
    x, bias = spread(gen, 301, 1536), rand(gen, 70)
    dense = weight.dequantize().to(BF16)
    out = routine._tiles_in_bf16(x, bias)
    assert torch.equal(out, cpu_linear._BF16Tiles(dense, amx_rows=1)(x, bias))
    assert_matches(out, x, dense, bias)


@pytest.mark.parametrize(
    "weight",
    [
        lambda g: int4_weight(32, 96, 48, g),  # groups of 48 do not fill 32-column blocks
        lambda g: int8_weight(32, 64, 8, g),
    ],
    ids=["int4-g48", "int8-g8"],
)
def test_groups_the_native_layout_cannot_hold_fall_back_to_dequantizing(gen, weight):
    weight = weight(gen)
    with pytest.raises(ValueError, match="not a layout"):
        cpu_linear._QuantTiles(weight)
    packed = cpu_linear.pack(weight, BF16, keep_rows=True)
    assert isinstance(packed.small, cpu_linear._Dequantize)
    x = rand(gen, 3, weight.shape[1])
    assert_matches(cpu_linear.linear(x, packed), x, weight.dequantize())
    ids = torch.tensor([0, 31])
    assert torch.equal(cpu_linear.embedding(ids, packed, BF16), weight.dequantize()[ids].to(BF16))


def test_pack_and_linear_quantized_with_bias(gen):
    weight, bias = int4_weight(96, 128, 32, gen, act_order=True), rand(gen, 96)
    packed = cpu_linear.pack(weight, BF16)
    for rows in ROWS:
        x = rand(gen, rows, 128)
        assert_matches(cpu_linear.linear(x, packed, bias), x, weight.dequantize(), bias)


@needs_native
def test_quantized_declines_other_inputs(gen):
    routine = cpu_linear._QuantTiles(int8_weight(32, 64, 32, gen))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        routine(rand(gen, 2, 64, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        routine(rand(gen, 2, 63), None)


# ------------------------------------------------------------------------------------- rows and memory


@pytest.mark.parametrize(
    "make",
    [
        lambda g: rand(g, 1000, 64),
        lambda g: rand(g, 77, 33),
        lambda g: int8_weight(1000, 64, 32, g),
        lambda g: int4_weight(77, 96, 32, g),
        lambda g: int4_weight(77, 96, 32, g, symmetric=True),
        lambda g: int8_weight(50, 100, 100, g),
    ],
    ids=["bf16", "bf16-odd", "q8_0", "q4_1-odd-rows", "q4_0-odd-rows", "int8-per-channel-odd"],
)
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_embedding_rows_are_exact(gen, make, dtype):
    weight = make(gen)
    packed = cpu_linear.pack(weight, BF16, keep_rows=True)
    dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
    n = dense.shape[0]
    ids = torch.tensor([[0, n - 1, 17 % n], [n // 2, 1 % n, 0]])
    assert torch.equal(cpu_linear.embedding(ids, packed, dtype), dense[ids].to(dtype))
    with pytest.raises(IndexError):
        cpu_linear.embedding(torch.tensor([n]), packed, dtype)
    with pytest.raises(IndexError):
        cpu_linear.embedding(torch.tensor([-1]), packed, dtype)


@needs_native
@needs_bf16
def test_bf16_rows_come_from_the_packed_tiles_alone(gen):
    weight = rand(gen, 1000, 64)
    packed = cpu_linear.pack(weight, BF16, keep_rows=True)
    if packed.small_rows != linear_tuning.ALL:
        pytest.skip("oneDNN runs many rows on this CPU, so pack keeps its copy too")
    assert packed.resident == (packed.small.tiles,)
    assert packed.nbytes == 1024 * 64 * 2  # 1000 rows padded to whole tiles of 32


def _storage_bytes(packed: cpu_linear.PackedLinear) -> int:
    """Bytes of memory the packed weight keeps: each tensor's storage, except that a tensor placed on huge
    pages shares its mapping (a chunk, or one of its own size, each 2 MiB over for alignment) with others."""
    total = 0
    for t in packed.resident:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage().nbytes()
        if storage - huge_pages._PAGE in (huge_pages._CHUNK, t.nbytes):
            storage = t.nbytes
        total += storage
    return total


@needs_native
@pytest.mark.parametrize(
    ("make", "bits_per_weight"),
    [
        (lambda g: int4_weight(3072, 576, 32, g), 4 + 2 * 16 / 32),  # Q4_1: fp16 scale and offset per 32
        (lambda g: int4_weight(3072, 576, 32, g, symmetric=True), 4 + 16 / 32),  # Q4_0: fp16 scale per 32
        (lambda g: int4_weight(576, 1536, 128, g, fp16=False), 4 + 2 * 32 / 128),  # fp32 when not exact
        (lambda g: int8_weight(49152, 576, 32, g), 8 + 16 / 32),  # Q8_0
        (lambda g: int8_weight(576, 576, 16, g), 8 + 16 / 16),
        (lambda g: int8_weight(576, 1536, 1536, g), 8 + 16 / 1536),
    ],
    ids=["q4_1", "q4_0", "awq-fp32", "q8_0", "int8-g16", "int8-per-channel"],
)
def test_quantized_nbytes_is_the_formats_own_size_and_really_resident(gen, make, bits_per_weight):
    weight = make(gen)
    n, k = weight.shape
    packed = cpu_linear.pack(weight, BF16, keep_rows=True)
    assert packed.nbytes == pytest.approx(n * k * bits_per_weight / 8, abs=0.5)
    assert packed.nbytes == _storage_bytes(packed)


def test_act_order_nbytes_counts_the_permutation(gen):
    weight = int4_weight(64, 256, 128, gen, act_order=True)
    packed = cpu_linear.pack(weight, BF16)
    assert packed.nbytes == _storage_bytes(packed)
    assert packed.nbytes >= 64 * 256 / 2 + 256 * 4


@needs_native
def test_the_routine_is_chosen_when_packing_not_per_call(gen, monkeypatch):
    weight = rand(gen, 64, 64)
    packed = cpu_linear.pack(weight, BF16)
    quantized = cpu_linear.pack(int8_weight(64, 64, 32, gen), BF16)

    def no_timing(*args, **kwargs):
        raise AssertionError("linear() timed a routine")

    monkeypatch.setattr(linear_pack, "best_time", no_timing)
    for rows in ROWS:
        cpu_linear.linear(rand(gen, rows, 64), packed)
        cpu_linear.linear(rand(gen, rows, 64), quantized)


FALLBACK_SCRIPT = """
import torch
from llmserve_kernels.cpu import linear as L
from llmserve_kernels.quantized import Int4Weight, Int8Weight
gen = torch.Generator().manual_seed(0)
w = torch.randn(96, 64, generator=gen).bfloat16()
p = L.pack(w, torch.bfloat16, keep_rows=True)
q4 = Int4Weight(torch.randint(0, 16, (40, 64), generator=gen, dtype=torch.uint8),
                torch.rand(40, 2, generator=gen) / 8, torch.rand(40, 2, generator=gen) - 1, 32)
q8 = Int8Weight(torch.randint(-128, 128, (40, 64), generator=gen, dtype=torch.int8),
                torch.rand(40, 2, generator=gen) / 64, 32)
for rows in (1, 5, 33):
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    assert torch.equal(L.linear(x, p), torch.nn.functional.linear(x, w)), "dense"
    for q in (q4, q8):
        packed = L.pack(q, torch.bfloat16, keep_rows=True)
        assert type(packed.small).__name__ == "_Dequantize"
        expected = torch.nn.functional.linear(x, q.dequantize().bfloat16())
        assert torch.equal(L.linear(x, packed), expected), "quantized"
        row = L.embedding(torch.tensor([3]), packed, torch.bfloat16)
        assert torch.equal(row, q.dequantize()[3:4].bfloat16())
assert torch.equal(L.embedding(torch.tensor([5, 0]), p, torch.bfloat16), w[[5, 0]])
print(type(p.small).__name__)
"""


def test_without_native_kernels_everything_runs_in_pytorch():
    """LLMSERVE_CPU_KERNELS=0: oneDNN (or F.linear) for dense weights, dequantize-then-matmul for
    quantized ones (a fresh process: the library's availability is decided once per process)."""
    env = {**os.environ, "LLMSERVE_CPU_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FALLBACK_SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    expected = "_OneDNN" if cpu_linear.prepacking_works(BF16) else "_Plain"
    assert result.stdout.strip() == expected


def test_plans_are_timed_once_per_machine(tmp_path, monkeypatch):
    """A plan is kept beside the built kernels, so a later engine start reads it instead of timing."""
    monkeypatch.setattr(plan_cache, "library_path", lambda: tmp_path / "llmserve-cpu-key.so")
    timings = []

    def time_it():
        timings.append(1)
        return plan_cache.Plan(linear_tuning.ALL if len(timings) == 1 else 3, keep_other=False)

    first = plan_cache.remembered("bf16 [8, 8]", time_it)
    assert plan_cache.remembered("bf16 [8, 8]", time_it) == first and len(timings) == 1
    assert first.native_rows == linear_tuning.ALL  # infinity survives the file
    assert plan_cache.remembered("bf16 [8, 16]", time_it).native_rows == 3 and len(timings) == 2
    (tmp_path / "llmserve-cpu-key.plans.json").write_text("{not json")  # a damaged file is timed again
    assert plan_cache.remembered("bf16 [8, 8]", time_it).native_rows == 3 and len(timings) == 3


@pytest.mark.parametrize(
    ("wins", "floor", "expected"),
    [
        # AMX's shape: vdpbf16ps loses to oneDNN from 8 rows, the AMX routine wins again from 21 to 32
        (lambda rows: rows < 8 or 21 <= rows <= 32, 20, 32),
        (lambda rows: rows < 8 or 21 <= rows <= 32, 0, 6),  # without a floor the halving never sees 21-32
        (lambda rows: rows <= 12, 20, 20),  # loses at every row count above the floor
        (lambda rows: rows <= 100, 0, 64),
        (lambda rows: True, 20, linear_tuning.ALL),
        (lambda rows: rows <= 300, 256, 256),  # a floor at the largest candidate: oneDNN above it
        (lambda rows: True, 256, linear_tuning.ALL),
    ],
)
def test_the_plan_looks_for_the_crossover_above_the_rows_the_kernel_serves_anyway(wins, floor, expected):
    asked = []

    def native_faster(rows: int, margin: float = 1.0) -> bool:
        asked.append(rows)
        return wins(rows)

    plan = linear_tuning.search(native_faster, other_costs_memory=True, floor=floor)
    assert plan.native_rows == expected
    assert plan.keep_other == (expected != linear_tuning.ALL)
    assert all(rows > floor for rows in asked)
