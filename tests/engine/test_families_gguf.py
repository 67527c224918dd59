"""The GGUF form of every family llama.cpp's converter writes (`family_gguf`): our engine on the converted
file, dequantized (fp32), gives transformers' fp32 greedy tokens for what the file keeps of its checkpoint;
on the Q8_0 file, kept quantized, it gives the tokens of our engine on the same file dequantized, and
transformers' own on that file where its GGUF loader reads it as llama.cpp does (Mistral's; see
`family_gguf.TRANSFORMERS_READS`). Divergences where the reference's top-2 margin is below 1e-3 are ties,
counted, not failures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.model_loader import gguf_file, gguf_loader, load_model

from . import families, family_gguf
from .conftest import assert_all_blocks_free
from .test_families import MAX_TOKENS, TEXTS

# The Triton interpreter runs each kernel launch in Python: in the suite, the family whose file keeps a
# sliding window; the rest with `-m slow`.
TRITON_SUITE: set[str] = set()  # all with -m slow: test_families runs gemma2 on Triton in the suite
# A converted file reads these back as the float32 it stores.
_ROUNDED = {"rms_norm_eps", "attention_multiplier"}
# llama.cpp names Mistral's architecture `llama`.
_ARCHITECTURE = {"mistral": "LlamaForCausalLM"}


def _greedy(llm: LLM, prompts: list[list[int]], logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    return [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.get_tokenizer().encode(text) for text in TEXTS]


@pytest.mark.parametrize("family", family_gguf.CONVERTED)
def test_gguf_config_is_the_checkpoints(family):
    """One parsing path: the file's metadata gives the checkpoint's ModelConfig, but for what the converter
    does not write (`family_gguf.READING`), and the tokenizer encodes as the checkpoint's."""
    ours = load_model(str(family_gguf.gguf_path(family, "f32")), "none")
    theirs = load_model(str(family_gguf.reading_folder(family)), "none")
    for field in dataclasses.fields(ours.config):
        a, b = getattr(ours.config, field.name), getattr(theirs.config, field.name)
        if field.name in _ROUNDED and a is not None:
            assert a == pytest.approx(b, rel=1e-6), field.name
        elif field.name == "architecture":
            assert a == _ARCHITECTURE.get(family, b)
        elif field.name != "rope_scaling" or family != "llama3":  # llama3's: as frequency factors, below
            assert a == b, field.name
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == theirs.tokenizer.encode(text)


def test_llama3_rope_factors_are_its_scaling():
    from inference_engine.layers.rotary import rope_angles

    ours = load_model(str(family_gguf.gguf_path("llama3", "f32")), "none").config
    theirs = load_model(str(families.folder("llama3")), "none").config
    assert ours.rope_scaling["rope_type"] == "longrope"
    a, _ = rope_angles(ours.head_dim, ours.rope_theta, ours.rope_scaling, ours.max_position_embeddings)
    b, _ = rope_angles(
        theirs.head_dim, theirs.rope_theta, theirs.rope_scaling, theirs.max_position_embeddings
    )
    assert (a - b).abs().max() < 1e-4 * a.abs().max()
    assert not (b - rope_angles(16, theirs.rope_theta, None, 256)[0]).abs().max() < 1e-3  # it scales


@pytest.mark.parametrize("family", family_gguf.CONVERTED)
def test_gguf_matches_transformers(family):
    llm = LLM(model=str(family_gguf.gguf_path(family, "f32")), dtype="float32", quantization="none", seed=0)
    prompts = _prompts(llm)
    references = family_gguf.hf_greedy(family, prompts, MAX_TOKENS)
    mismatches, ties = families.compare([o.token_ids for o in _greedy(llm, prompts)], references)
    print(f"{family} GGUF f32: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=[] if f in TRITON_SUITE else [pytest.mark.slow]) for f in family_gguf.CONVERTED],
)
def test_gguf_matches_transformers_on_triton(family):
    llm = LLM(
        model=str(family_gguf.gguf_path(family, "f32")),
        dtype="float32",
        quantization="none",
        attention_backend="triton",
        seed=0,
    )
    prompts = _prompts(llm)[:2]
    references = family_gguf.hf_greedy(family, prompts, MAX_TOKENS)
    mismatches, ties = families.compare([o.token_ids for o in _greedy(llm, prompts)], references)
    print(f"{family} GGUF f32 on Triton: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("family", family_gguf.CONVERTED)
def test_gguf_q8_0_kept_quantized_matches_dequantized(family):
    path = str(family_gguf.gguf_path(family, "q8_0"))
    dense = LLM(model=path, dtype="float32", quantization="none", seed=0)
    prompts = _prompts(dense)
    references = []
    for out in _greedy(dense, prompts, logprobs=2):
        margins = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.logprobs]
        references.append((out.token_ids, [m[0] - m[1] for m in margins]))
    del dense
    loaded = load_model(path)
    assert loaded.quantization == "gguf"
    assert not isinstance(dict(loaded.weights)["model.layers.0.self_attn.q_proj.weight"], torch.Tensor)
    llm = LLM(model=path, dtype="float32", seed=0)
    mismatches, ties = families.compare([o.token_ids for o in _greedy(llm, prompts)], references)
    print(f"{family} GGUF Q8_0: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("family", family_gguf.TRANSFORMERS_READS)
def test_gguf_q8_0_kept_quantized_matches_transformers_on_the_same_file(family):
    llm = LLM(model=str(family_gguf.gguf_path(family, "q8_0")), dtype="float32", seed=0)
    prompts = _prompts(llm)
    references = family_gguf.transformers_gguf_greedy(family, "q8_0", prompts, MAX_TOKENS)
    mismatches, ties = families.compare([o.token_ids for o in _greedy(llm, prompts)], references)
    print(
        f"{family} GGUF Q8_0 against transformers: {len(prompts) - len(mismatches) - ties} equal, {ties} ties"
    )
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


def test_mistral_file_has_no_window_and_the_reading_differs():
    """The Mistral file attends to every token (the converter writes no window for `llama`): its reference
    is not the checkpoint's, and on these prompts the two differ (the comparison above can see it)."""
    config = load_model(str(family_gguf.gguf_path("mistral", "f32")), "none").config
    assert config.sliding_window == 0
    llm = LLM(
        model=str(family_gguf.gguf_path("mistral", "f32")), dtype="float32", quantization="none", seed=0
    )
    prompts = _prompts(llm)
    windowed = [tokens for tokens, _ in families.hf_greedy("mistral", prompts, MAX_TOKENS)]
    full = [tokens for tokens, _ in family_gguf.hf_greedy("mistral", prompts, MAX_TOKENS)]
    assert windowed != full


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("llama.rope.scaling.type", "su-perfect", "su-perfect"),
        ("llama.attention.causal", False, "llama.attention.causal"),
        ("llama.expert_shared_count", 1, "llama.expert_shared_count"),  # Mixtral-style experts, no shared one
        ("general.architecture", "mamba", "mamba"),
    ],
)
def test_unsupported_gguf_metadata_is_refused_naming_it(key, value, named):
    """A key that would change the computation and that the loader does not map is refused, named."""
    reader = gguf_file.read(family_gguf.gguf_path("llama3", "f32"))
    meta = {name: v for name, v in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    gguf_loader.hf_config_dict(reader, meta)  # as it is: accepted
    with pytest.raises(ValueError, match=named):
        gguf_loader.hf_config_dict(reader, {**meta, key: value})
