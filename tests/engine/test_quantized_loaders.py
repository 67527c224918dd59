"""Quantized checkpoints load into the engine's formats with exactly the values the formats' own tools give.

References: `gguf.dequantize` for GGUF blocks, AutoAWQ's `dequantize_gemm` for AWQ, Intel Neural
Compressor's `recover` for GPTQ (see quant_checkpoints.py for how each checkpoint is made).
"""

from __future__ import annotations

import json
import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from inference_engine import LLM
from inference_engine.errors import InvalidRequestError
from inference_engine.model_loader import gguf_quant, hf_quant, load_model
from llmserve_kernels.cpu._build import available, function, i32
from llmserve_kernels.cpu.linear import QUANT_PREFETCH_BYTES
from llmserve_kernels.quantized import Int4Weight, Int8Weight

from . import quant_checkpoints as qc
from .conftest import greedy

Q = gguf.GGMLQuantizationType


def _weights(model, quantization=None) -> dict:
    return dict(load_model(model, quantization).weights)


def _assert_same_values(quantized: dict, dense: dict) -> None:
    """Every tensor equal: quantized ones dequantized, bit for bit, against the dense load."""
    assert quantized.keys() == dense.keys()
    for name, weight in quantized.items():
        values = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        assert torch.equal(values.float(), dense[name].float()), name


# --- GGUF -------------------------------------------------------------------------------------------


def test_gguf_blocks_convert_to_exactly_what_gguf_dequantizes():
    rng = np.random.default_rng(1)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        for rows, cols in ((8, 32), (48, 576), (64, 1536)):
            data = gguf.quantize(rng.normal(0, 0.1, (rows, cols)).astype(np.float32), qtype)
            weight = gguf_quant.convert(data, qtype)
            assert weight.shape == (rows, cols) and weight.group_size == 32
            reference = gguf.dequantize(data, qtype).reshape(rows, cols)
            assert np.array_equal(weight.dequantize().numpy(), reference), (qtype.name, rows, cols)
    # gguf has no K-quant quantizer: random blocks with sane fp16 scales are valid ones.
    for qtype, group, scale_bytes in ((Q.Q4_K, 32, slice(0, 4)), (Q.Q6_K, 16, slice(208, 210))):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (24, 3, size), dtype=np.uint8)
        width = scale_bytes.stop - scale_bytes.start
        data[..., scale_bytes] = (
            rng.uniform(1e-3, 1e-1, (24, 3, width // 2)).astype(np.float16).view(np.uint8)
        )
        data = data.reshape(24, -1)
        weight = gguf_quant.convert(data, qtype)
        assert weight.shape == (24, 3 * block) and weight.group_size == group
        reference = gguf.dequantize(data, qtype).reshape(24, 3 * block)
        assert np.array_equal(weight.dequantize().numpy(), reference), qtype.name


def test_bundled_q4_1_file_stays_quantized_and_equals_the_dense_load():
    quantized, dense = _weights(None), _weights(None, "none")
    _assert_same_values(quantized, dense)
    q_proj = quantized["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q_proj, Int4Weight) and q_proj.group_size == 32 and q_proj.shape == (576, 576)
    embedding = quantized["model.embed_tokens.weight"]
    assert isinstance(embedding, Int8Weight) and embedding.shape == (49152, 576)
    assert isinstance(quantized["model.norm.weight"], torch.Tensor)


@pytest.mark.skipif(not available(), reason="no C compiler: the native kernels cannot build")
def test_a_quantized_model_sets_its_kernels_prefetch_distance_when_it_loads(caplog):
    get = function("linear_quant_prefetch", i32)
    set_distance = function("linear_quant_set_prefetch", None, i32)
    before = get()
    try:
        set_distance(7)
        with caplog.at_level(logging.INFO, logger="inference_engine.cpu_runner"):
            LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 26)
        assert get() in QUANT_PREFETCH_BYTES
        assert f"quantized kernel prefetches {get()} bytes ahead" in caplog.text
    finally:
        set_distance(before)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_files_quantized_by_gguf_load_as_gguf_dequantizes_them(qtype):
    path = qc.gguf_file(qtype)
    quantized = _weights(str(path))
    _assert_same_values(quantized, _weights(str(path), "none"))
    expected = Int4Weight if qtype == "Q4_0" else Int8Weight
    assert isinstance(quantized["model.layers.3.mlp.down_proj.weight"], expected)
    reader = gguf.GGUFReader(str(path))
    down = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    reference = gguf.dequantize(down.data, down.tensor_type).reshape(576, 1536)
    assert np.array_equal(quantized["model.layers.3.mlp.down_proj.weight"].dequantize().numpy(), reference)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    return qc.kquant_file(tmp_path_factory.mktemp("kquant") / "random-kquant.gguf")


def test_k_quants_and_unsupported_types_load_with_every_value_right(kquant_file, caplog):
    with caplog.at_level(logging.INFO, logger="inference_engine.model_loader.gguf_loader"):
        quantized = _weights(str(kquant_file))
    dense = _weights(str(kquant_file), "none")
    _assert_same_values(quantized, dense)  # includes the Q/K row permutation of quantized rows
    kinds = {name.split(".")[-2]: type(w) for name, w in quantized.items() if ".layers.0." in name}
    assert kinds["q_proj"] is Int4Weight and kinds["k_proj"] is Int4Weight  # Q4_K
    assert kinds["v_proj"] is Int8Weight and kinds["down_proj"] is Int8Weight  # Q6_K
    assert kinds["gate_proj"] is Int4Weight and kinds["up_proj"] is Int4Weight  # Q4_0, Q4_1
    assert kinds["o_proj"] is torch.Tensor  # Q5_0: dequantized, with a note
    assert "blk.0.attn_output.weight is Q5_0" in caplog.text
    assert quantized["model.layers.0.mlp.down_proj.weight"].group_size == 16
    assert isinstance(quantized["model.layers.1.self_attn.o_proj.weight"], torch.Tensor)  # F16


def test_k_quant_model_generates_what_its_dequantized_copy_generates(kquant_file):
    """End to end through fused QKV / gate-up layers of mixed formats: the quantized model in fp32
    computes what the dense one does (same values), so greedy tokens agree."""
    prompts = ["The capital of France is", "def quicksort(arr):"]
    runs = []
    for quantization in (None, "none"):
        llm = LLM(model=str(kquant_file), dtype="float32", quantization=quantization)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)])
    assert runs[0] == runs[1]


