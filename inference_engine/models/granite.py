"""Granite (3.x dense): Llama layers with four multipliers from the config: embeddings scaled by
`embedding_multiplier`, attention by `attention_multiplier` (instead of 1/sqrt(head_dim): read by the
shared attention), logits divided by `logits_scaling` (read by the shared head), and each sublayer's output
scaled by `residual_multiplier` before it joins the residual stream: folded here into the output
projections' weights, so the layers are Llama's (and the native decoder's)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from inference_engine.layers.linear import Weight
from inference_engine.model_config import ModelConfig
from inference_engine.models.llama import LlamaForCausalLM


def scaled(weight: Weight, factor: float) -> Weight:
    """`weight` times `factor`, in the form it came in (a quantized weight's scales and offsets scale)."""
    if isinstance(weight, torch.Tensor):
        return weight.float() * factor
    if hasattr(weight, "offset"):
        return replace(weight, scale=weight.scale * factor, offset=weight.offset * factor)
    return replace(weight, scale=weight.scale * factor)


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__(config, backend)
        self.model.embed_scale = config.embedding_multiplier

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        factor = self.config.residual_multiplier
        for name, tensor in weights:
            if factor != 1.0 and name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias")):
                tensor = scaled(tensor, factor)
            yield name, tensor
