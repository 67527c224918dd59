"""The flattened inputs of one step, built in buffers allocated once.

Every step the model needs the scheduled tokens' ids, positions and cache slots, and each sequence's
query start, length and block table. These live in persistent host buffers (pinned on CUDA, copied to
the device without blocking) and are filled with a few vectorised numpy operations per step, whatever
the batch. Block tables are kept per sequence in a row of one persistent table: a step writes only the
blocks a sequence gained since its last step, and a whole row only when the block manager replaced
blocks (copy-on-write, preemption, swap, rollback of rejected speculative tokens), which it signals by
bumping `Sequence.block_table_version`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from inference_engine.attention import AttentionMetadata
from inference_engine.scheduler import SchedulerOutput
from inference_engine.sequence import Sequence


class BlockTables:
    """One row per live sequence; a row is valid up to `written[row]` entries."""

    def __init__(self, max_seqs: int, max_blocks: int) -> None:
        self.table = np.zeros((max_seqs, max_blocks), dtype=np.int32)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.free = list(range(max_seqs - 1, -1, -1))
        self.written = np.zeros(max_seqs, dtype=np.int64)
        self.versions = np.full(max_seqs, -1, dtype=np.int64)

    def _grow(self, rows: int, width: int) -> None:
        """More rows (forked samples and preempted sequences hold rows beyond max_num_seqs) or wider ones."""
        old_rows, old_width = self.table.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        table = np.zeros((rows, width), dtype=np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        self.free += range(rows - 1, old_rows - 1, -1)
        self.written = np.concatenate([self.written, np.zeros(rows - old_rows, dtype=np.int64)])
        self.versions = np.concatenate([self.versions, np.full(rows - old_rows, -1, dtype=np.int64)])

    def row(self, seq: Sequence) -> int:
        """The sequence's row, brought up to date with its block table."""
        row = self.rows.get(seq.seq_id)
        if row is None:
            if not self.free:
                self._grow(2 * len(self.table), 0)
            row = self.rows[seq.seq_id] = self.free.pop()
            self.versions[row] = -1
        table = seq.block_table
        if len(table) > self.table.shape[1]:
            self._grow(0, 2 * len(table))
        start = int(self.written[row])
        if self.versions[row] != seq.block_table_version:
            self.versions[row], start = seq.block_table_version, 0
        if start < len(table):
            self.table[row, start : len(table)] = table[start:]
        self.written[row] = len(table)
        return row

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free.append(row)


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [tokens] int64 on the device
    positions: torch.Tensor  # [tokens] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the flattened batch whose logits are sampled
    sample_seqs: list[Sequence]  # the sequence each sampled row belongs to (a row per draft position too)


class StepInputs:
    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size, self.device = block_size, device
        self.block_tables = BlockTables(max_seqs, max_blocks)
        self._allocate(max_tokens, max_seqs)

    def _allocate(self, max_tokens: int, max_seqs: int) -> None:
        pinned = self.device.type == "cuda"

        def host(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pinned)

        self.input_ids, self.positions, self.slots = (host(max_tokens, torch.int64) for _ in range(3))
        self.query_start_loc, self.seq_lens = host(max_seqs + 1, torch.int32), host(max_seqs, torch.int32)
        # numpy views of the same memory, for the vectorised filling
        self._ids, self._pos, self._slots = (t.numpy() for t in (self.input_ids, self.positions, self.slots))
        self._qsl, self._lens = self.query_start_loc.numpy(), self.seq_lens.numpy()

    def release(self, seq: Sequence) -> None:
        """Frees a finished or aborted sequence's block-table row."""
        self.block_tables.release(seq)

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        seqs, counts = sched.seqs, sched.num_new_tokens
        batch, bs = len(seqs), self.block_size
        if batch > len(self.seq_lens) or sum(counts) > len(self.input_ids):
            # forked samples join the batch beyond max_num_seqs
            self._allocate(max(sum(counts), len(self.input_ids)), max(batch, 2 * len(self.seq_lens)))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=batch)
        n = np.asarray(counts, dtype=np.int64)
        rows = np.fromiter((self.block_tables.row(s) for s in seqs), dtype=np.int64, count=batch)
        qsl = self._qsl[: batch + 1]
        qsl[0] = 0
        np.cumsum(n, out=qsl[1:])
        tokens = int(qsl[-1])
        scheduled = (
            seq.scheduled_token_ids(int(a), k) for seq, a, k in zip(seqs, starts, counts, strict=True)
        )
        self._ids[:tokens] = list(chain.from_iterable(scheduled))
        offsets = np.repeat(starts - qsl[:-1], n)
        positions = self._pos[:tokens]
        np.add(np.arange(tokens), offsets, out=positions)
        blocks = self.block_tables.table[np.repeat(rows, n), positions // bs]
        np.add(blocks * bs, positions % bs, out=self._slots[:tokens])
        seq_lens = starts + n
        self._lens[:batch] = seq_lens
        width = int(max(len(s.block_table) for s in seqs))
        tables = torch.from_numpy(self.block_tables.table[rows, :width])

        sample_rows, sample_seqs = [], []
        for b, seq in enumerate(seqs):
            end = int(seq_lens[b])
            first_new = len(seq) - 1  # the newest real token; draft tokens come after it
            if end > first_new:  # this chunk reaches the newest token: its logits (and drafts') are sampled
                last = int(qsl[b + 1])
                for position in range(max(first_new, int(starts[b])), end):
                    sample_rows.append(last - (end - position))
                    sample_seqs.append(seq)

        meta = AttentionMetadata(
            slot_mapping=self._to_device(self.slots[:tokens]),
            query_start_loc=self._to_device(self.query_start_loc[: batch + 1]),
            seq_lens=self._to_device(self.seq_lens[:batch]),
            block_tables=self._to_device(tables),
            query_lens=list(counts),
            context_lens=starts.tolist(),
            max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = self._to_device(self.input_ids[:tokens])
        positions = self._to_device(self.positions[:tokens])
        return PreparedStep(input_ids, positions, meta, sample_rows, sample_seqs)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)
