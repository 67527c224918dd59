"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with a sparse MoE MLP; Qwen2-MoE adds a shared
expert every token goes through, scaled by a sigmoid gate. Layers listed in `mlp_only_layers` (or off the
`decoder_sparse_step`) keep a dense MLP."""

from __future__ import annotations

from inference_engine.models.moe import MoeForCausalLM
from inference_engine.models.qwen import qwen_layer_types


class Qwen2MoeForCausalLM(MoeForCausalLM):
    attention_bias = True
    default_layer_types = staticmethod(qwen_layer_types)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    attention_bias = False
    qk_norm = "head"
