"""Every mixture-of-experts family gives transformers' fp32 greedy tokens on tiny random checkpoints
(`moe_families.FAMILIES`) through the offline `LLM`, with its routed experts on the native CPU kernel.
Divergences where transformers' top-2 margin is below 1e-3 are ties, counted and reported, not failures."""

from __future__ import annotations

import json

import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.model_loader import load_model
from inference_engine.models.moe import FusedExperts
from llmserve_kernels.quantized import Int8Weight
from llmserve_kernels.reference import fused_moe_ref

from . import moe_families
from .conftest import assert_all_blocks_free
from .families import compare

MAX_TOKENS = 24
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived a",  # 15 tokens: past the window soon
    "def quicksort(arr):\n    ",
    "1, 1, 2, 3, 5, 8, 13,",
]


def _assert_greedy_tokens(llm: LLM, prompts: list[list[int]], references: list, label: str) -> None:
    """`llm`'s greedy tokens on `prompts` equal `references` (tokens and top-2 margins) but for ties, and no
    KV block is left held."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    mismatches, ties = compare([o.outputs[0].token_ids for o in outputs], references)
    print(f"{label}: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("family", sorted(moe_families.FAMILIES))
def test_moe_family_matches_transformers(family):
    llm = LLM(model=str(moe_families.folder(family)), dtype="float32", seed=0)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == (2 if family == "qwen2moe" else 3)  # Qwen2-MoE's middle layer is dense
    prompts = [llm.get_tokenizer().encode(text) for text in TEXTS]
    _assert_greedy_tokens(llm, prompts, moe_families.hf_greedy(family, prompts, MAX_TOKENS), family)


@pytest.mark.timeout(600)
def test_moe_tensor_parallel_matches_transformers():
    """Two ranks (gloo, one process each) split every expert's intermediate features, the shared expert and
    the dense layer as dense MLPs are split: transformers' tokens still (Qwen2-MoE)."""
    llm = LLM(model=str(moe_families.folder("qwen2moe")), dtype="float32", tensor_parallel_size=2, seed=0)
    try:
        assert llm.engine.runner.model.model.layers[0].mlp.experts.w2.shape[2] == 16  # 32 over 2 ranks
        prompts = [llm.get_tokenizer().encode(text) for text in TEXTS]
        references = moe_families.hf_greedy("qwen2moe", prompts, MAX_TOKENS)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        mismatches, ties = compare([o.outputs[0].token_ids for o in outputs], references)
        print(f"qwen2moe on 2 ranks: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
        assert not mismatches, mismatches
        assert_all_blocks_free(llm)
    finally:
        llm.engine.shutdown()


def test_fused_expert_tensors_load_as_per_expert_ones():
    """transformers 5's fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] fill the
    same stacks as per-expert gate/up/down tensors."""
    gate, up, down = torch.randn(4, 6, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 6)
    per_expert, fused = FusedExperts(4, 8, 6), FusedExperts(4, 8, 6)
    for e in range(4):
        for projection, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            per_expert.load_expert(e, projection, weight[e])
    with pytest.raises(ValueError, match="missing weights of experts"):
        fused.finalize()
    fused.load_fused("gate_up_proj", torch.cat([gate, up], dim=1))
    fused.load_fused("down_proj", down)
    fused.finalize()
    per_expert.finalize()
    assert torch.equal(fused.w13, per_expert.w13) and torch.equal(fused.w2, per_expert.w2)
    assert torch.equal(fused.w13[:, :6], gate)


def test_int8_quantization_keeps_experts_int8():
    """The engine's int8 quantization quantizes each expert's rows (one scale per row) and the fused kernel
    computes from them: the experts' output is that of the dequantized int8 values."""
    gate, up, down = torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32)
    experts = FusedExperts(4, 64, 32)
    for e in range(4):
        for projection, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            experts.load_expert(e, projection, weight[e])
    experts.finalize(quantize_int8=True)
    assert experts.w13.dtype == experts.w2.dtype == torch.int8
    assert experts.weight_bytes == 4 * 3 * 32 * 64 + 4 * (2 * 32 + 64) * 4  # int8 weights, a scale per row
    x, (weights, ids) = torch.randn(5, 64), torch.rand(5, 4).topk(2)
    dense = [
        torch.stack([Int8Weight.quantize(w[e]).dequantize() for e in range(4)]) for w in (gate, up, down)
    ]
    expected = fused_moe_ref(x, torch.cat(dense[:2], dim=1), dense[2], weights, ids)
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"clip_qkv": 8.0}, "clip_qkv"),
        ({"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_config_is_refused_naming_the_field(tmp_path, change, field):
    source = moe_families.folder("qwen2moe")
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "config.json").unlink()
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tmp_path), dtype="float32")


# llama.cpp's converter maps no dense MLP in a Qwen2-MoE file: its sparse-only form stands in. Mixtral's and
# OLMoE's files (a conversion and a reference each, some 15 s) run with `-m slow`.
GGUF_FAMILIES = (
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("olmoe", marks=pytest.mark.slow),
    "qwen2moe-sparse",
    "qwen3moe",
)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_moe_gguf_matches_transformers(family):
    """The file llama.cpp's converter writes (stacked ffn_*_exps experts) gives transformers' tokens for
    what it keeps of the checkpoint (f32; Mixtral's file keeps no window)."""
    llm = LLM(model=str(moe_families.gguf_path(family, "f32")), dtype="float32", quantization="none", seed=0)
    prompts = [llm.get_tokenizer().encode(text) for text in TEXTS]
    references = moe_families.gguf_hf_greedy(family, prompts, MAX_TOKENS)
    _assert_greedy_tokens(llm, prompts, references, f"{family} GGUF f32")


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_moe_gguf_q8_0_matches_dequantized(family):
    """The Q8_0 file kept quantized (its experts int8 in the fused kernel) gives the tokens of the same file
    dequantized, ties at margins below 1e-3 excused."""
    path = str(moe_families.gguf_path(family, "q8_0"))
    loaded = load_model(path)
    weights = dict(loaded.weights)
    assert loaded.quantization == "gguf"
    assert not isinstance(weights["model.layers.0.self_attn.q_proj.weight"], torch.Tensor)
    assert not isinstance(weights["model.layers.0.mlp.experts.7.down_proj.weight"], torch.Tensor)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    dense = LLM(model=path, dtype="float32", quantization="none", seed=0)
    prompts = [{"prompt_token_ids": dense.get_tokenizer().encode(text)} for text in TEXTS]
    references = []
    for out in (o.outputs[0] for o in dense.generate(prompts, params, use_tqdm=False)):
        margins = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.logprobs]
        references.append((out.token_ids, [m[0] - m[1] for m in margins]))
    del dense
    llm = LLM(model=path, dtype="float32", seed=0)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.int8
    outputs = llm.generate(prompts, params, use_tqdm=False)
    mismatches, ties = compare([o.outputs[0].token_ids for o in outputs], references)
    print(f"{family} GGUF Q8_0: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)
