"""The CUDA-graph path's bookkeeping, run eagerly on the CPU (graph capture and replay need a GPU): decode
steps padded to a captured batch size over static buffers give the same tokens, padding rows touch only
the reserved pad block, larger or non-decode steps run as before."""

from __future__ import annotations

import pytest

from inference_engine import LLM
from inference_engine.cuda_graphs import GraphRunner, batch_sizes
from inference_engine.cuda_runner import CUDARunner

from .conftest import PROMPTS, assert_all_blocks_free, greedy


def test_captured_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.fixture
def graphed(monkeypatch):
    """An engine whose decode steps go through a GraphRunner in eager mode, as `CUDARunner` runs them, and
    the sizes it ran."""
    llm = LLM(dtype="float32", max_num_seqs=6, kv_cache_memory_bytes=64 * 2**20)
    runner, bm = llm.llm_engine.runner, llm.llm_engine.block_manager
    pad_block = bm._take()  # reserved, as the runner reserves one beyond the manager's blocks on CUDA
    graphs = GraphRunner(
        runner.model,
        6,
        runner.inputs.block_tables.table.shape[1],
        pad_block,
        runner.block_size,
        num_splits=lambda batch: None,
        device=runner.device,
        capture=False,
    )
    sizes = []
    run = graphs.run

    def observed(step, size):
        sizes.append((len(step.meta.query_lens), size))
        return run(step, size)

    monkeypatch.setattr(graphs, "run", observed)
    runner.graphs = graphs
    monkeypatch.setattr(runner, "_forward", CUDARunner._forward.__get__(runner))
    yield llm, sizes, pad_block
    bm.ref_counts[pad_block] = 0
    bm.free[pad_block] = None


def test_padded_decode_steps_give_the_same_tokens(llm, graphed):
    engine, sizes, pad_block = graphed
    prompts = PROMPTS[:5]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy(), use_tqdm=False)]
    assert got == expected
    assert (5, 6) in sizes  # five sequences ran padded to six
    assert all(size in batch_sizes(6) and size >= batch for batch, size in sizes)
    runner = engine.llm_engine.runner
    assert (runner.kv_cache[:, :, pad_block, 1:] == 0).all()  # padding wrote only the block's first slot
    engine.llm_engine.block_manager.ref_counts[pad_block] = 0
    engine.llm_engine.block_manager.free[pad_block] = None
    assert_all_blocks_free(engine)


def test_steps_beyond_the_captured_sizes_run_eagerly(graphed):
    engine, sizes, _ = graphed
    outputs = engine.generate(PROMPTS[:7], greedy(4), use_tqdm=False)  # 7 > max_num_seqs: 6 run at once
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert sizes and max(batch for batch, _ in sizes) <= 6
