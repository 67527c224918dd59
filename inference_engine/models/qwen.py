"""Qwen2 and Qwen3. Qwen2 is Llama with a q/k/v bias (`attention_bias`, which its configs leave unset);
Qwen3 drops the bias and normalises each head's queries and keys before the rotation."""

from __future__ import annotations

from inference_engine.models.llama import LlamaForCausalLM


def qwen_layer_types(raw: dict) -> list[str]:
    """Older Qwen configs slide only where `use_sliding_window` is set, on the layers from
    `max_window_layers` on (they carry a `sliding_window` value either way)."""
    layers = raw["num_hidden_layers"]
    first = raw.get("max_window_layers", layers) if raw.get("use_sliding_window") else layers
    return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_bias = True
    default_layer_types = staticmethod(qwen_layer_types)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    attention_bias = False
    qk_norm = "head"
