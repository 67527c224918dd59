"""Random checkpoints of every architecture family the engine loads, written by transformers itself with
the family's quirks switched on (grouped-query attention, sliding windows, soft-capping, rope scaling,
multipliers), at any shape: tiny for the equivalence tests (tests/engine/families.py), larger for the speed
of each family (benchmarks/families.py).

Weights are drawn wider than transformers' default initialisation so that logits have margins: with the
default, a small model's top two logits are often closer than fp32 rounding, and a comparison would measure
ties, not the engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=49152,  # the bundled model's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def families(window: int, original_context: int) -> dict[str, tuple[str, dict]]:
    """family: (transformers config class, its quirks); `window` for the sliding families, and the context
    that rope scaling stretches (`original_context`)."""
    rotary_pairs = 6  # of the tiny head's 12 rotated features (partial_rotary_factor 0.75 of 16)
    return {
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
                    "original_max_position_embeddings": original_context // 2,
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
                    "original_max_position_embeddings": original_context,
                }
            ),
        ),
        "llama-linear": (
            "LlamaConfig",
            dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        ),
        "mistral": ("MistralConfig", dict(sliding_window=window)),
        "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
        "qwen3": ("Qwen3Config", dict(attention_bias=False)),
        "gemma2": (
            "Gemma2Config",
            dict(
                sliding_window=window,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                hidden_activation="gelu_pytorch_tanh",
            ),
        ),
        "gemma3": (
            "Gemma3TextConfig",
            dict(
                sliding_window=window,
                query_pre_attn_scalar=24,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                },
            ),
        ),
        "phi3": (
            "Phi3Config",
            dict(
                sliding_window=window + 7,
                original_max_position_embeddings=original_context,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.75,
                    "short_factor": [1.0] * rotary_pairs,
                    "long_factor": [1.0 + i / 4 for i in range(rotary_pairs)],
                    "original_max_position_embeddings": original_context,
                },
            ),
        ),
        "olmo2": ("Olmo2Config", {}),
        "granite": (
            "GraniteConfig",
            dict(
                embedding_multiplier=4.0,
                attention_multiplier=0.2,
                residual_multiplier=0.5,
                logits_scaling=2.0,
            ),
        ),
    }


def hf_config(family: str, shape: dict, window: int = 16, original_context: int = 64):
    import transformers

    cls_name, quirks = families(window, original_context)[family]
    if cls_name == "Phi3Config":  # longrope lists one factor per rotated pair
        pairs = int(shape["head_dim"] * 0.75) // 2
        quirks["rope_parameters"]["short_factor"] = [1.0] * pairs
        quirks["rope_parameters"]["long_factor"] = [1.0 + i / 4 for i in range(pairs)]
    if cls_name == "Gemma3TextConfig":  # sliding and global layers alternate
        quirks["layer_types"] = ["sliding_attention", "full_attention"] * (shape["num_hidden_layers"] // 2)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-6)
    return getattr(transformers, cls_name)(**{**shape, **ids, **quirks})


def write_family(folder: Path, family: str, shape: dict, **quirk_sizes) -> None:
    """Writes the family's random checkpoint (fp32 safetensors and config.json) into folder."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, shape, **quirk_sizes))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by (1 + weight)
                param.uniform_(-0.5, 0.5) if family.startswith("gemma") else param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    model.to(torch.float32).save_pretrained(folder)