# --- AWQ and GPTQ -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 512), (576, 1536), (192, 384)])
def test_awq_layers_equal_autoawq_dequantization(shape):
    torch.manual_seed(sum(shape))
    packed = qc.awq_pack(torch.randn(shape) * 0.05, group_size=128)
    weight = hf_quant.awq_weight(packed["qweight"], packed["qzeros"], packed["scales"], 128)
    assert weight.shape == shape and weight.group_size == 128 and weight.perm is None
    reference = qc.awq_dequantize(packed["qweight"], packed["qzeros"], packed["scales"], 128)
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize(
    "shape, act_order, sym",
    [
        ((256, 512), False, False),
        ((576, 576), True, False),
        ((192, 576), False, True),
        ((128, 1536), True, True),
    ],
)
def test_gptq_layers_equal_neural_compressor_dequantization(shape, act_order, sym):
    """576 inputs end in a partial group of 64; act-order gives a g_idx that is a random permutation."""
    out_features, in_features = shape
    torch.manual_seed(in_features + act_order)
    g_idx = None
    if act_order:
        g_idx = torch.empty(in_features, dtype=torch.int64)
        g_idx[torch.randperm(in_features)] = torch.arange(in_features) // 128
    packed = qc.inc_pack(torch.randn(shape) * 0.05, 128, g_idx, sym)
    weight = hf_quant.gptq_weight(
        packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"), 128, zero_offset=1
    )
    assert weight.shape == shape and (weight.perm is not None) == act_order
    assert torch.equal(weight.dequantize(), qc.inc_dequantize(packed, out_features, in_features, 128))


def test_gptq_v2_checkpoints_store_zero_points_without_the_minus_one():
    torch.manual_seed(3)
    packed = qc.inc_pack(torch.randn(64, 256) * 0.05, 128, sym=True)  # every zero point 8, stored as 7
    v1 = hf_quant.QuantConfig("gptq", {"bits": 4, "group_size": 128})
    v2 = hf_quant.QuantConfig("gptq", {"bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"})
    assert (v1.zero_offset, v2.zero_offset) == (1, 0)
    # GPTQModel's v1 -> v2 conversion adds one to every stored nibble; no nibble here is 15, so no carry.
    packed_v2 = dict(packed, qzeros=packed["qzeros"] + 0x11111111)
    weight = hf_quant.convert_layer(packed_v2, v2).dequantize()
    assert torch.equal(weight, hf_quant.convert_layer(packed, v1).dequantize())
    assert torch.equal(weight, qc.inc_dequantize(packed, 64, 256, 128))


