"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.distributed import all_reduce, tp_rank, tp_size
from inference_engine.layers.linear import can_prepack, pack_weight, packed_linear
from inference_engine.timing import best_time


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        rows = loaded[self.start : self.start + self.shard]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(y)


_PADDED_ROWS = 33


def padding_pays(packed: torch.Tensor, runs: int = 5) -> bool:
    """Whether this CPU's oneDNN runs the packed head a tenth or more faster on 33 rows than on 24.

    On a CPU with AMX, oneDNN (PyTorch 2.13's) ran [26, 576] x [576, 49152] in bf16 in 6.7 ms and
    [33, 576] in 3.9 ms, so there a step of 17-32 sequences is best padded to 33 rows, as vLLM pads a
    batch to a captured CUDA-graph size. On an AVX512-BF16 EPYC without AMX padding is the slower
    one: 2.3 ms at 26 rows, 2.7 ms at 33.
    """
    gen = torch.Generator().manual_seed(0)
    hidden, dtype = packed.shape[1], packed.dtype
    plain, padded = (torch.randn(n, hidden, generator=gen).to(dtype) for n in (24, _PADDED_ROWS))
    plain_time = best_time(lambda: packed_linear(plain, packed, None), runs)
    return best_time(lambda: packed_linear(padded, packed, None), runs) < 0.9 * plain_time


class ParallelLMHead(VocabParallelEmbedding):
    packed: torch.Tensor | None = None
    tied = False  # set by models whose head shares the embedding's weight
    padded_steps = range(0)  # rows counts run padded to _PADDED_ROWS, where prepack measured that faster

    def prepack(self) -> None:
        """A tied weight serves embedding lookups as a plain matrix too, so its packed copy is kept beside
        it: one more vocab x hidden matrix in memory for a head twice as fast. An untied one is replaced."""
        if self.packed is None and can_prepack(self.weight):
            self.packed = pack_weight(self.weight)
            if not self.tied:
                self.weight = nn.Parameter(self.packed, requires_grad=False)
            if padding_pays(self.packed):
                self.padded_steps = range(17, _PADDED_ROWS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = hidden.shape[0]
            padded = F.pad(hidden, (0, 0, 0, _PADDED_ROWS - rows)) if rows in self.padded_steps else hidden
            logits = packed_linear(padded, self.packed, None)[:rows]
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            gathered = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(gathered, logits)
            logits = torch.cat(gathered, dim=-1)
        return logits
