"""Mixtral: Mistral's layers with a sparse MoE MLP (`block_sparse_moe`, experts w1 = gate, w3 = up,
w2 = down); the router always renormalises its top-k weights."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from inference_engine.layers.linear import Weight
from inference_engine.models.moe import MoeForCausalLM

_EXPERT_NAMES = {
    ".w1.weight": ".gate_proj.weight",
    ".w3.weight": ".up_proj.weight",
    ".w2.weight": ".down_proj.weight",
}


class MixtralForCausalLM(MoeForCausalLM):
    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for ours, theirs in _EXPERT_NAMES.items():
                if ".mlp.experts." in name and name.endswith(ours):
                    name = name[: -len(ours)] + theirs
            yield name, tensor
