"""The prefix cache's second tier (inference_engine/kv_offload.py): blocks the KV pool evicts are kept in host
memory and copied back when a prompt reaches them again.

The block manager's bookkeeping runs against a simulated cache whose every block holds a value naming the
prefix it was computed for, through the same copy functions the CPU and CUDA runners call (CPU tensors stand
in for the device's): every block a sequence is pointed at must hold its own prefix once the step's copies
ran. The engine runs for real on the CPU with a pool too small for its prompts: the repeated prompts are
restored from the tier, give transformers' greedy tokens, and leave every block free."""

from __future__ import annotations

import random

import pytest
import torch

from inference_engine import LLM
from inference_engine.block_manager import BlockManager
from inference_engine.config import EngineConfig
from inference_engine.errors import InvalidRequestError
from inference_engine.kv_offload import CUDA_DEFAULT_GIB, OffloadTier, restore_blocks, store_blocks, tier_gib

from .conftest import assert_all_blocks_free, greedy
from .quant_checkpoints import dense_model
from .test_block_manager import make_seq

BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # the bundled model's fp32 block: K and V, 30 layers, 3 KV heads of 64


def test_copy_functions_round_trip_blocks():
    """Device blocks to tier slots and back, in the runner's layouts, on fresh random values."""
    kv = torch.randn(2, 3, 6, 4, 2, 5)  # [K/V, layers, blocks, block_size, kv_heads, head_dim]
    tier = torch.zeros(4, 2, 3, 4, 2, 5)  # [slots, K/V, layers, block_size, kv_heads, head_dim]
    original = kv.clone()
    store_blocks(kv, tier, [(5, 0), (2, 3)])
    assert torch.equal(tier[0], original[:, :, 5]) and torch.equal(tier[3], original[:, :, 2])
    assert not tier[1].any() and not tier[2].any()
    kv[:, :, [0, 2, 5]] = torch.randn(2, 3, 3, 4, 2, 5)
    restore_blocks(kv, tier, [(3, 0), (0, 4)])
    assert torch.equal(kv[:, :, 0], original[:, :, 2]) and torch.equal(kv[:, :, 4], original[:, :, 5])
    assert torch.equal(kv[:, :, 1], original[:, :, 1]), "a block no copy names is left alone"


def test_tier_is_lru_and_never_evicts_a_pinned_slot():
    tier = OffloadTier(2)
    tier.store("a", 0)
    tier.store("b", 1)
    tier.store("a", 2)  # held already: touched, not copied again
    assert tier.take_copies() == ([(0, 0), (1, 1)], [])
    tier.pin("b")  # b is now the most recently used, a the least
    tier.restore("b", 7)
    tier.store("c", 3)  # evicts a
    tier.pin("c")
    tier.restore("c", 8)
    tier.store("d", 4)  # both slots are pinned: d is not kept
    assert "a" not in tier and "b" in tier and "c" in tier and "d" not in tier
    assert tier.take_copies() == ([(3, 0)], [(1, 7), (0, 8)])
    tier.store("d", 4)  # the restores ran: the least recently used slot (b's) may go now
    assert "b" not in tier and tier.take_copies() == ([(4, 1)], [])
    assert tier.num_stored_blocks == 4 and tier.num_restored_blocks == 2


def _expected(key) -> float:
    return float(hash(key) % 1_000_003)


