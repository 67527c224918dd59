"""A Llama-architecture Hugging Face folder with random weights and the bundled model's tokenizer, for
tests and benchmarks that need shapes the bundled model does not have (e.g. heads that split in two)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

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
    tokenizer: HFTokenizer | None = None,
) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json; returns the folder. Weights are drawn large
    enough that logits are peaked (a flat random model makes greedy decoding a string of near-ties). The
    tokenizer is the bundled model's unless one is given (`byte_level_tokenizer()` needs no file)."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        bundled = load_gguf(default_model_path()).tokenizer
        tokenizer, eos = bundled.backend, bundled.eos_token_ids[0]
        template = {"chat_template": bundled.chat_template, "eos_token": bundled.id_to_token(eos)}
        (folder / "tokenizer_config.json").write_text(json.dumps(template))
    else:
        eos = tokenizer.token_to_id("<|endoftext|>")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
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
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(folder / "tokenizer.json"))
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


def byte_level_tokenizer(vocab_size: int = 1024) -> HFTokenizer:
    """A small byte-level BPE tokenizer trained on a few sentences: enough to encode any text, for machines
    that do not carry the bundled model's file (a GPU check machine)."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention stores keys and values in fixed-size blocks.",
        "def main():\n    return 0",
        "请用中文介绍一下大语言模型。",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text, trainer)
    return tokenizer
