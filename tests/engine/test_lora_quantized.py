"""LoRA adapters on quantized base weights (QLoRA-style serving, issue 59): the bundled model as its GGUF
file holds it (Q4_1 projections, kept quantized by the engine) with the three random adapters of
`test_lora`, against transformers with each adapter merged into the dequantized fp32 weights.

In fp32 the quantized kernels compute what the dequantized weights give
(`test_quantized_accuracy`), so every prompt gets the reference's tokens; in bf16 (how the CPU serves) the
activations round differently from the fp32 reference and greedy decoding may take the other of two nearly
tied tokens, so most prompts match and each departure must be at a near tie (measured: 10 of 16 prompts
equal, the 6 departures at gaps of 0 to 0.25)."""

from __future__ import annotations

import pytest

from inference_engine import LLM
from inference_engine.layers.linear import LinearBase
from inference_engine.lora.request import LoRARequest

from .conftest import PROMPTS, assert_all_blocks_free, greedy
from .test_lora import ADAPTERS, MAX_TOKENS, SHORT, check_mixed_batch, hf_lora_greedy, write_adapter

NEAR_TIE = 0.5  # logprob gap within which bf16 rounding may swap two tokens (see test_quantized_accuracy)


def quantized_lora_llm(dtype: str) -> LLM:
    llm = LLM(dtype=dtype, seed=0, enable_lora=True, max_loras=2, max_lora_rank=16)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    dense_bytes = sum(2 * p.out_features * p.in_features for m in layers for p in m.packed)
    assert sum(m.weight_bytes for m in layers) < 0.7 * dense_bytes  # the projections run quantized
    return llm


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoRARequest]:
    """`test_lora`'s adapters (same seeds, same bytes: transformers' tokens for them are cached once)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: LoRARequest(name, i + 1, str(write_adapter(root / name, *spec, seed=i)))
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def qlora_llm() -> LLM:
    return quantized_lora_llm("float32")


def test_adapters_on_q4_1_weights_match_transformers_on_the_dequantized_weights(qlora_llm, adapters):
    """4 prompts (base and each adapter), 8 tokens, mixed in one generate call over two slots."""
    check_mixed_batch(qlora_llm, adapters, PROMPTS[4:8], max_tokens=SHORT)


@pytest.mark.slow
def test_sixteen_prompts_on_q4_1_weights_match_transformers(qlora_llm, adapters):
    check_mixed_batch(qlora_llm, adapters, PROMPTS[:16], max_tokens=MAX_TOKENS)


@pytest.mark.slow
def test_adapters_on_q4_1_weights_in_bf16_depart_only_at_near_ties(adapters):
    """16 prompts x 16 tokens in bf16: where a prompt's tokens first differ from the fp32 reference's, the
    engine rates the reference's token within NEAR_TIE of its own choice."""
    llm = quantized_lora_llm("bfloat16")
    names = [None, *adapters]
    prompts = [(prompt, names[i % 4]) for i, prompt in enumerate(PROMPTS[:16])]
    requests = [None if name is None else adapters[name] for _, name in prompts]
    params = greedy(MAX_TOKENS, logprobs=20)
    outputs = llm.generate([p for p, _ in prompts], params, lora_request=requests, use_tqdm=False)
    expected = hf_lora_greedy(llm.get_tokenizer(), adapters, prompts, MAX_TOKENS)
    ties = []
    for (prompt, name), out, want in zip(prompts, outputs, expected, strict=True):
        got = list(out.outputs[0].token_ids)
        if got == want:
            continue
        at = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        ranked = out.outputs[0].logprobs[at]
        gap = ranked[got[at]].logprob - ranked[want[at]].logprob if want[at] in ranked else float("inf")
        ties.append((name, prompt[:24], at, round(gap, 3)))
    print(f"bf16 QLoRA: {16 - len(ties)} of 16 prompts equal to the fp32 reference; departures: {ties}")
    assert all(gap <= NEAR_TIE for *_, gap in ties), ties
    assert len(ties) <= 8, ties  # most prompts equal (10 of 16 on an AVX512 EPYC)
    assert_all_blocks_free(llm)
