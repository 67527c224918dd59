"""OLMoE: Llama's pre-norm layers with a sparse MoE MLP and, as OLMo 2, one RMSNorm over the whole query and
the whole key projection."""

from __future__ import annotations

from inference_engine.models.moe import MoeForCausalLM


class OlmoeForCausalLM(MoeForCausalLM):
    qk_norm = "whole"
