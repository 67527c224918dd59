"""The persistent step buffers: after appends, copy-on-write, preemption, swap and row reuse, every step's
inputs equal those rebuilt from scratch from the sequences' own block tables."""

import random

import torch

from inference_engine.block_manager import BlockManager
from inference_engine.sampling_params import SamplingParams
from inference_engine.scheduler import SchedulerOutput
from inference_engine.sequence import Sequence, SequenceGroup
from inference_engine.step_inputs import StepInputs

BS = 4


def _expected(seqs: list[Sequence], counts: list[int]):
    ids, positions, slots, tables = [], [], [], []
    width = max(len(s.block_table) for s in seqs)
    for seq, n in zip(seqs, counts, strict=True):
        start = seq.num_computed_tokens
        ids += seq.scheduled_token_ids(start, n)
        positions += range(start, start + n)
        slots += [seq.block_table[p // BS] * BS + p % BS for p in range(start, start + n)]
        tables.append(seq.block_table + [0] * (width - len(seq.block_table)))
    return ids, positions, slots, tables


def _check(inputs: StepInputs, seqs: list[Sequence], counts: list[int]) -> None:
    step = inputs.prepare(SchedulerOutput(seqs=seqs, num_new_tokens=counts))
    ids, positions, slots, tables = _expected(seqs, counts)
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == positions
    assert step.meta.slot_mapping.tolist() == slots
    # Entries past a sequence's own blocks are never read (its length bounds every kernel).
    got = [row[: len(s.block_table)] for row, s in zip(step.meta.block_tables.tolist(), seqs, strict=True)]
    assert got == [t[: len(s.block_table)] for t, s in zip(tables, seqs, strict=True)]
    assert step.meta.block_tables.shape == (len(seqs), len(tables[0]))
    assert step.meta.seq_lens.tolist() == [
        s.num_computed_tokens + n for s, n in zip(seqs, counts, strict=True)
    ]


def _seq(seq_id: int, length: int, rng: random.Random) -> Sequence:
    tokens = [rng.randrange(1000) for _ in range(length)]
    group = SequenceGroup(str(seq_id), None, tokens, SamplingParams())
    return Sequence(seq_id, group, list(tokens), length)


def test_random_lifecycles_match_a_rebuild():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=400, block_size=BS, enable_prefix_caching=True, num_cpu_blocks=100)
    # Few rows and narrow tables at first: both must grow.
    inputs = StepInputs(max_tokens=4096, max_seqs=2, max_blocks=2, block_size=BS, device=torch.device("cpu"))
    live = [_seq(i, rng.randrange(1, 30), rng) for i in range(6)]
    next_id = 6
    for _ in range(300):
        batch = rng.sample(live, k=rng.randrange(1, len(live) + 1))
        counts = []
        for seq in batch:
            if seq.num_computed_tokens < len(seq) - 1:  # prefill chunk
                n = rng.randrange(1, len(seq) - seq.num_computed_tokens + 1)
                seq.draft_token_ids = []
            else:  # decode, sometimes with draft tokens
                seq.num_computed_tokens = len(seq) - 1
                seq.draft_token_ids = [rng.randrange(1000) for _ in range(rng.choice([0, 0, 2, 3]))]
                n = 1 + len(seq.draft_token_ids)
            bm.append_slots(seq, n)
            counts.append(n)
        _check(inputs, batch, counts)
        for seq, n in zip(batch, counts, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= len(seq):
                seq.token_ids.append(rng.randrange(1000))
                seq.num_computed_tokens = len(seq) - 1  # drafts rejected: their slots are rewritten later
                bm.trim(seq, len(seq))  # and the blocks taken for them given back
        event = rng.random()
        seq = rng.choice(live)
        if event < 0.1 or len(seq) > 60:  # finished: its row is reused by a new sequence
            bm.free_seq(seq)
            inputs.release(seq)
            live.remove(seq)
            live.append(_seq(next_id, rng.randrange(1, 30), rng))
            next_id += 1
        elif event < 0.2:  # preempted by recompute
            bm.free_seq(seq)
            seq.num_computed_tokens = 0
        elif event < 0.3 and seq.block_table:  # swapped out and back in
            bm.swap_out(seq)
            bm.swap_in(seq)
        elif (
            event < 0.4 and seq.block_table and len(live) < 10
        ):  # a forked sample shares blocks; its first write copies
            child = Sequence(next_id, seq.group, list(seq.token_ids), seq.num_prompt_tokens)
            child.num_computed_tokens = seq.num_computed_tokens
            next_id += 1
            bm.fork(seq, child)
            live.append(child)
    assert inputs.block_tables.table.shape[0] > 2 and inputs.block_tables.table.shape[1] > 2


def test_sampled_rows_cover_the_newest_token_and_every_draft():
    rng = random.Random(1)
    bm = BlockManager(num_blocks=50, block_size=BS)
    inputs = StepInputs(max_tokens=64, max_seqs=4, max_blocks=8, block_size=BS, device=torch.device("cpu"))
    prefill, partial, decode = _seq(0, 10, rng), _seq(1, 10, rng), _seq(2, 7, rng)
    bm.append_slots(decode, 6)
    decode.num_computed_tokens = 6
    decode.draft_token_ids = [5, 6, 7]
    for seq, n in ((prefill, 10), (partial, 4), (decode, 4)):
        bm.append_slots(seq, n)
    step = inputs.prepare(SchedulerOutput(seqs=[prefill, partial, decode], num_new_tokens=[10, 4, 4]))
    # prefill: its last row; the partial chunk: none; the decode: its newest token and three drafts
    assert step.sample_rows == [9, 14, 15, 16, 17]
    assert step.sample_seqs == [prefill, decode, decode, decode, decode]
    assert step.input_ids.tolist()[14:] == [decode.token_ids[-1], 5, 6, 7]
