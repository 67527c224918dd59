"""Tensor parallelism on this machine's CPU (gloo, one process per rank): fp32 greedy outputs equal the
unsharded engine's token for token, preemption included, with every rank's blocks freed; bad sizes get a
clear error; a rank that dies takes the engine down, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.random_llama import write_random_llama
from inference_engine import LLM
from inference_engine.distributed import cpu_share
from inference_engine.errors import InvalidRequestError
from inference_engine.tp_workers import TensorParallelError
from tests.thread_masks import thread_masks

from .conftest import PROMPTS, assert_all_blocks_free, greedy

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 16
NEAR_TIE = 1e-4


def _assert_same_greedy(llm: LLM, reference: LLM, prompts: list[str]) -> None:
    """Token for token, except where the unsharded engine's top-2 logits at the first difference lie
    within NEAR_TIE (fp32 sums in another order may then pick the other one)."""
    ours = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    theirs = reference.generate(prompts, greedy(MAX_TOKENS, logprobs=2), use_tqdm=False)
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        got, want = a.outputs[0].token_ids, b.outputs[0].token_ids
        if got == want:
            continue
        step = next(i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y)
        top2 = sorted((lp.logprob for lp in b.outputs[0].logprobs[step].values()), reverse=True)[:2]
        assert top2[0] - top2[1] < NEAR_TIE, (prompt, step, got, want, top2)


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    """8 query heads and 2 KV heads (splits in two), random weights, 4 layers to keep the test quick."""
    return str(write_random_llama(tmp_path_factory.mktemp("tp-model"), layers=4, seed=3))


def test_bundled_model_at_size_three_equals_unsharded(llm):
    sharded = LLM(dtype="float32", tensor_parallel_size=3, seed=0)
    try:
        _assert_same_greedy(sharded, llm, PROMPTS[:8])
        assert_all_blocks_free(sharded)
    finally:
        sharded.engine.shutdown()


def test_preemption_under_tensor_parallelism(llm):
    # Per rank a block holds 2 x 30 layers x 16 tokens x 1 KV head x 64 x 4 bytes; 24 of them cannot hold
    # 16 sequences of ~60 tokens, so sequences are preempted and recomputed.
    block = 2 * 30 * 16 * 64 * 4
    sharded = LLM(dtype="float32", tensor_parallel_size=3, kv_cache_memory_bytes=24 * block)
    try:
        assert sharded.engine.block_manager.num_blocks == 24
        _assert_same_greedy(sharded, llm, PROMPTS)
        assert sharded.engine.scheduler.num_preemptions > 0
        assert_all_blocks_free(sharded)
    finally:
        sharded.engine.shutdown()


def test_size_two_splits_a_model_with_even_heads(split_model):
    whole = LLM(model=split_model, dtype="float32")
    sharded = LLM(model=split_model, dtype="float32", tensor_parallel_size=2)
    try:
        assert sharded.engine.runner.model.model.layers[0].self_attn.num_kv_heads == 1
        _assert_same_greedy(sharded, whole, PROMPTS[:6])
        assert_all_blocks_free(sharded)
    finally:
        sharded.engine.shutdown()


def test_the_callers_thread_is_left_as_it_was(split_model):
    """Rank 0 runs on the engine loop's thread, on its share of the cores; the thread that built it keeps its
    own, and what it starts later is not crowded onto rank 0's cores."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    torch.ones(1 << 20).sum()  # the caller's OpenMP team exists before the engine
    before = thread_masks()
    sharded = LLM(model=split_model, dtype="float32", tensor_parallel_size=2)
    try:
        assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
        after = thread_masks()  # the caller's team too, not only the caller
        assert all(after[tid] == mask for tid, mask in before.items() if tid in after), (before, after)
        loop = sharded.engine_loop
        assert loop.call(lambda: len(os.sched_getaffinity(0))).result() == len(cpu_share(0, 2))
        assert sharded.generate(["Hello"], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
        assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
    finally:
        sharded.engine.shutdown()


def test_an_unguarded_script_runs_sharded(split_model, tmp_path):
    """A script that builds the engine at top level, with no `if __name__ == "__main__":` guard: the ranks'
    processes do not import it again (they would build an engine of their own, and never join the group)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import json, sys\n"
        "from inference_engine import LLM, SamplingParams\n"
        f"llm = LLM(model={split_model!r}, dtype='float32', tensor_parallel_size=2)\n"
        f"params = SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS})\n"
        f"outputs = llm.generate({PROMPTS[:4]!r}, params, use_tqdm=False)\n"
        "print(json.dumps([o.outputs[0].token_ids for o in outputs]))\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    whole = LLM(model=split_model, dtype="float32")
    want = whole.generate(PROMPTS[:4], greedy(MAX_TOKENS), use_tqdm=False)
    assert json.loads(run.stdout.splitlines()[-1]) == [o.outputs[0].token_ids for o in want]


def test_a_rank_that_cannot_start_fails_the_engine_at_once(split_model, monkeypatch):
    """Not after the group's two-minute rendezvous timeout: the error names the rank and what to check."""
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the ranks' interpreter exits at once
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="tp-rank-1 exited with code 1 before it started"):
        LLM(model=split_model, dtype="float32", tensor_parallel_size=2)
    assert time.monotonic() - start < 30


def test_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(InvalidRequestError, match="9 attention heads"):
        LLM(dtype="float32", tensor_parallel_size=2)


def test_a_dead_rank_stops_the_engine(split_model):
    sharded = LLM(model=split_model, dtype="float32", tensor_parallel_size=2)
    worker = sharded.engine.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while sharded.engine.workers.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "died" in sharded.engine.workers.failure
    with pytest.raises(TensorParallelError):
        sharded.generate(["Hello"], greedy(4), use_tqdm=False)
    assert worker.poll() is not None


def test_swap_samples_logprobs_and_abort_under_tensor_parallelism(split_model):
    """Swapped-out KV on every rank, n > 1 samples sharing blocks, logprobs and an abort mid-generation."""
    from inference_engine import SamplingParams

    # One rank's block: 2 x 4 layers x 16 tokens x 1 KV head x 72 x 4 bytes; too few for 8 sequences at once.
    block = 2 * 4 * 16 * 72 * 4
    kwargs = {"dtype": "float32", "kv_cache_memory_bytes": 12 * block, "swap_space": 40 * block / 2**30}
    whole = LLM(model=split_model, **kwargs)
    sharded = LLM(model=split_model, tensor_parallel_size=2, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, n=2, logprobs=2, ignore_eos=True)
        want = whole.generate(PROMPTS[:4], params, use_tqdm=False)
        got = sharded.generate(PROMPTS[:4], params, use_tqdm=False)
        for a, b in zip(got, want, strict=True):
            assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for t in x)
        assert sharded.llm_engine.scheduler.num_preemptions > 0
        engine = sharded.llm_engine
        engine.add_request("gone", PROMPTS[0], greedy(64))
        for _ in range(3):
            engine.step()
        engine.abort_request("gone")
        assert_all_blocks_free(sharded)
    finally:
        sharded.llm_engine.shutdown()
