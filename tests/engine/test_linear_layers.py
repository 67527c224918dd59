"""The engine's linear layers: parts loaded, fused and packed for the kernels give the plain matmul's
result, dense (oneDNN-prepacked bf16: within the last bit) and quantized, fused formats mixed included."""

import pytest
import torch
import torch.nn.functional as F

from inference_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from inference_engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmserve_kernels.cpu.linear import prepacking_works
from llmserve_kernels.quantized import Int4Weight, Int8Weight

BF16 = torch.bfloat16


def _build(make, dtype=BF16):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return make()
    finally:
        torch.set_default_dtype(default)


def _int4(rows: int, cols: int, gen: torch.Generator, group: int = 32) -> Int4Weight:
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(rows, cols // group, generator=gen) / 8
    offset = -8 * scale + torch.randn(rows, cols // group, generator=gen) / 100
    return Int4Weight(q, scale, offset, group)


def _int8(rows: int, cols: int, gen: torch.Generator, group: int = 32) -> Int8Weight:
    q = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return Int8Weight(q, torch.rand(rows, cols // group, generator=gen) / 64, group)


LAYERS = {
    "qkv-with-bias": (lambda: QKVParallelLinear(96, 16, 6, 2, bias=True), {"q": 96, "k": 32, "v": 32}, 96),
    "gate-up": (lambda: MergedColumnParallelLinear(96, [160, 160]), {0: 160, 1: 160}, 96),
    "row-with-bias": (lambda: RowParallelLinear(160, 96, bias=True), {None: 96}, 160),
    "row": (lambda: RowParallelLinear(96, 96), {None: 96}, 96),
}


@pytest.mark.skipif(not prepacking_works(BF16), reason="this PyTorch build has no oneDNN prepacked linear")
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_dense_layer_equals_plain_matmul(kind, rows):
    make, parts, cols = LAYERS[kind]
    gen = torch.Generator().manual_seed(rows)
    layer = _build(make)
    weights = {part: torch.randn(n, cols, generator=gen).to(BF16) for part, n in parts.items()}
    for part, w in weights.items():
        layer.load_weight(w, part)
    if layer.bias is not None:
        layer.bias.data = torch.randn(layer.bias.shape, generator=gen).to(BF16)
    layer.finalize()
    x = torch.randn(rows, cols, generator=gen).to(BF16)
    weight = torch.cat(list(weights.values()))
    if isinstance(layer, RowParallelLinear):  # the bias is added after the all-reduce
        expected = F.linear(x, weight) + (0 if layer.bias is None else layer.bias)
    else:
        expected = F.linear(x, weight, layer.bias)
    # Bit-identical where oneDNN's prepacked kernel and F.linear sum in the same order; on AMX CPUs their
    # prompt-sized calls block the inputs differently, and a sum can round to the neighbouring bf16 value.
    torch.testing.assert_close(layer(x).float(), expected.float(), rtol=2**-7, atol=1e-3)


def test_fused_parts_of_different_formats_stay_separate_matmuls():
    """A GGUF Q4_K_M file stores V in Q6_K beside Q and K in Q4_K: one layer, two packed matmuls."""
    gen = torch.Generator().manual_seed(0)
    layer = _build(lambda: QKVParallelLinear(128, 32, 4, 2, bias=False))
    parts = {"q": _int4(128, 128, gen), "k": _int4(64, 128, gen), "v": _int8(64, 128, gen, group=16)}
    for part, w in parts.items():
        layer.load_weight(w, part)
    layer.finalize()
    assert len(layer.packed) == 2
    x = torch.randn(5, 128, generator=gen).to(BF16)
    reference = F.linear(x.float(), torch.cat([w.dequantize() for w in parts.values()]))
    torch.testing.assert_close(layer(x).float(), reference, atol=0.05, rtol=0.02)


def test_int8_on_load_quantizes_dense_weights():
    gen = torch.Generator().manual_seed(1)
    layer = _build(lambda: RowParallelLinear(256, 64))
    weight = torch.randn(64, 256, generator=gen)
    layer.load_weight(weight.to(BF16))
    layer.finalize(quantize_int8=True)
    assert layer.weight_bytes < weight.numel() * 2 * 0.6
    x = torch.randn(3, 256, generator=gen).to(BF16)
    quantized = Int8Weight.quantize(weight.to(BF16)).dequantize()
    assert (quantized - weight).abs().max() <= weight.abs().amax(1, keepdim=True).max() / 254 + 0.01
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), quantized), atol=0.05, rtol=0.02)


def test_missing_part_is_reported():
    layer = _build(lambda: MergedColumnParallelLinear(32, [64, 64]))
    layer.load_weight(torch.randn(64, 32).to(BF16), 0)
    with pytest.raises(ValueError, match=r"missing weight parts \[1\]"):
        layer.finalize()


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "q8_0"])
@pytest.mark.parametrize("rows", [9, 26])
@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_equals_plain_and_a_tied_embedding_still_looks_up(tied, rows, quantized):
    gen = torch.Generator().manual_seed(int(tied))
    embed = _build(lambda: VocabParallelEmbedding(1000, 64))
    head = _build(lambda: ParallelLMHead(1000, 64))
    weights = [_int8(1000, 64, gen) if quantized else torch.randn(1000, 64, generator=gen).to(BF16)]
    embed.load_weight(weights[0])
    if tied:
        head.tie(embed)
    else:
        weights.append(torch.randn(1000, 64, generator=gen).to(BF16))
        head.load_weight(weights[1])
    embed.finalize()
    head.finalize()
    dense = [w.dequantize().to(BF16) if quantized and i == 0 else w for i, w in enumerate(weights)]
    hidden = torch.randn(rows, 64, generator=gen).to(BF16)
    ids = torch.tensor([0, 5, 999])
    torch.testing.assert_close(head(hidden), F.linear(hidden, dense[-1]), atol=0.05, rtol=0.02)
    assert torch.equal(embed(ids), dense[0][ids])


def test_runner_times_the_prompt_attention_path_at_start_up(monkeypatch):
    """Timed while the engine starts, with the model's head shapes, not in the first long prompt's step."""
    from inference_engine import LLM, cpu_runner

    calls = []
    monkeypatch.setattr(cpu_runner, "native_query_max", lambda *shape: calls.append(shape) or 32)
    LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 24)
    assert calls == [(9, 3, 64, torch.bfloat16, torch.get_num_threads())]
