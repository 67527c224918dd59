"""Gemma 2 and Gemma 3 (text): "sandwich" norms around attention and MLP, RMSNorms that scale by
(1 + weight), embeddings scaled by sqrt(hidden_size), a GELU-tanh MLP, attention scaled by
query_pre_attn_scalar, sliding-window layers between global ones. Gemma 2 soft-caps attention and final
logits; Gemma 3 normalises each head's queries and keys and gives its sliding layers their own rope base
(both read from the config by the shared layers)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from inference_engine.attention import AttentionMetadata
from inference_engine.layers.linear import Weight
from inference_engine.layers.norm import RMSNorm
from inference_engine.model_config import ModelConfig
from inference_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with two more norms: post_attention_layernorm normalises the attention's output here,
    and the MLP's input and output have their own."""

    def __init__(self, config: ModelConfig, layer: int, rotary, backend, qk_norm: str | None) -> None:
        super().__init__(config, layer, rotary, backend, qk_norm)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def native_norms(self) -> dict[str, torch.Tensor | None]:
        return {
            "input_norm": self.input_layernorm.weight,
            "post_norm": self.pre_feedforward_layernorm.weight,
            "post_attn_norm": self.post_attention_layernorm.weight,
            "post_mlp_norm": self.post_feedforward_layernorm.weight,
        }


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer

    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__(config, backend)
        self.model.embed_scale = config.hidden_size**0.5

    @staticmethod
    def default_layer_types(raw: dict) -> list[str]:
        """Gemma 2 alternates, starting with a sliding layer."""
        layers = raw["num_hidden_layers"]
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """Gemma's norms multiply by (1 + weight): stored here as that sum, in fp32 as transformers adds it,
        so the shared RMSNorm kernels apply."""
        for name, tensor in weights:
            if name.endswith("norm.weight"):
                tensor = tensor.to(torch.float32) + 1.0
            yield name, tensor


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"

    @staticmethod
    def default_layer_types(raw: dict) -> list[str]:
        """Every `sliding_window_pattern`-th layer is global, the others slide."""
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        layers = raw["num_hidden_layers"]
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        # Multimodal Gemma 3 checkpoints keep the text model under language_model.
        for name, tensor in super().checkpoint_weights(weights):
            yield name.replace("model.language_model.", "model.").replace("language_model.", ""), tensor
