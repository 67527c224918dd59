"""Paged attention backends.

Every backend first stores the step's new K/V into the paged cache through the slot mapping, then
attends each query token to its sequence's cached K/V through the block table. The model runner
builds one `AttentionMetadata` per step, shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Split count of the CUDA decode kernel: fixed per captured batch size under CUDA graphs (the kernel
    # sizes each sequence's splits itself); None lets the kernel choose from the block-table width.
    num_splits: int | None = None

    _per_token: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token as a one-token query of its own: (block tables, causal lengths) per token.

        A prefill token at position p attends to the first p + 1 cached tokens of its sequence, exactly
        like a decode, so one decode kernel serves prefill chunks too. Computed once per step.
        """
        if self._per_token is not None:
            return self._per_token
        if self.decode_only:  # a decode token attends to its whole sequence
            self._per_token = (self.block_tables, self.seq_lens)
        else:
            q_lens = torch.tensor(self.query_lens)
            device = self.block_tables.device
            tables = self.block_tables.repeat_interleave(q_lens.to(device), dim=0)
            starts = self.query_start_loc[:-1].cpu()
            first = torch.repeat_interleave(torch.tensor(self.context_lens) + 1 - starts, q_lens)
            lens = (first + torch.arange(len(first))).to(device=device, dtype=torch.int32)
            self._per_token = (tables, lens)
        return self._per_token


def get_backend(name: str):
    """Returns `forward(q, k, v, k_cache, v_cache, meta, scale) -> out` for "torch" or "triton"."""
    if name == "torch":
        from inference_engine.attention.torch_backend import forward
    elif name == "triton":
        from inference_engine.attention.triton_backend import forward
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    return forward
