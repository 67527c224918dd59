"""Quantized models end to end: perplexity against transformers on the same weights, greedy tokens of the
bundled Q4_1 file against its dequantized bf16 copy, and resident weight memory.

The engine runs each checkpoint as loaded (its weights kept quantized) in bf16, as it serves on this
CPU; the reference is transformers in fp32 on the weights the format's own dequantizer gives (see
quant_checkpoints.py). Perplexity comes from prompt_logprobs, as vLLM users measure it.
"""

from __future__ import annotations

import math

import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.layers.linear import LinearBase
from inference_engine.model_loader import default_model_path, load_model

from . import quant_checkpoints as qc
from .conftest import PROMPTS, assert_all_blocks_free, greedy

TEXT = (
    "The old harbour town wakes early. Before the sun clears the hills, the fishing boats are already "
    "out past the breakwater, and the bakery on the corner has its first loaves cooling in the window. "
    "By seven the market square fills with stalls: crates of apples and pears, wheels of cheese, baskets "
    "of bread, and tables of tools and second-hand books. Children on their way to school stop to watch "
    "the fishmonger clean the morning catch, while their parents argue about the price of tomatoes. "
    "In the afternoon the town grows quiet. Shopkeepers pull down their shutters, cats sleep in the "
    "shade of the church, and only the gulls keep up their noise above the harbour. Visitors who come in "
    "summer often ask why the town has no large hotel. The answer is simple: the people who live here "
    "voted against it, twice, because they feared that the narrow streets could not bear the traffic. "
    "Instead, families rent rooms above their shops, and guests eat at the same long tables as everyone "
    "else. When the boats return in the evening, the whole town gathers on the quay to see what the sea "
    "has given that day. Some nights the catch is poor and the talk is of weather and engines and debts. "
    "Other nights the nets are full, someone brings out a guitar, and the lights of the cafes stay on long "
    "after midnight, reflected in the still black water of the harbour."
)


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    return load_model(None).tokenizer.encode(TEXT)


def _perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def _linear_bytes_vs_bf16(llm: LLM) -> float:
    """Resident bytes of the linear layers (the projections that quantization applies to) over bf16's."""
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    elements = sum(p.out_features * p.in_features for m in layers for p in m.packed)
    return sum(m.weight_bytes for m in layers) / (2 * elements)


# checkpoint (None: the bundled file), the reference's kind, the engine's quantization
CASES = {
    "gguf-q4_1-bundled": (lambda: None, "gguf", None),
    "gguf-q8_0": (lambda: qc.gguf_file("Q8_0"), "gguf", None),
    "awq": (qc.awq_folder, "awq", None),
    "gptq": (lambda: qc.gptq_folder(False), "gptq", None),
    "gptq-desc-act": (lambda: qc.gptq_folder(True), "gptq", None),
    "int8-on-load": (qc.dense_folder, "int8", "int8"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_perplexity_within_one_percent_of_transformers(case, token_ids):
    checkpoint, kind, quantization = CASES[case]
    path = checkpoint()
    reference = qc.reference_logprobs(path or default_model_path(), kind, token_ids)
    llm = LLM(model=None if path is None else str(path), quantization=quantization, dtype="bfloat16")
    assert _linear_bytes_vs_bf16(llm) < 0.7  # the projections run quantized (dense bf16 would be 1)
    (out,) = llm.generate(
        {"prompt_token_ids": token_ids}, SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=False
    )
    ours = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], token_ids[1:], strict=True)]
    ppl, ref_ppl = _perplexity(ours), _perplexity(reference)
    print(
        f"{case}: perplexity {ppl:.4f} (transformers fp32 {ref_ppl:.4f}, {100 * (ppl / ref_ppl - 1):+.2f} %)"
    )
    assert abs(ppl / ref_ppl - 1) < 0.01
    assert_all_blocks_free(llm)


NEAR_TIE = 1.0  # logprob: twice the largest one-logit drift between the engines measured, and then some


def _below_best(token: int, top: dict) -> float | None:
    """How far below an engine's best logprob it rates `token` (None: not among its top ones)."""
    if token not in top:
        return None
    return round(max(lp.logprob for lp in top.values()) - top[token].logprob, 4)


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    if ours == theirs:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )


