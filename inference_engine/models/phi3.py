"""Phi-3 and Phi-4-mini: Llama layers whose checkpoints store q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (split here into the parts our fused layers load per rank); partial rotation and `longrope`
scaling come from the config through the shared rotary layer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from inference_engine.layers.linear import Weight
from inference_engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        config = self.config
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                    yield name.replace("qkv_proj", part), tensor.narrow(0, start, rows)
            elif ".gate_up_proj." in name:
                half = tensor.shape[0] // 2
                yield name.replace("gate_up_proj", "gate_proj"), tensor.narrow(0, 0, half)
                yield name.replace("gate_up_proj", "up_proj"), tensor.narrow(0, half, half)
            else:
                yield name, tensor
