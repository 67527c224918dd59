"""OLMo 2: no norm before attention or MLP; each sublayer's output is normalised before it joins the
residual stream, and one RMSNorm spans the whole query and the whole key projection."""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.attention import AttentionMetadata
from inference_engine.layers.norm import RMSNorm
from inference_engine.model_config import ModelConfig
from inference_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary, backend, qk_norm: str | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, rotary, backend, qk_norm)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        residual = hidden if residual is None else hidden + residual
        residual = residual + self.post_attention_layernorm(self.self_attn(positions, residual, meta))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual

    def native_norms(self) -> dict[str, torch.Tensor | None]:
        return {
            "input_norm": None,
            "post_norm": None,
            "post_attn_norm": self.post_attention_layernorm.weight,
            "post_mlp_norm": self.post_feedforward_layernorm.weight,
        }


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
    qk_norm = "whole"
