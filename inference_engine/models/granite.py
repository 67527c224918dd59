"""Granite (3.x dense): Llama layers with four multipliers from the config: embeddings scaled by
`embedding_multiplier`, attention by `attention_multiplier` (instead of 1/sqrt(head_dim): read by the
shared attention), each sublayer's output by `residual_multiplier` before it joins the residual stream,
and logits divided by `logits_scaling` (read by the shared head)."""

from __future__ import annotations

from inference_engine.attention import AttentionMetadata
from inference_engine.model_loader import ModelConfig
from inference_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, rotary, backend, qk_norm: str | None) -> None:
        super().__init__(config, layer, rotary, backend, qk_norm)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteDecoderLayer

    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__(config, backend)
        self.model.embed_scale = config.embedding_multiplier
