"""The native decoder (all layers of a few-token step in one call) gives the layer-by-layer path's bits:
same tokens and same logprobs, dense bf16 and quantized, for decode steps, small mixed steps and
speculative verification."""

from __future__ import annotations

import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.attention.torch_backend import NATIVE_QUERY_MIN, native_query_max
from inference_engine.layers.linear import LinearBase
from llmserve_kernels.cpu.linear import FORCED_DENSE_ROWS, _DequantizedMatmul

from .conftest import PROMPTS

BF16 = torch.bfloat16

# Proposals at any batch size: the four prompts run together, above the CPU default for quantized weights.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,
}


def _pair(**kwargs) -> tuple[LLM, LLM]:
    native = LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 27, **kwargs)
    plain = LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 27, **kwargs)
    assert native.llm_engine.runner.model.model.native is not None
    plain.llm_engine.runner.model.model.native = None
    return native, plain


def _assert_same(native: LLM, plain: LLM, prompts: list[str]) -> int:
    """Asserts both engines give the same tokens and logprobs; returns how many of the prompts decoded (a
    prompt whose first token is EOS never reaches a decode step)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    decoded = 0
    for a, b in zip(
        native.generate(prompts, params, use_tqdm=False),
        plain.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        decoded += len(a.outputs[0].token_ids) > 1
    return decoded


@pytest.mark.parametrize("quantization", ["none", "gguf"], ids=["bf16", "q4_1"])
def test_native_decoder_equals_the_layer_by_layer_path(quantization):
    native, plain = _pair(quantization=quantization)
    calls = []
    forward = native.llm_engine.runner.model.model.native.forward
    native.llm_engine.runner.model.model.native.forward = lambda *a: calls.append(len(a[0])) or forward(*a)
    # The decoder takes steps of up to `max_rows` tokens, a limit timed on this CPU (up to 64 where every
    # layer's kernel serves such steps): prompts go in batches that decode within it.
    # Short prompts prefill within it too; longer ones go layer by layer, and their decode steps come back.
    # A batch's decode steps carry only the prompts that did not stop at their first token.
    batch = min(native.llm_engine.runner.model.model.native.max_rows, 6)
    decoding = [_assert_same(native, plain, PROMPTS[start : start + batch]) for start in range(0, 6, batch)]
    assert calls and max(calls) >= max(decoding)  # several rows at once, where the CPU's limit allows


def test_speculative_steps_through_the_native_decoder():
    native, plain = _pair(quantization="gguf", speculative_config=NGRAM)
    _assert_same(native, plain, PROMPTS[-4:])
    assert native.llm_engine.proposer.num_accepted_tokens > 0


def test_bf16_steps_above_the_forced_rows_run_in_one_call():
    """A step of more than `FORCED_DENSE_ROWS` tokens, up to the decoder's limit, runs in one native call
    where every layer's timing leaves such steps to our kernels (through Python it would be some 300 calls),
    with the layer path's bits: here a long prompt between short ones, whose attention takes the extend
    kernel where the layer path sends it there (chunks above `NATIVE_QUERY_MIN` tokens) and the decode
    kernel for the runs of rows before and after it."""
    native, plain = _pair(quantization="none")
    decoder = native.llm_engine.runner.model.model.native
    if decoder.max_rows <= FORCED_DENSE_ROWS:
        pytest.skip(f"oneDNN took steps above {FORCED_DENSE_ROWS} rows for some layer here")
    calls = []
    forward = decoder.forward
    decoder.forward = lambda *a: calls.append(len(a[0])) or forward(*a)
    tokenizer = native.get_tokenizer()
    short = [tokenizer.encode(p) for p in PROMPTS[:3]]
    attn = native.llm_engine.runner.model.model.layers[0].self_attn
    limit = native_query_max(attn.num_heads, attn.num_kv_heads, attn.head_dim, BF16, torch.get_num_threads())
    longest = min(decoder.max_rows - sum(map(len, short)), limit)  # beyond the limit, SDPA: the layer path
    long = tokenizer.encode(" ".join(PROMPTS * 6))[:longest]
    prompts = [{"prompt_token_ids": ids} for ids in (short[0], long, *short[1:])]
    _assert_same(native, plain, prompts)
    assert calls[0] == len(long) + sum(map(len, short)) > FORCED_DENSE_ROWS


def test_quantized_prompt_steps_beyond_the_native_kernels_rows():
    """Where the layer-by-layer path sends steps of more rows than the native quantized kernel takes through
    the weight's dequantized tiles, the decoder takes them too, through the same route: a prompt of
    `NATIVE_QUERY_MIN` tokens prefills in one call, with the layer path's bits."""
    native, plain = _pair(quantization="gguf")
    decoder = native.llm_engine.runner.model.model.native
    packed = [m.packed[0] for m in native.llm_engine.runner.model.modules() if isinstance(m, LinearBase)]
    kernel_rows = min(p.small_rows for p in packed)
    tiles_route = all(
        isinstance(p.large, _DequantizedMatmul) and p.large.tile_rows >= NATIVE_QUERY_MIN
        for p in packed
        if p.small_rows < NATIVE_QUERY_MIN
    )
    if kernel_rows >= NATIVE_QUERY_MIN or not tiles_route:
        pytest.skip("the layer path sends no step of the decoder's size through the dequantized tiles here")
    calls = []
    forward = decoder.forward
    decoder.forward = lambda *a: calls.append(len(a[0])) or forward(*a)
    ids = native.get_tokenizer().encode(" ".join(PROMPTS))[:NATIVE_QUERY_MIN]
    _assert_same(native, plain, [{"prompt_token_ids": ids}])
    assert decoder.max_rows >= NATIVE_QUERY_MIN and calls[0] == NATIVE_QUERY_MIN > kernel_rows


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "olmo2", "mistral", "granite", "phi3"])
def test_families_take_the_native_decoder_with_the_layer_paths_bits(family):
    """Each family's variants (q/k norms, sandwich and post norms, GELU-tanh, windows, soft-caps, scales,
    per-layer rotary tables, partial rotation, folded multipliers) run in the native decoder, with the layer
    path's bits."""
    from . import families

    kwargs = {"model": str(families.folder(family)), "quantization": "none"}
    native, plain = _pair(**kwargs)
    tokenizer = native.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS[2:4]]  # 13 and 40 tokens
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    for a, b in zip(
        native.generate(prompts, params, use_tqdm=False),
        plain.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
