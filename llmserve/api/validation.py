"""Validating requests that carry an output constraint, off the event loop and within budgets.

Checking a constraint means compiling it with llguidance (`structured_outputs.grammars.check`): within the
size limits that module sets, up to tens of milliseconds of CPU during which an event loop would serve no
other request or socket. So a request that names a constraint is validated in a small thread pool shared by
the process (``GRAMMAR_WORKERS`` threads), and within two budgets:

- per request, ``GRAMMAR_TIMEOUT`` seconds: a validation still running then is answered with a 400 (its
  thread finishes in the background and keeps its key's slot until it does);
- per API key (or other caller identity), ``GRAMMAR_PER_KEY`` validations at once and
  ``GRAMMAR_SECONDS_PER_MINUTE`` seconds of validation a minute in this process: past either, a 429 with
  ``Retry-After``. One client sending costly schemas then waits on itself, not in front of everyone else.

Requests without a constraint are validated inline: pydantic alone takes microseconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from llmserve import conf
from llmserve.api.errors import BadRequest, TooManyRequests
from llmserve.api.schema import CONSTRAINT_FIELDS

T = TypeVar("T")

WINDOW = 60.0  # seconds of the per-key time budget

# Body fields that may name a constraint: chat / completions (OpenAI's and vLLM's), Responses' ``text``.
_CONSTRAINT_FIELDS = (*CONSTRAINT_FIELDS, "text")
_FREE_CHOICES = (None, "auto", "none")


def names_constraint(body: dict[str, Any]) -> bool:
    """Whether validating `body` may compile a grammar: a constraint field, or a required or named tool
    choice (its calls are held to the functions' schemas)."""
    if any(body.get(name) is not None for name in _CONSTRAINT_FIELDS):
        return True
    return body.get("tool_choice") not in _FREE_CHOICES or body.get("function_call") not in _FREE_CHOICES


@dataclass
class _KeyBudget:
    running: int = 0
    window: int = 0
    seconds: float = 0.0


class ConstraintPool:
    """The process's validation threads and each caller's share of them."""

    def __init__(self, workers: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmserve-grammar")
        self.workers = workers
        self._budgets: dict[str, _KeyBudget] = {}
        self._window = 0
        self._lock = threading.Lock()

    async def run(self, identity: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._admit(identity)
        future = asyncio.get_running_loop().run_in_executor(
            self.executor, self._timed, identity, fn, args, kwargs
        )
        timeout = conf.get("GRAMMAR_TIMEOUT")
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise BadRequest(
                f"The output constraint took longer than {timeout:g} s to check; simplify it.",
                code="constraint_too_complex",
            ) from None

    def _admit(self, identity: str) -> None:
        per_key, per_minute = conf.get("GRAMMAR_PER_KEY"), conf.get("GRAMMAR_SECONDS_PER_MINUTE")
        now = time.monotonic()
        window = int(now // WINDOW)
        with self._lock:
            if window != self._window:  # a new minute: forget the callers with nothing running
                self._budgets = {k: b for k, b in self._budgets.items() if b.running}
                self._window = window
            budget = self._budgets.setdefault(identity, _KeyBudget(window=window))
            if budget.window != window:
                budget.window, budget.seconds = window, 0.0
            if per_key and budget.running >= per_key:
                raise TooManyRequests(
                    f"At most {per_key} requests with an output constraint are checked at once per key.",
                    retry_after=1,
                )
            if per_minute and budget.seconds >= per_minute:
                raise TooManyRequests(
                    f"This key used its {per_minute:g} s a minute of output-constraint checking.",
                    retry_after=(window + 1) * WINDOW - now,
                )
            budget.running += 1

    def _timed(self, identity: str, fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> T:
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.monotonic() - started
            with self._lock:
                budget = self._budgets[identity]
                budget.running -= 1
                budget.seconds += spent


_pool: ConstraintPool | None = None
_pool_lock = threading.Lock()


def pool() -> ConstraintPool:
    """The process's pool, made on first use with ``GRAMMAR_WORKERS`` threads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ConstraintPool(int(conf.get("GRAMMAR_WORKERS")))
        return _pool


async def validated(
    identity: str, body: dict[str, Any], fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)``: in the pool, within `identity`'s budgets, when `body` names a constraint;
    inline otherwise."""
    if not names_constraint(body):
        return fn(*args, **kwargs)
    return await pool().run(identity, fn, *args, **kwargs)
