"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

A head tied to the embedding shares its weight: packed once, for the head's matmul and the
embedding's row lookups both (`kernels.*.linear.embedding`).
"""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.distributed import all_reduce, gather_to_first, tp_rank, tp_size
from inference_engine.layers.linear import Weight, _to, linear_kernels


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = self.tp_rank * self.shard
        self.device, self.dtype = torch.get_default_device(), torch.get_default_dtype()
        self.loaded: Weight | None = None
        self.packed = None
        self.serves_head = False  # set when a tied head multiplies by this weight too

    def load_weight(self, weight: Weight, shard_id=None) -> None:
        rows = min(self.shard, self.vocab_size - self.start)
        part = weight.narrow(0, self.start, rows)
        if isinstance(part, torch.Tensor) and rows < self.shard:  # the last rank's slice, padded
            part = torch.cat([part, part.new_zeros(self.shard - rows, part.shape[1])])
        self.loaded = _to(part, self.device, self.dtype)

    def finalize(self) -> None:
        if self.loaded is None:
            raise ValueError("checkpoint is missing the embedding weight")
        self.kernels = linear_kernels(self.device)
        self.packed = self.kernels.pack(self.loaded, self.dtype, keep_rows=True, pad=self.serves_head)
        self.loaded = None

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.embedding(ids, self.packed, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard)
        y = self.lookup(local.clamp(0, self.shard - 1)) * mask.unsqueeze(-1)
        return all_reduce(y)  # only this shard's rows are non-zero


class ParallelLMHead(VocabParallelEmbedding):
    tied_to: VocabParallelEmbedding | None = None  # set by models whose head shares the embedding

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        # A plain attribute, not a submodule: the embedding is finalized and counted once, as itself.
        object.__setattr__(self, "tied_to", embedding)
        embedding.serves_head = True

    def finalize(self) -> None:
        if self.tied_to is not None:
            return  # the embedding packs the shared weight
        self.kernels = linear_kernels(self.device)
        if self.loaded is None:
            raise ValueError("checkpoint is missing the LM head weight")
        self.packed = self.kernels.pack(self.loaded, self.dtype, pad=True)
        self.loaded = None

    @property
    def weight_bytes(self) -> int:
        return 0 if self.tied_to is not None else self.packed.nbytes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of every rank's vocabulary shard, on rank 0 only (None on the others: they never sample)."""
        source = self.tied_to or self
        logits = source.kernels.linear(hidden, source.packed)
        if self.tp_size > 1:
            logits = gather_to_first(logits)
            return None if logits is None else logits[:, : self.vocab_size]
        return logits
