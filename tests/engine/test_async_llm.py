"""`AsyncLLM`: concurrent streams in one event loop, over the same engine loop as the session's `LLM`."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from inference_engine import LLM, AsyncLLM, SamplingParams
from inference_engine.errors import InvalidRequestError

from .conftest import PROMPTS, assert_all_blocks_free, greedy

MAX_TOKENS = 8


@pytest.fixture
def engine(llm: LLM) -> AsyncLLM:
    return AsyncLLM.from_llm(llm)


async def _collect(engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


@pytest.mark.asyncio
async def test_concurrent_streams_equal_offline_greedy_outputs(engine: AsyncLLM, llm: LLM) -> None:
    prompts = PROMPTS * 2  # 32 streams
    offline = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    streams = await asyncio.gather(
        *(_collect(engine, p, greedy(MAX_TOKENS), f"stream-{i}") for i, p in enumerate(prompts))
    )
    for i, (stream, expected) in enumerate(zip(streams, offline, strict=True)):
        assert all(out.request_id == f"stream-{i}" for out in stream)
        assert [out.finished for out in stream] == [False] * (len(stream) - 1) + [True]
        tokens = [out.outputs[0].token_ids for out in stream]
        assert all(a == b[: len(a)] for a, b in itertools.pairwise(tokens))  # cumulative
        assert tokens[-1] == expected.outputs[0].token_ids
        assert stream[-1].outputs[0].text == expected.outputs[0].text
    assert_all_blocks_free(llm)


@pytest.mark.asyncio
async def test_cancelling_a_task_aborts_its_request_within_one_step(
    engine: AsyncLLM, llm: LLM, monkeypatch
) -> None:
    core, steps = llm.llm_engine, []
    step = core.step
    monkeypatch.setattr(core, "step", lambda: steps.append(1) or step())
    first_output = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=2000, ignore_eos=True), "c"):
            first_output.set()

    task = asyncio.create_task(consume())
    await first_output.wait()
    task.cancel()
    steps_at_cancel = len(steps)
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(2000):
        if "c" not in core.groups:
            break
        await asyncio.sleep(0.002)
    assert "c" not in core.groups
    assert len(steps) - steps_at_cancel <= 1  # the step already running when the task was cancelled
    assert_all_blocks_free(llm)


@pytest.mark.asyncio
async def test_abort_ends_the_stream_with_an_abort_output(engine: AsyncLLM, llm: LLM) -> None:
    outputs = []

    async def consume() -> None:
        async for out in engine.generate(PROMPTS[2], SamplingParams(max_tokens=2000, ignore_eos=True), "a"):
            outputs.append(out)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.005)
    await engine.abort("a")
    await asyncio.wait_for(task, 60)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert 0 < len(outputs[-1].outputs[0].token_ids) < 2000
    assert_all_blocks_free(llm)


@pytest.mark.asyncio
async def test_refused_requests_raise_and_leave_other_streams_alone(engine: AsyncLLM, llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        await _collect(engine, PROMPTS[0], SamplingParams(max_tokens=10**6), "too-long")
    params = greedy(MAX_TOKENS, ignore_eos=True)
    running = asyncio.create_task(_collect(engine, PROMPTS[1], params, "same-id"))
    await asyncio.sleep(0)
    while "same-id" not in llm.llm_engine.groups and not running.done():
        await asyncio.sleep(0.002)
    with pytest.raises(InvalidRequestError, match="already running"):
        await _collect(engine, PROMPTS[2], greedy(MAX_TOKENS), "same-id")
    stream = await running  # the refused duplicate did not abort the stream that owns the id
    expected = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert stream[-1].finished and stream[-1].outputs[0].token_ids == expected
    assert_all_blocks_free(llm)
