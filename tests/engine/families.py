"""Tiny random checkpoints of every architecture family the engine loads, written by transformers with the
family's quirks switched on (grouped-query attention, a sliding window shorter than prompt + output,
soft-capping, rope scaling), and transformers' own fp32 greedy continuations of them.

Weights are drawn wider than transformers' default initialisation so that logits have margins: with the
default, a tiny model's top two logits are often closer than fp32 rounding, and a comparison would measure
ties, not the engine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from .quant_checkpoints import CACHE, TOKENIZER_FILES, _cached, _version, cached_json, dense_folder

FAMILY_VERSION = 1

WINDOW = 16
_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
_LONG_FACTORS = [1.0 + i / 4 for i in range(6)]

# family: (transformers config class, its quirks)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-yarn": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama-linear": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(attention_bias=False)),
    "gemma2": (
        "Gemma2Config",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            sliding_window=WINDOW + 7,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0] * 6,
                "long_factor": _LONG_FACTORS,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "olmo2": ("Olmo2Config", {}),
    "granite": (
        "GraniteConfig",
        dict(embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
    ),
}


def hf_config(family: str):
    import transformers

    cls_name, quirks = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**_COMMON, **quirks})


def folder(family: str) -> Path:
    """The family's tiny checkpoint, built once per machine and transformers version."""
    return _cached(f"family-{family}-{_version('transformers')}-{FAMILY_VERSION}", lambda f: build(family, f))


def build(family: str, folder: Path) -> None:
    """Writes the family's tiny checkpoint (fp32 safetensors, config, the bundled tokenizer) into folder."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if "gemma" in family else param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(dense_folder() / name, folder / name)


def hf_greedy(family: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens for each prompt, with the margin between the top two logits at
    each step (a divergence where that margin is tiny is a tie, not an error); kept once per machine."""
    key = json.dumps([prompts, max_tokens])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = CACHE / f"family-{family}-{_version('transformers')}-{FAMILY_VERSION}-greedy-{digest}.json"
    return [tuple(r) for r in cached_json(path, lambda: _hf_greedy(folder(family), prompts, max_tokens))]


def _hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            results.append((out.sequences[0, len(ids) :].tolist(), margins))
    return results


def compare(outputs: list[list[int]], references: list[tuple[list[int], list[float]]], tie: float = 1e-3):
    """(mismatches, ties): a prompt whose tokens first differ where the reference's top-2 margin is below
    `tie` is a tie; anywhere else a mismatch (prompt index, step, ours, theirs)."""
    mismatches, ties = [], 0
    for i, (ours, (theirs, margins)) in enumerate(zip(outputs, references, strict=True)):
        step = next((s for s, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if step is None:
            continue
        if margins[step] < tie:
            ties += 1
        else:
            mismatches.append((i, step, ours[step:], theirs[step:]))
    return mismatches, ties


def config_json(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
