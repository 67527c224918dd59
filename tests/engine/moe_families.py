"""Tiny random mixture-of-experts checkpoints of every MoE family the engine loads (8 experts, top-2, three
layers), written by transformers with the family's quirks on: Mixtral with a sliding window, Qwen2-MoE with
its shared expert and a dense layer (`mlp_only_layers`), Qwen3-MoE renormalising its top-k weights, OLMoE.
Cached once per machine with the bundled tokenizer, as `families` caches the dense families."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from .families import _hf_greedy
from .quant_checkpoints import CACHE, TOKENIZER_FILES, _cached, _version, cached_json, dense_folder

MOE_VERSION = 1
WINDOW = 16
SHAPE = dict(
    vocab_size=49152,  # the bundled model's tokenizer
    hidden_size=64,
    intermediate_size=96,  # dense layers (Qwen2-MoE's mlp_only_layers); Mixtral's and OLMoE's experts
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, sliding_window=WINDOW)),
    "qwen2moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=80, mlp_only_layers=[1]
        ),
    ),
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8)),
}


def folder(family: str) -> Path:
    """The family's tiny checkpoint, built once per machine and transformers version."""
    return _cached(f"moe-{family}-{_version('transformers')}-{MOE_VERSION}", lambda f: build(family, f))


def build(family: str, folder: Path) -> None:
    """Writes the family's tiny checkpoint (fp32 safetensors, config, the bundled tokenizer) into folder.
    Weights are drawn wider than transformers' initialisation, so that logits and router choices have
    margins (as `benchmarks.random_families` draws them)."""
    import transformers

    cls_name, quirks = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**SHAPE, **quirks)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.15)
    model.to(torch.float32).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(dense_folder() / name, folder / name)


def hf_greedy(family: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens for each prompt with the top-2 logit margin at each step (as
    `families.hf_greedy`), kept once per machine."""
    key = json.dumps([prompts, max_tokens])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = CACHE / f"moe-{family}-{_version('transformers')}-{MOE_VERSION}-greedy-{digest}.json"
    return [tuple(r) for r in cached_json(path, lambda: _hf_greedy(folder(family), prompts, max_tokens))]
