"""The paged KV allocator on its own: counters, copy-on-write forks, prefix caching and LRU eviction."""

from __future__ import annotations

from inference_engine.block_manager import BlockManager
from inference_engine.sampling_params import SamplingParams
from inference_engine.sequence import Sequence, SequenceGroup


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    group = SequenceGroup(f"r{seq_id}", None, tokens, SamplingParams())
    seq = Sequence(seq_id, group, list(tokens), len(tokens))
    group.seqs.append(seq)
    return seq


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What a scheduler step does: reserve slots, then mark the tokens computed."""
    n = len(seq) - seq.num_computed_tokens if n is None else n
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def test_blocks_are_allocated_on_demand_and_freed():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(6)))
    compute(bm, seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 8
    for token in range(6, 9):  # grow to 9 tokens: the third block comes only with the 9th token
        seq.token_ids.append(token)
        compute(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    bm.free_seq(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(6)))
    compute(bm, parent)
    child = make_seq(list(range(6)), seq_id=1)
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.num_free_blocks == 8
    child.token_ids.append(100)
    copies = bm.append_slots(child, 1)  # writes into the shared, partly filled last block
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert bm.ref_counts[parent.block_table[0]] == 2 and bm.ref_counts[parent.block_table[1]] == 1
    bm.free_seq(parent)
    bm.free_seq(child)
    assert bm.num_free_blocks == 10


def test_prefix_cache_reuses_full_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(10)))
    compute(bm, first)
    blocks = list(first.block_table)
    bm.free_seq(first)
    assert bm.num_free_blocks == 10  # cached blocks count as free: they are evictable

    second = make_seq([*range(9), 99], seq_id=1)
    assert bm.match_prefix(second) == 8  # two full blocks shared; the third differs
    assert second.block_table == blocks[:2] and second.num_computed_tokens == 8
    exact = make_seq(list(range(8)), seq_id=2)
    assert bm.match_prefix(exact) == 4  # the last token is recomputed, so its block is not matched


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = make_seq([1, 2, 3])
    compute(bm, old)
    bm.free_seq(old)
    new = make_seq([5, 6, 7], seq_id=1)
    compute(bm, new)
    bm.free_seq(new)
    # Taking three blocks evicts the blank ones first, then the oldest cached block ([1, 2]).
    hog = make_seq([9, 9, 9, 9, 9], seq_id=2)
    compute(bm, hog)
    assert make_seq_match(bm, [5, 6, 7]) == 2
    assert make_seq_match(bm, [1, 2, 3]) == 0


def make_seq_match(bm: BlockManager, tokens: list[int]) -> int:
    probe = make_seq(tokens, seq_id=50)
    hit = bm.match_prefix(probe)
    bm.free_seq(probe)
    return hit


def test_reset_prefix_cache_forgets_cached_blocks_only_when_idle():
    bm = BlockManager(num_blocks=10, block_size=4)
    first = make_seq(list(range(9)))
    compute(bm, first)
    holder = make_seq(list(range(100, 104)), seq_id=1)
    compute(bm, holder)
    bm.free_seq(first)
    assert not bm.reset_prefix_cache()  # `holder` still holds a block: refused, nothing dropped
    again = make_seq(list(range(9)), seq_id=2)
    assert bm.match_prefix(again) == 8
    bm.free_seq(again)
    bm.free_seq(holder)
    assert bm.reset_prefix_cache()
    fresh = make_seq(list(range(9)), seq_id=3)
    assert bm.match_prefix(fresh) == 0
    assert bm.num_free_blocks == 10
