"""Hugging Face folders: config.json, *.safetensors and tokenizer.json (+ tokenizer_config.json)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from inference_engine.model_loader import LoadedModel, ModelConfig
from inference_engine.tokenizer import load_hf_tokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def load(folder: Path) -> LoadedModel:
    raw = json.loads((folder / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"architecture {archs} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})."
        )
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    tokenizer = load_hf_tokenizer(folder, eos_ids)
    heads = raw["num_attention_heads"]
    # transformers >= 5 writes rope_theta inside rope_parameters; older configs have it at the top level.
    rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    rope_theta = raw.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    config = ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", arch == "qwen2"),
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return LoadedModel(name=folder.name, config=config, tokenizer=tokenizer, weights=_weights(folder))


def _weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}.")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)