def _packed_layers(folder) -> dict[str, dict[str, torch.Tensor]]:
    layers: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - not a dict
            prefix, _, part = name.rpartition(".")
            if part in ("qweight", "qzeros", "scales", "g_idx"):
                layers.setdefault(prefix, {})[part] = f.get_tensor(name)
    return layers


def test_awq_checkpoint_loads_as_autoawq_dequantizes_it():
    folder = qc.awq_folder()
    weights = _weights(str(folder))
    layers = _packed_layers(folder)
    assert len(layers) == 30 * 7
    for prefix, parts in layers.items():
        weight = weights[f"{prefix}.weight"]
        assert isinstance(weight, Int4Weight) and weight.group_size == qc.AWQ_GROUP
        reference = qc.awq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], qc.AWQ_GROUP)
        assert torch.equal(weight.dequantize(), reference), prefix
    assert isinstance(weights["model.embed_tokens.weight"], torch.Tensor)


@pytest.mark.parametrize("desc_act", [False, True], ids=["rtn-sym", "gptq-act-order"])
def test_gptq_checkpoint_loads_as_neural_compressor_dequantizes_it(desc_act):
    folder = qc.gptq_folder(desc_act)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["desc_act"] == desc_act
    weights = _weights(str(folder))
    layers = _packed_layers(folder)
    assert len(layers) == 30 * 7
    for prefix, parts in list(layers.items())[:: 1 if desc_act else 5]:
        weight = weights[f"{prefix}.weight"]
        assert isinstance(weight, Int4Weight) and (weight.perm is not None) == desc_act
        in_features, out_features = parts["qweight"].shape[0] * 8, parts["scales"].shape[1]
        reference = qc.inc_dequantize(parts, out_features, in_features, qc.GPTQ_GROUP)
        assert torch.equal(weight.dequantize(), reference), prefix


# --- choosing the quantization ------------------------------------------------------------------------


def test_quantization_that_does_not_match_the_checkpoint_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match=r"'awq' does not match .* stored as 'gguf'"):
        load_model(None, "awq")
    with pytest.raises(InvalidRequestError, match=r"'gptq' does not match .* stored as 'awq'"):
        load_model(str(qc.awq_folder()), "gptq")
    with pytest.raises(InvalidRequestError, match=r"'int8' does not match .* stored as 'awq'"):
        load_model(str(qc.awq_folder()), "int8")
    with pytest.raises(InvalidRequestError, match=r"'awq' needs a checkpoint stored in that format"):
        load_model(str(qc.dense_folder()), "awq")
    assert load_model(str(qc.dense_folder())).quantization == "none"
    assert load_model(str(qc.dense_folder()), "int8").quantization == "int8"
    assert load_model(None).quantization == "gguf"
    assert load_model(None, "int8").quantization == "int8"
    assert load_model(str(qc.awq_folder()), "none").quantization == "none"


def test_awq_checkpoint_loads_dequantized_with_quantization_none():
    folder = qc.awq_folder()
    dense = _weights(str(folder), "none")
    layer = "model.layers.2.mlp.up_proj"
    assert isinstance(dense[f"{layer}.weight"], torch.Tensor)
    parts = _packed_layers(folder)[layer]
    reference = qc.awq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], qc.AWQ_GROUP)
    assert torch.equal(dense[f"{layer}.weight"], reference)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 8}, "AWQ checkpoints with 8 bits are not supported"),
        ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
        ({"zero_point": False}, "AWQ without zero points is not supported"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
        ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes', which this engine cannot load"),
    ],
)
def test_unsupported_checkpoint_quantizations_are_clear_errors(tmp_path, change, message):
    folder = qc.awq_folder()
    for name in ("config.json", *qc.TOKENIZER_FILES):
        shutil.copy(folder / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((ValueError, InvalidRequestError), match=message) as error:
        load_model(str(tmp_path))
    assert "supported" in str(error.value)