def test_bundled_q4_1_greedy_tokens_match_the_dequantized_engine_in_fp32():
    """With fp32 activations the quantized kernels compute what the dense weights give: every prompt's 32
    greedy tokens are identical."""
    quantized, dense = LLM(dtype="float32"), LLM(quantization="none", dtype="float32")
    outputs = [
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
        for llm in (quantized, dense)
    ]
    differ = [p[:30] for p, a, b in zip(PROMPTS, *outputs, strict=True) if a != b]
    assert not differ, differ
    assert_all_blocks_free(quantized)
    assert_all_blocks_free(dense)


@pytest.fixture(scope="module")
def bundled_pair() -> tuple[LLM, LLM]:
    """The bundled Q4_1 file served quantized, and dequantized to bf16 (the engine before quantization)."""
    return LLM(dtype="bfloat16"), LLM(quantization="none", dtype="bfloat16")


def test_bundled_q4_1_in_bf16_departs_only_at_near_ties(bundled_pair):
    """In bf16 the two engines round activations after different sums (the quantized kernel multiplies the
    exact dequantized weights, the dense one weights rounded to bf16, and which routine serves a step of
    many rows is timed per CPU), so their logits drift apart by a few bf16 steps (up to 0.375 for one
    logit at magnitudes near 28 on an AVX512-VNNI EPYC, where a step is 0.125) and greedy decoding may take
    the other of two nearly tied tokens. Where a prompt's tokens first differ, each engine must rate the
    token the other chose within `NEAR_TIE` of its own best; a wrong kernel departs early and far (a token
    outside the other's top five, margins of whole units)."""
    quantized, dense = bundled_pair
    params = greedy(logprobs=5)
    ours = quantized.generate(PROMPTS, params, use_tqdm=False)
    theirs = dense.generate(PROMPTS, params, use_tqdm=False)
    differ = []
    for prompt, a, b in zip(PROMPTS, ours, theirs, strict=True):
        at = _first_difference(a.outputs[0].token_ids, b.outputs[0].token_ids)
        if at is None or at >= min(len(a.outputs[0].logprobs), len(b.outputs[0].logprobs)):
            continue
        ours_top, theirs_top = a.outputs[0].logprobs[at], b.outputs[0].logprobs[at]
        gaps = (
            _below_best(a.outputs[0].token_ids[at], theirs_top),
            _below_best(b.outputs[0].token_ids[at], ours_top),
        )
        differ.append((prompt[:30], at, *gaps))
    same = len(PROMPTS) - len(differ)
    print(f"{same}/{len(PROMPTS)} identical; differ (prompt, token, each choice below the other's best):")
    print(differ)
    assert all(gap is not None and gap <= NEAR_TIE for _, _, *gaps in differ for gap in gaps), differ
    assert_all_blocks_free(quantized)
    assert_all_blocks_free(dense)


def test_bundled_q4_1_weights_take_a_fraction_of_their_bf16_size(bundled_pair):
    """Resident weight bytes against the model's bf16 size. The file keeps its tied embedding / LM head
    (a fifth of the parameters) in Q8_0, so even stored as in the file (5 bits per Q4_1 weight, 8.5 per
    Q8_0 one) the model takes 36 % of its bf16 size; the engine's formats hold fp32 scales and offsets,
    and how the kernels pack the values is theirs to choose (one byte per 4-bit value takes 61 %)."""
    quantized, dense = bundled_pair
    ours, bf16 = quantized.engine.runner.weight_bytes, 2 * quantized.engine.runner.model_config.num_parameters
    ratio = ours / bf16
    print(
        f"weights: {ours / 2**20:.1f} MiB quantized ({100 * ratio:.1f} % of {bf16 / 2**20:.1f} MiB in bf16); "
        f"the bf16 engine holds {dense.engine.runner.weight_bytes / 2**20:.1f} MiB"
    )
    # The file itself holds 5 bits a weight (Q4_1) and 8.5 in its tied embedding / LM head (Q8_0): 36 % of
    # bf16 is its own density, which the packed kernels keep.
    assert ratio < 0.37
