"""Every architecture family the engine loads gives transformers' fp32 greedy tokens, on tiny random
checkpoints with the family's quirks switched on (`families.FAMILIES`): on the CPU path (native kernels),
and on the Triton path under the interpreter. Divergences where transformers' top-2 margin is below 1e-3 are
ties, counted and reported, not failures."""

from __future__ import annotations

import json

import pytest

from inference_engine import LLM, SamplingParams

from . import families
from .conftest import assert_all_blocks_free

MAX_TOKENS = 24
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived a",  # 15 tokens: past the window soon
    "def quicksort(arr):\n    ",
    "1, 1, 2, 3, 5, 8, 13,",
]
# The Triton interpreter runs each kernel launch in Python: one family in the suite, all with `-m slow`.
TRITON_SUITE = {"gemma2"}  # a window, both soft-caps, GELU and sandwich norms


def _run(family: str, backend: str, texts: list[str]) -> None:
    llm = LLM(model=str(families.folder(family)), dtype="float32", attention_backend=backend, seed=0)
    prompts = [llm.get_tokenizer().encode(text) for text in texts]
    references = families.hf_greedy(family, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    mismatches, ties = families.compare([o.outputs[0].token_ids for o in outputs], references)
    print(f"{family} {backend}: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_family_matches_transformers(family):
    _run(family, "torch", TEXTS)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=[] if f in TRITON_SUITE else [pytest.mark.slow])
        for f in sorted(families.FAMILIES)
    ],
)
def test_family_matches_transformers_on_triton(family):
    _run(family, "triton", TEXTS[:2])


def test_sliding_window_is_honoured():
    """A Mistral checkpoint whose window is shorter than the prompt: the window changes the tokens (so the
    comparison above can see a window ignored)."""
    config = families.config_json(families.folder("mistral"))
    assert config["sliding_window"] == families.WINDOW
    llm = LLM(model=str(families.folder("mistral")), dtype="float32", seed=0)
    prompt = llm.get_tokenizer().encode(TEXTS[1] * 3)
    assert len(prompt) > 2 * families.WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    windowed = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    for layer in llm.engine.runner.model.model.layers:
        layer.self_attn.window = 0
    full = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert windowed != full


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rope_parameters": {"rope_type": "su-perfect", "rope_theta": 10000.0}}, "rope_type"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "relu2"}, "hidden_act"),
        ({"architectures": ["MambaForCausalLM"]}, "MambaForCausalLM"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(tmp_path, change, field):
    source = families.folder("llama3")
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**families.config_json(source), **change}))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tmp_path), dtype="float32")
