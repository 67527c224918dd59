"""`LLM` from many threads at once: the seeds' task-queue example (001, section 7.2), interrupted calls,
a failing engine step, and a stress run with random aborts. Calls share one engine loop and batch."""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.errors import InvalidRequestError

from .conftest import PROMPTS, assert_all_blocks_free, greedy

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lone_outputs(llm: LLM) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from a call of its own, with nothing else running."""
    return {p: llm.generate([p], greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}


@pytest.fixture
def batch_sizes(llm: LLM, monkeypatch) -> list[int]:
    """The number of sequences the engine ran in each step (recorded around the engine's own step)."""
    engine, sizes = llm.llm_engine, []
    step = engine.step

    def recording_step():
        sizes.append(len(engine.scheduler.running))
        return step()

    monkeypatch.setattr(engine, "step", recording_step)
    return sizes


@pytest.mark.parametrize("max_workers", [2, 4, 8])
def test_seed_task_queue_example(llm: LLM, lone_outputs, batch_sizes, max_workers: int) -> None:
    sampling_params = greedy(MAX_TOKENS)

    def process_single_prompt(prompt):  # as in the seeds, but returning the whole output
        return llm.generate([prompt], sampling_params, use_tqdm=False)[0]

    with ThreadPoolExecutor(max_workers=max_workers) as executor:
        results = list(executor.map(process_single_prompt, PROMPTS))
    assert [r.prompt for r in results] == PROMPTS  # every call got its own output
    assert len({r.request_id for r in results}) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.finished and result.outputs[0].token_ids == lone_outputs[prompt], prompt
    assert max(batch_sizes) > 1  # the calls joined one batch rather than taking turns
    assert_all_blocks_free(llm)


def test_keyboard_interrupt_aborts_the_call(llm: LLM) -> None:
    # Python's own Ctrl-C handler, even where the suite was started in the background (SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_call(llm)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_call(llm: LLM) -> None:
    main = threading.main_thread().ident
    tokens_before = llm.llm_engine.generation_tokens_total

    def interrupt_once_generating():
        deadline = time.monotonic() + 60
        while llm.llm_engine.generation_tokens_total < tokens_before + 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_generating)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
    interrupter.join()
    assert llm.llm_engine.generation_tokens_total < tokens_before + 2000
    assert_all_blocks_free(llm)


def test_a_failing_step_fails_every_call_in_flight_and_leaves_nothing_behind(llm: LLM, monkeypatch) -> None:
    runner, calls = llm.llm_engine.runner, []
    execute = runner.execute

    def failing_on_the_fifth_step(sched):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("device lost")
        return execute(sched)

    monkeypatch.setattr(runner, "execute", failing_on_the_fifth_step)
    long = SamplingParams(max_tokens=64, ignore_eos=True)
    with ThreadPoolExecutor(3) as executor:
        futures = [executor.submit(llm.generate, [p], long, use_tqdm=False) for p in PROMPTS[:3]]
        errors = [f.exception(timeout=120) for f in futures]
    assert all(isinstance(e, RuntimeError) and "device lost" in str(e) for e in errors), errors
    assert_all_blocks_free(llm)
    assert llm.generate(["Hi"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids  # it still serves


class AbortingBar:
    """A progress bar (vLLM's use_tqdm takes a callable that makes one) that raises after `budget` updates,
    as a user's callback might: the call must abort whatever of its requests are still running."""

    def __init__(self, budget: int, **kwargs) -> None:
        self.budget = budget

    def __enter__(self) -> AbortingBar:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def update(self, n: int = 1) -> None:
        if self.budget == 0:
            raise AbortedByCallback
        self.budget -= n


class AbortedByCallback(Exception):
    pass


def test_an_exception_in_a_callback_aborts_only_that_calls_requests(llm: LLM, lone_outputs) -> None:
    other = {}
    worker = threading.Thread(
        target=lambda: other.update(out=llm.generate(PROMPTS[:4], greedy(MAX_TOKENS), use_tqdm=False))
    )
    worker.start()
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with pytest.raises(AbortedByCallback):
        llm.generate(["Hi", PROMPTS[2]], [greedy(1), long], use_tqdm=partial(AbortingBar, 0))
    worker.join()
    assert [o.outputs[0].token_ids for o in other["out"]] == [lone_outputs[p] for p in PROMPTS[:4]]
    assert_all_blocks_free(llm)


def test_stress_many_threads_with_random_aborts(llm: LLM, lone_outputs) -> None:
    """200 calls from 16 threads: 1-3 short prompts each and a few tokens; some refused, some aborted
    by their callback after a random number of finished prompts. Whatever happens, nothing is left behind."""
    short_prompts = [p for p in PROMPTS if len(llm.get_tokenizer().encode(p)) <= 12]
    rng = random.Random(0)
    plans = []
    for _ in range(200):
        prompts = rng.sample(short_prompts, rng.randint(1, 3))
        abort_after = rng.randrange(len(prompts)) if rng.random() < 0.3 else None
        plans.append((prompts, rng.randint(1, 6), abort_after, rng.random() < 0.05))

    def call(plan) -> str:
        prompts, max_tokens, abort_after, invalid = plan
        params = [greedy(max_tokens) for _ in prompts]
        if invalid:  # more tokens than the context holds: refused before any of the call's requests runs
            params[-1] = SamplingParams(max_tokens=10**6)
        bar = partial(AbortingBar, abort_after) if abort_after is not None else False
        try:
            outputs = llm.generate(prompts, params, use_tqdm=bar)
        except AbortedByCallback:
            return "aborted"
        except InvalidRequestError:
            return "invalid"
        assert [o.prompt for o in outputs] == prompts
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == lone_outputs[prompt][:max_tokens]
        return "done"

    with ThreadPoolExecutor(16) as executor:
        results = list(executor.map(call, plans))
    assert results.count("invalid") == sum(plan[3] for plan in plans)
    assert results.count("aborted") == sum(plan[2] is not None and not plan[3] for plan in plans)
    assert llm.engine_loop.num_requests == 0
    assert_all_blocks_free(llm)
