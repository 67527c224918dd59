"""CUDA graphs for decode steps, as vLLM captures them.

A decode step of a small batch is hundreds of short kernel launches whose launch cost exceeds their work.
The model's forward pass for one token per sequence is captured once per batch size in `batch_sizes`
(1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs) over static input buffers, and a step is replayed at the
smallest captured size that holds it. Padding rows point at the runner's reserved pad block: they write
their K/V there and attend to its first slot, so they never touch a sequence's cache. The decode kernel's
split count is fixed per captured size (its own kernel sizes each sequence's splits on the device).

`GraphRunner(..., capture=False)` runs the same padded static-buffer path eagerly: that is how the
bookkeeping is tested where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference_engine.attention import AttentionMetadata
from inference_engine.step_inputs import PreparedStep


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Sizes captured: powers of two up to 8, then every 8 up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class GraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_blocks: int,
        pad_block: int,
        block_size: int,
        num_splits: Callable[[int], int | None],
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model, self.device, self.capture = model, device, capture
        self.sizes = batch_sizes(max_num_seqs)
        self.pad_block, self.block_size = pad_block, block_size
        size = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(size, dtype=torch.int64)
            self.positions = torch.zeros(size, dtype=torch.int64)
            self.slots = torch.zeros(size, dtype=torch.int64)
            self.seq_lens = torch.ones(size, dtype=torch.int32)
            self.query_start_loc = torch.arange(size + 1, dtype=torch.int32)
            self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32)
        self._pad(0)
        self.metas = {b: self._meta(b, num_splits(b)) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _meta(self, batch: int, num_splits: int | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            query_lens=[1] * batch,
            context_lens=[0] * batch,  # not read on the decode path
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            num_splits=num_splits,
        )

    def _pad(self, start: int) -> None:
        """Rows from `start` on become padding: token 0 at position 0, stored to and read from the pad
        block."""
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slots[start:] = self.pad_block * self.block_size
        self.seq_lens[start:] = 1
        self.block_tables[start:] = self.pad_block

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch], self.positions[:batch], self.metas[batch])

    def _capture_all(self) -> None:
        pool = None
        for batch in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
            self._forward(batch)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = graph

    def size_for(self, step: PreparedStep) -> int | None:
        """The captured size that runs this step, or None (not a pure decode step, or too large)."""
        meta = step.meta
        batch = len(meta.query_lens)
        if (
            meta.max_query_len != 1
            or batch > self.sizes[-1]
            or meta.block_tables.shape[1] > self.block_tables.shape[1]
        ):
            return None
        return next(size for size in self.sizes if size >= batch)

    def run(self, step: PreparedStep, size: int) -> torch.Tensor:
        """The hidden states of the step's rows, from the graph of `size` replayed over the static buffers."""
        meta = step.meta
        batch, width = len(meta.query_lens), meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(step.input_ids, non_blocking=True)
        self.positions[:batch].copy_(step.positions, non_blocking=True)
        self.slots[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        self._pad(batch)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:batch]
        return self._forward(size)[:batch]
