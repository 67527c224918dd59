"""One thread that owns an `LLMEngine` and steps it for every caller.

`LLMEngine` is single-threaded by design. Here callers never touch it: they queue commands (add requests,
abort them, any other engine call) that the loop thread runs between two steps, and every request's
outputs go to the sink its caller registered with it. So `LLM.generate` calls from any number of threads
and `AsyncLLM` streams from event loops all join one continuous batch, and an abort takes effect before
the next step. The thread runs only while requests are in flight: an idle engine holds no thread.

The engine is also built on a thread of its own, one that ends. OpenMP (libgomp, which torch and our native
kernels share) keeps a pool of workers for every thread that ran a parallel region; once the pooled threads
outnumber the cores, idle workers stop spinning and every parallel region waits for a futex wake. The
native decoder runs some 200 regions a step, so a loop thread beside the pool of the thread that built the
model decoded several times slower than with its own pool the only one. So no pool outlives the build, as
long as the callers' threads run no parallel torch work of their own. A thread about to run the model
spreads its new pool over the cores first (kernels/cpu/team.py): its first forward pass would otherwise run
with the pool's threads sharing one core.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from inference_engine.config import EngineConfig
from inference_engine.distributed import thread_placement_kept
from inference_engine.llm_engine import LLMEngine
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import RequestOutput
from inference_engine.sampling_params import SamplingParams
from llmserve_kernels.cpu.team import spread_team

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Receives each RequestOutput of its requests (the last one has finished=True), or the exception that
# ended them. It runs on the loop thread, so it must only hand the item over (to a queue, an event loop).
Sink = Callable[[RequestOutput | BaseException], None]


@dataclass
class Request:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None


def on_a_thread_that_ends(fn: Callable[[], T]) -> T:
    """`fn()` (its result, or its exception raised here) run on a new thread with this thread's torch thread
    count, so that the OpenMP pool it creates ends with it (see the module's docstring)."""
    threads, outcome = torch.get_num_threads(), []

    def run() -> None:
        torch.set_num_threads(threads)
        spread_team()
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="on-a-thread-that-ends")
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._threads = torch.get_num_threads()  # OpenMP's count is per thread: the creator's, for the loop
        self._lock = threading.Lock()
        self._commands: deque[Callable[[], None]] = deque()
        self._thread: threading.Thread | None = None
        self._sinks: dict[str, Sink] = {}  # requests in flight; touched only on the loop thread

    def add(self, requests: list[Request], sink: Sink) -> Future[None]:
        """Queues `requests`, all or none: the future fails with the engine's error if one is refused."""

        def add() -> None:
            added = []
            try:
                for r in requests:
                    self.engine.add_request(
                        r.request_id, r.prompt, r.params, priority=r.priority, lora_request=r.lora_request
                    )
                    self._sinks[r.request_id] = sink
                    added.append(r.request_id)
            except BaseException:
                self._drop(added, sink)
                raise

        return self.call(add)

    def abort(self, request_ids: Iterable[str], sink: Sink | None = None) -> Future[None]:
        """Drops requests and frees their KV blocks before the next step. With `sink`, only the requests
        registered to it (a caller withdrawing its own requests, whatever became of its `add`); without,
        any of them, and each one's sink receives its final output (finish_reason "abort")."""
        ids = list(request_ids)
        return self.call(lambda: self._drop(ids, sink))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Runs `fn` on the loop thread between two steps; its result or exception arrives in the future."""
        future: Future[T] = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        if threading.current_thread() is self._thread:  # from a sink: no step can be running
            command()
            return future
        with self._lock:
            self._commands.append(command)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)
                self._thread.start()
        return future

    @classmethod
    def build(cls, config: EngineConfig) -> EngineLoop:
        """The loop of a new engine, built on a thread that ends (see the module's docstring). Not with
        tensor parallelism: the ranks' processes die with the thread that started them (their parent-death
        signal), so that thread must live as long as the engine: the caller's. Rank 0 then takes its cores for
        the loop thread, which runs its steps, and leaves the caller's thread as it was."""
        if config.tensor_parallel_size > 1:
            with thread_placement_kept():
                engine = LLMEngine(config)
            return cls(engine)
        return cls(on_a_thread_that_ends(lambda: LLMEngine(config)))

    @property
    def num_requests(self) -> int:
        """Requests in flight through this loop."""
        return len(self._sinks)

    # --- the loop thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        if self.engine.runner.workers is not None:
            self.engine.runner.workers.take_cores()  # on a CPU, its team spread over rank 0's share
        else:
            spread_team()
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:  # the engine failed mid-step: fail every call in flight, keep serving
                logger.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
                failed, self._sinks = self._sinks, {}
                try:
                    self.engine.abort_request(list(failed))
                except Exception:
                    logger.exception("could not abort the failed requests")
                for sink in failed.values():
                    self._deliver(sink, exc)

    def _iterate(self) -> bool:
        with self._lock:
            commands, self._commands = self._commands, deque()
            if not commands and not self._sinks:
                self._thread = None
                return False
        for command in commands:
            command()
        if self._sinks:
            for output in self.engine.step():
                sink = self._sinks.get(output.request_id)
                if sink is None:
                    continue  # added to the engine directly, not through this loop
                if output.finished:
                    del self._sinks[output.request_id]
                self._deliver(sink, output)
            for request_id, error in self.engine.pop_refused().items():  # their grammar failed to compile
                sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    self._deliver(sink, error)
        return True

    def _drop(self, request_ids: list[str], owner: Sink | None) -> None:
        ids = [rid for rid in request_ids if rid in self._sinks and owner in (None, self._sinks[rid])]
        sinks = {rid: self._sinks.pop(rid) for rid in ids}
        for output in self.engine.abort_request(ids):
            if owner is None:
                self._deliver(sinks[output.request_id], output)

    def _deliver(self, sink: Sink, item: RequestOutput | BaseException) -> None:
        try:
            sink(item)
        except Exception:  # the consumer is gone (e.g. its event loop closed): nobody waits for these
            logger.exception("dropping the requests of a sink that failed")
            self._drop([rid for rid, s in self._sinks.items() if s is sink], sink)