@pytest.mark.parametrize("num_slots", [3, 40])
def test_every_matched_block_holds_its_prefix_after_the_copies(num_slots):
    """Random admissions (sharing prefixes), undone admissions, steps that run and steps that do not, frees:
    after each step's copies (stores, then restores, as the runner does them), every block a sequence is
    pointed at holds its own prefix, and the tier serves hits."""
    rng = random.Random(num_slots)
    bs, num_blocks = 4, 12
    bm = BlockManager(num_blocks, bs, num_offload_blocks=num_slots)
    kv = torch.full((2, 1, num_blocks, bs, 1, 1), -1.0)
    tier = torch.full((num_slots, 2, 1, bs, 1, 1), -2.0)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]
    live, pending = [], []  # pending: sequences whose matched blocks the next step that runs must hold
    for i in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 6):
            bm.free_seq(live.pop(rng.randrange(len(live))))
        seq = make_seq(rng.choice(stems)[: rng.randrange(5, 13)] + [rng.randrange(50) for _ in range(3)], i)
        bm.match_prefix(seq)
        if rng.random() < 0.2 or not bm.can_append(seq, len(seq) - seq.num_computed_tokens):
            bm.free_seq(seq)  # the scheduler's undo: admitted next step, or never
            seq.num_computed_tokens = seq.num_cached_tokens = 0
        else:
            bm.append_slots(seq, len(seq) - seq.num_computed_tokens)
            pending.append(seq)
        if not pending:
            continue  # a step that runs nothing: its copies wait for the next one that does
        stores, restores = bm.take_offload_copies()
        store_blocks(kv, tier, stores)
        restore_blocks(kv, tier, restores)
        for seq in pending:
            matched = zip(seq.block_table[: seq.num_cached_tokens // bs], _keys(seq, bs), strict=False)
            for block, key in matched:
                assert kv[:, :, block].eq(_expected(key)).all(), f"step {i}: block {block} is stale"
        for seq in pending:  # the forward: every new full block gets its prefix's value
            for j, key in enumerate(_keys(seq, bs)):
                if j * bs >= seq.num_computed_tokens:
                    kv[:, :, seq.block_table[j]] = _expected(key)
            seq.num_computed_tokens = len(seq)
            bm.register_full_blocks(seq)
            live.append(seq)
        pending = []
    for seq in live:
        bm.free_seq(seq)
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
    assert bm.tier.num_restored_blocks > 0 and bm.tier.num_stored_blocks > 0


def _keys(seq, bs: int) -> list:
    """The prefix cache's keys of a sequence's full blocks."""
    keys, parent = [], 0
    for start in range(0, len(seq.token_ids) - bs + 1, bs):
        key = (parent, tuple(seq.token_ids[start : start + bs]))
        keys.append(key)
        parent = hash(key)
    return keys


def _computed(bm: BlockManager, tokens: list[int], seq_id: int):
    seq = make_seq(tokens, seq_id)
    bm.append_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.register_full_blocks(seq)
    return seq


def test_restores_stop_where_free_blocks_run_out():
    bs = 4
    bm = BlockManager(6, bs, num_offload_blocks=8)
    bm.free_seq(_computed(bm, list(range(21)), 0))  # 5 full blocks and a token
    other = _computed(bm, list(range(100, 109)), 1)  # takes 3 blocks: the partial one and 2 full ones
    assert len(bm.take_offload_copies()[0]) == 2
    again = make_seq(list(range(21)), 2)
    # Its first 3 blocks are on the device, the next 2 in the tier, with no block left to restore them into.
    assert bm.match_prefix(again) == 12 and bm.take_offload_copies() == ([], [])
    bm.free_seq(again)
    bm.free_seq(other)
    again = make_seq(list(range(21)), 3)
    assert bm.match_prefix(again) == 20 and len(bm.take_offload_copies()[1]) == 2
    bm.free_seq(again)
    assert bm.num_free_blocks == 6 and not any(bm.ref_counts)


def test_negative_tier_size_is_refused():
    with pytest.raises(InvalidRequestError, match="kv_offload_gib"):
        EngineConfig(kv_offload_gib=-1)


def test_the_tier_is_on_by_default_on_cuda_only():
    assert EngineConfig().kv_offload_gib is None
    assert tier_gib(None, torch.device("cuda")) == CUDA_DEFAULT_GIB > 0
    assert tier_gib(None, torch.device("cpu")) == 0
    assert tier_gib(0.0, torch.device("cuda")) == 0 and tier_gib(2.5, torch.device("cpu")) == 2.5


# Distinct prompts of 3-4 full blocks (48-64 tokens): no two share a block.
LONG_PROMPTS = [
    "The history of paged attention begins with virtual memory: operating systems split memory into pages "
    "so that a process never needs one contiguous region, and KV caches borrow the same idea: a sequence "
    "grows one block at a time, wherever a free block is.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1",
    "Recipe for a quick tomato soup: soften an onion and two cloves of garlic in olive oil, add a tin of "
    "tomatoes, a pinch of sugar and some stock, simmer for twenty minutes, then blend it until smooth and "
    "serve it hot with bread.",
    "SELECT customer_id, SUM(amount) AS total FROM payments WHERE paid_at >= '2024-01-01' GROUP BY "
    "customer_id HAVING SUM(amount) > 1000 ORDER BY total DESC LIMIT 20;",
]


def _hf_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, by a loop of plain forwards (cheaper than generate on shared cores)."""
    pytest.importorskip("transformers")
    model = dense_model()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            tokens = list(ids)
            for _ in range(max_tokens):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            outputs.append(tokens[len(ids) :])
    return outputs


@pytest.fixture(scope="module")
def served():
    """A pool of 12 blocks and LONG_PROMPTS run one at a time (so that they evict each other), twice: the
    engine, the prompts' token ids, and each pass's greedy tokens and stats."""
    llm = LLM(
        dtype="float32",
        kv_cache_memory_bytes=12 * BLOCK_BYTES,
        kv_offload_gib=64 * BLOCK_BYTES / 2**30,
        max_num_seqs=1,
    )
    prompts = [llm.get_tokenizer().encode(p) for p in LONG_PROMPTS]
    passes = []
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(8), use_tqdm=False)
        passes.append((outputs, llm.engine.stats()))
    return llm, prompts, passes


def test_engine_restores_evicted_prefixes_with_identical_tokens(served):
    """The second pass finds the prefixes the first evicted in the tier and gives the tokens the first pass
    computed from scratch."""
    llm, prompts, [(first, stats1), (again, stats2)] = served
    assert all(48 <= len(ids) <= 64 for ids in prompts)
    assert stats1["kv_offload_blocks"] == 64
    assert stats1["kv_offload_stored_blocks"] > 0 and stats1["kv_offload_restored_blocks"] == 0
    assert [out.outputs[0].token_ids for out in again] == [out.outputs[0].token_ids for out in first]
    assert stats2["kv_offload_restored_blocks"] >= 3
    assert stats2["kv_offload_hit_tokens"] == 16 * stats2["kv_offload_restored_blocks"]
    assert stats2["kv_offload_restore_seconds"] > 0
    assert sum(out.num_cached_tokens for out in again) >= stats2["kv_offload_hit_tokens"]
    assert_all_blocks_free(llm)
    assert llm.reset_prefix_cache() and llm.engine.stats()["kv_offload_used_blocks"] == 0


@pytest.mark.slow
def test_restored_prefixes_give_transformers_tokens(served):
    _, prompts, [(first, _), (again, _)] = served
    expected = _hf_greedy(prompts, 8)
    assert [out.outputs[0].token_ids for out in first] == expected
    assert [out.outputs[0].token_ids for out in again] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_restores_from_pinned_memory():
    """On a GPU, the `served` workload: the tier is pinned host memory, its copies run on the device's stream,
    and the tokens are those of an engine without it."""
    kwargs = {"dtype": "float32", "device": "cuda", "max_num_seqs": 1}
    kwargs["kv_cache_memory_bytes"] = 12 * BLOCK_BYTES
    plain = LLM(kv_offload_gib=0, **kwargs)
    prompts = [{"prompt_token_ids": plain.get_tokenizer().encode(p)} for p in LONG_PROMPTS] * 2
    reference = [out.outputs[0].token_ids for out in plain.generate(prompts, greedy(8), use_tqdm=False)]
    del plain
    llm = LLM(kv_offload_gib=64 * BLOCK_BYTES / 2**30, **kwargs)
    assert llm.engine.runner.offload_kv_cache.is_pinned()
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy(8), use_tqdm=False)]
    assert tokens == reference and llm.engine.stats()["kv_offload_restored_blocks"] >= 3
    assert_all_blocks_free(llm)


def test_metrics_show_the_tier_under_vllm_names():
    """/metrics sums the tier's counters over a model's replicas' heartbeats, under vLLM's names for an
    external prefix cache (and ours)."""
    pytest.importorskip("prometheus_client")
    from inference_engine.bus.protocol import ModelInfo, ReplicaInfo
    from llmserve.metrics import render

    stats = {"kv_offload_query_tokens": 96, "kv_offload_hit_tokens": 64, "kv_offload_restore_seconds": 0.25}
    replicas = [ReplicaInfo(f"r{i}", "m", {"stats": stats}) for i in range(2)]
    text = render([ModelInfo("m", replicas)]).decode()
    assert 'vllm:external_prefix_cache_queries_total{model_name="m"} 192.0' in text
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 128.0' in text
    assert 'llmserve_kv_offload_restore_seconds_total{model_name="m"} 0.5' in text
