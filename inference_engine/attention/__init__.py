"""Paged attention backends.

Every backend first stores the step's new K/V into the paged cache through the slot mapping, then
attends each query token to its sequence's cached K/V through the block table. The model runner
builds one `AttentionMetadata` per step, shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    query_start_loc: torch.Tensor  # [batch + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [batch] int32, cached tokens after this step (prefix + new)
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    query_lens: list[int]  # host copies, for backends that loop on the host
    context_lens: list[int]  # tokens already cached before this step
    max_query_len: int
    max_seq_len: int

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def get_backend(name: str):
    """Returns `forward(q, k, v, k_cache, v_cache, meta, scale) -> out` for "torch" or "triton"."""
    if name == "torch":
        from inference_engine.attention.torch_backend import forward
    elif name == "triton":
        from inference_engine.attention.triton_backend import forward
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    return forward
