"""A Llama-architecture Hugging Face folder with random weights and the bundled model's tokenizer, for
tests and benchmarks that need shapes the bundled model does not have (e.g. heads that split in two)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference_engine.model_loader import default_model_path
from inference_engine.model_loader.gguf_loader import load as load_gguf


def write_random_llama(
    folder: Path,
    *,
    hidden: int = 576,
    heads: int = 8,
    kv_heads: int = 2,
    layers: int = 30,
    intermediate: int = 1536,
    seed: int = 0,
) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json; returns the folder. Weights are drawn large
    enough that logits are peaked (a flat random model makes greedy decoding a string of near-ties)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_gguf(default_model_path()).tokenizer
    vocab = tokenizer.vocab_size
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.eos_token_ids[0],
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {
        "model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden),
    }
    kv = kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden, scale=hidden**-0.5),
            p + "self_attn.k_proj.weight": rand(kv, hidden, scale=hidden**-0.5),
            p + "self_attn.v_proj.weight": rand(kv, hidden, scale=hidden**-0.5),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden, scale=hidden**-0.5),
            p + "mlp.up_proj.weight": rand(intermediate, hidden, scale=hidden**-0.5),
            p + "mlp.down_proj.weight": rand(hidden, intermediate, scale=intermediate**-0.5),
        }
    save_file(weights, str(folder / "model.safetensors"))
    return folder
