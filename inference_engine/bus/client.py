"""The one bus client every front end uses (REST views, WebSocket consumers, Celery tasks): sync and async.

`generate()` returns only once the engine has acknowledged the request (prompt token count) or refused it, so
engine-side errors (invalid parameters, prompt too long, unknown model, overloaded) raise the typed exceptions
of `inference_engine.errors` before any delta. Every wait is bounded: while waiting, the client checks
that some replica of the model is still alive and gives up with `EngineUnavailableError` when none is, or
when nothing arrives within the timeout. Leaving an iteration early, cancelling it, or calling `abort()`
aborts the request in the engine. No torch here: the web tier imports this.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis

from inference_engine.bus import protocol as P
from inference_engine.bus.redis_server import REDIS_URL_ENV
from inference_engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)
from inference_engine.outputs import CompletionOutput, Logprob
from inference_engine.sampling_params import SamplingParams

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class ClientSettings:
    prefix: str = P.DEFAULT_PREFIX
    ack_timeout: float = 60.0  # longest wait for the engine to pick a request up (it may be queued)
    stream_timeout: float = 60.0  # longest wait between two entries of a running request
    poll_interval: float = 1.0  # how often a waiting client re-checks that a replica is alive
    # Backlog (queued + in flight) per model beyond which submit raises overloaded: the interactive stream's
    # for interactive requests, both streams' together for low-priority ones (see `protocol`).
    max_queue: int = 1024
    id_ttl: int = 3600  # seconds a request id stays reserved


@dataclass
class GenerationResult:
    """A whole generation, accumulated from its deltas."""

    request_id: str
    prompt_tokens: int
    outputs: list[CompletionOutput]
    usage: P.Usage
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs


@dataclass
class Tokenized:
    token_ids: list[int]
    max_model_len: int | None
    token_strs: list[str | None] | None = None


def _tokenize_message(
    prompt: str | None, messages: list[dict] | None, add_special_tokens: bool, return_token_strs: bool
) -> dict[str, Any]:
    message = _request_message(P.TOKENIZE, uuid.uuid4().hex, prompt, messages)
    message.update(add_special_tokens=add_special_tokens, return_token_strs=return_token_strs)
    return message


def _tokenized(answer: dict[str, Any]) -> Tokenized:
    return Tokenized(answer["token_ids"], answer.get("max_model_len"), answer.get("token_strs"))


def _request_message(
    kind: str, request_id: str, prompt: str | list[int] | None, messages: list[dict] | None, **extra: Any
) -> dict[str, Any]:
    message: dict[str, Any] = {"type": kind, "id": request_id, **extra}
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages.")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} objects.")
        message["messages"] = messages
    elif isinstance(prompt, str):
        message["prompt"] = prompt
    else:
        message["prompt_token_ids"] = [int(t) for t in prompt]
    return message


def _params(params: SamplingParams | dict | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    return params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)


def _models_from(keys_rows: list[tuple[str, list[str | None]]]) -> list[P.ModelInfo]:
    models = []
    for name, (replica_ids, values) in keys_rows:
        replicas = [
            P.ReplicaInfo(rid, name, json.loads(v))
            for rid, v in zip(replica_ids, values, strict=True)
            if v is not None
        ]
        if replicas:
            models.append(P.ModelInfo(name, replicas))
    return models


class _Accumulator:
    """Turns decoded output entries into deltas and remembers enough to build a `GenerationResult`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_tokens: int | None = None
        self.finished = False
        self.outputs: dict[int, CompletionOutput] = {}
        self.usage: P.Usage | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.prompt_token_ids: list[int] | None = None

    def feed(self, message: dict[str, Any]) -> P.RequestDelta | None:
        kind = message["type"]
        if kind == P.ACK:
            if self.prompt_tokens is None:
                self.prompt_tokens = message["prompt_tokens"]
            return None
        if kind in (P.ERROR, P.RESULT):
            self.finished = True
            if kind == P.ERROR:
                P.raise_error(message)
            return None
        delta = P.delta_from_message(self.request_id, message)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_token_ids = delta.prompt_logprobs, delta.prompt_token_ids
        for d in delta.outputs:
            out = self.outputs.setdefault(d.index, CompletionOutput(d.index, "", []))
            out.text += d.text
            out.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                out.logprobs = (out.logprobs or []) + d.logprobs
            if d.finish_reason is not None:
                out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        if delta.finished:
            self.finished, self.usage = True, delta.usage
        return delta

    def result(self) -> GenerationResult:
        outputs = [self.outputs[i] for i in sorted(self.outputs)]
        return GenerationResult(
            self.request_id,
            self.prompt_tokens or 0,
            outputs,
            self.usage,
            self.prompt_logprobs,
            self.prompt_token_ids,
        )


class _Waiter:
    """Deadline bookkeeping shared by the sync and async read loops."""

    def __init__(self, timeout: float, model: str, request_id: str) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout, self.model, self.request_id = timeout, model, request_id

    def block_ms(self, poll: float) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise EngineUnavailableError(
                f"no answer from the engine for model {self.model!r} within {self.timeout:g}s "
                f"(request {self.request_id})."
            )
        return max(1, int(min(remaining, poll) * 1000))

    def dead(self) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"no live engine replica for model {self.model!r} (request {self.request_id})."
        )


def _request_streams(keys: P.Keys, model: str, priority: int) -> tuple[str, tuple[str, ...]]:
    """The stream a generation of `priority` goes to, and the streams whose backlog bounds its admission:
    interactive requests count only the interactive stream (a bulk backlog never refuses them), low-priority
    ones count both (bulk never grows the model's total backlog past `max_queue`). See `protocol`."""
    stream = keys.request_stream(model, priority)
    if stream == keys.requests(model):
        return stream, (stream,)
    return stream, (keys.requests(model), stream)


def _overloaded(model: str, backlog: int) -> EngineOverloadedError:
    return EngineOverloadedError(f"model {model!r} has {backlog} requests queued; retry later.")


def _forgotten(request_id: str) -> EngineUnavailableError:
    return EngineUnavailableError(f"Redis lost the state of request {request_id} (restarted or flushed?).")


def _lost(exc: Exception) -> EngineUnavailableError:
    return EngineUnavailableError(f"lost the connection to Redis: {exc}")


class _StreamState:
    """What the sync and async streams share: the request, its read position and the buffered entries."""

    def __init__(self, client: EngineClient | AsyncEngineClient, model: str, request_id: str) -> None:
        self.client, self.model, self.request_id = client, model, request_id
        self._acc = _Accumulator(request_id)
        self._buffer: deque[dict[str, Any]] = deque()
        self._last_id = "0-0"

    @property
    def prompt_tokens(self) -> int | None:
        return self._acc.prompt_tokens

    @property
    def finished(self) -> bool:
        return self._acc.finished

    def _take(self, reply: list | None) -> None:
        for entry_id, fields in reply[0][1] if reply else ():
            self._last_id = entry_id
            self._buffer.append(P.decode(fields))


# --------------------------------------------------------------------------------------------------- sync


class GenerationStream(_StreamState):
    """A submitted, acknowledged generation. Iterate it for `RequestDelta`s; use it as a context manager (or
    call `abort()`) to make sure an abandoned request is aborted in the engine."""

    def _next(self, timeout: float) -> dict[str, Any]:
        waiter = _Waiter(timeout, self.model, self.request_id)
        key = self.client.keys.output(self.request_id)
        try:
            while not self._buffer:
                block = waiter.block_ms(self.client.settings.poll_interval)
                reply = self.client.redis.xread({key: self._last_id}, count=256, block=block)
                self._take(reply)
                if not reply:
                    if not self.client.live_replicas(self.model):
                        raise waiter.dead()
                    if not self.client.request_known(self.request_id, started=self._last_id != "0-0"):
                        raise _forgotten(self.request_id)
        except redis.RedisError as exc:
            raise _lost(exc) from exc
        return self._buffer.popleft()

    def _wait_ack(self) -> None:
        try:
            while self._acc.prompt_tokens is None and not self._acc.finished:
                self._acc.feed(self._next(self.client.settings.ack_timeout))
        except BaseException:
            if not self._acc.finished:
                self.abort()
            raise

    def __iter__(self) -> Iterator[P.RequestDelta]:
        try:
            while not self._acc.finished:
                delta = self._acc.feed(self._next(self.client.settings.stream_timeout))
                if delta is not None:
                    yield delta
        finally:
            if not self._acc.finished:
                self.abort()

    def result(self) -> GenerationResult:
        """Consume the rest of the stream and return the whole generation."""
        for _ in self:
            pass
        return self._acc.result()

    def abort(self) -> None:
        if not self._acc.finished:
            self._acc.finished = True
            self.client.abort(self.model, self.request_id)

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class EngineClient:
    """Synchronous bus client (Celery tasks, management commands, scripts). Thread-safe: redis-py pools."""

    def __init__(
        self, redis_url: str | None = None, *, settings: ClientSettings | None = None, **overrides: Any
    ) -> None:
        self.settings = settings or ClientSettings(**overrides)
        self.keys = P.Keys(self.settings.prefix)
        url = redis_url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
        self.redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5
        )

    def close(self) -> None:
        self.redis.close()

    def generate(
        self,
        model: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | dict | None = None,
        *,
        messages: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> GenerationStream:
        """Submit a generation and wait for the engine's acknowledgement: typed errors come before any delta.

        `prompt` is text or token ids; `messages` (chat) is rendered with the engine's chat template.
        `priority`: lower runs earlier (interactive 0, bulk jobs e.g. 10).
        """
        request_id = request_id or uuid.uuid4().hex
        message = _request_message(
            P.GENERATE,
            request_id,
            prompt,
            messages,
            params=_params(params).to_dict(),
            priority=int(priority),
            arrival_time=time.time(),
        )
        stream = GenerationStream(self, model, request_id)
        self._submit(
            model,
            *_request_streams(self.keys, model, int(priority)),
            message,
            backlog_limit=self.settings.max_queue,
        )
        stream._wait_ack()
        return stream

    def tokenize(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        add_special_tokens: bool = True,
        return_token_strs: bool = False,
    ) -> Tokenized:
        message = _tokenize_message(prompt, messages, add_special_tokens, return_token_strs)
        return _tokenized(self._call(model, message))

    def tokenizer_info(self, model: str) -> dict[str, Any]:
        """The model's tokenizer facts (special tokens, chat template, context length)."""
        return self._call(model, {"type": P.TOKENIZER_INFO, "id": uuid.uuid4().hex})["info"]

    def detokenize(self, model: str, token_ids: list[int]) -> str:
        message = {"type": P.DETOKENIZE, "id": uuid.uuid4().hex, "token_ids": list(token_ids)}
        return self._call(model, message)["text"]

    def abort(self, model: str, request_id: str) -> None:
        """Abort a request wherever it is (queued or running); idempotent, unknown ids are harmless."""
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.abort(request_id), 1, ex=self.settings.id_ttl)
                pipe.xadd(
                    self.keys.aborts(model),
                    {"id": request_id},
                    maxlen=P.ABORT_STREAM_MAXLEN,
                    approximate=True,
                )
                pipe.execute()
        except redis.RedisError as exc:
            raise _lost(exc) from exc

    def request_known(self, request_id: str, started: bool) -> bool:
        """Whether Redis still holds the request (its id key, and its output stream once it has one); both
        vanish when Redis restarts without persistence, which the engine cannot tell the client about."""
        keys = [self.keys.request_id(request_id)] + ([self.keys.output(request_id)] if started else [])
        return self.redis.exists(*keys) == len(keys)

    def live_replicas(self, model: str) -> list[str]:
        replica_ids = sorted(self.redis.smembers(self.keys.replicas(model)))
        if not replica_ids:
            return []
        exists = self.redis.mget([self.keys.replica(r) for r in replica_ids])
        return [r for r, v in zip(replica_ids, exists, strict=True) if v is not None]

    def list_models(self) -> list[P.ModelInfo]:
        """Served models with at least one live replica, and their heartbeats."""
        try:
            rows = []
            for name in sorted(self.redis.smembers(self.keys.models)):
                replica_ids = sorted(self.redis.smembers(self.keys.replicas(name)))
                values = self.redis.mget([self.keys.replica(r) for r in replica_ids]) if replica_ids else []
                rows.append((name, (replica_ids, values)))
        except redis.RedisError as exc:
            raise _lost(exc) from exc
        return _models_from(rows)

    def load_model(
        self,
        name: str,
        model: str | None = None,
        *,
        engine_args: dict | None = None,
        supervisor: str = "default",
        timeout: float | None = None,
    ) -> None:
        """Ask a supervisor to start an engine serving `model` (path; None = bundled default) as `name`.
        With `timeout`, wait until a replica of it is live."""
        self._check_supervisor(supervisor)
        self.redis.xadd(
            self.keys.control(supervisor),
            P.encode({"type": P.LOAD, "name": name, "model": model, "engine_args": engine_args or {}}),
        )
        if timeout is not None:
            self._wait_for(lambda: bool(self.live_replicas(name)), timeout, f"model {name!r} to load")

    def unload_model(self, name: str, *, supervisor: str = "default", timeout: float | None = None) -> None:
        self._check_supervisor(supervisor)
        self.redis.xadd(self.keys.control(supervisor), P.encode({"type": P.UNLOAD, "name": name}))
        if timeout is not None:
            self._wait_for(lambda: not self.live_replicas(name), timeout, f"model {name!r} to unload")

    def _check_supervisor(self, supervisor: str) -> None:
        if not self.redis.exists(self.keys.supervisor(supervisor)):
            raise EngineUnavailableError(f"no live engine supervisor named {supervisor!r}.")

    def _wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"timed out after {timeout:g}s waiting for {what}.")
            time.sleep(0.1)

    def _submit(
        self,
        model: str,
        stream_key: str,
        counted: tuple[str, ...],
        message: dict[str, Any],
        backlog_limit: int | None,
    ) -> None:
        """Queue `message` on `stream_key`, refused as overloaded when the `counted` streams' backlog (their
        XLEN together) has reached `backlog_limit`."""
        request_id = message["id"]
        try:
            if not self.live_replicas(model):
                raise ModelNotFoundError(f"model {model!r} is not served by any live engine.")
            if backlog_limit is not None:
                with self.redis.pipeline(transaction=False) as pipe:
                    for key in counted:
                        pipe.xlen(key)
                    if sum(pipe.execute()) >= backlog_limit:
                        raise _overloaded(model, backlog_limit)
            if not self.redis.set(self.keys.request_id(request_id), model, nx=True, ex=self.settings.id_ttl):
                raise InvalidRequestError(f"duplicate request id {request_id!r}.")
            self.redis.xadd(stream_key, P.encode(message))
        except redis.RedisError as exc:
            raise _lost(exc) from exc

    def _call(self, model: str, message: dict[str, Any]) -> dict[str, Any]:
        """A one-answer request (tokenize / detokenize) on the model's utility stream."""
        self._submit(model, self.keys.utility(model), (), message, backlog_limit=None)
        stream = GenerationStream(self, model, message["id"])
        answer = stream._next(self.settings.ack_timeout)
        if answer["type"] == P.ERROR:
            P.raise_error(answer)
        return answer


# -------------------------------------------------------------------------------------------------- async


def _raise_if_cancelled() -> None:
    """redis-py can swallow a cancellation that lands while a blocking read times out (measured: about
    one cancel in five of a consumer streaming a long answer); the task still counts the request, so
    honour it here. Otherwise a client that went away would keep its engine request running."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class AsyncGenerationStream(_StreamState):
    """Async twin of `GenerationStream`. `async for` over it; cancelling the consuming task, leaving the loop
    (the generator is closed when collected) or `async with` exit abort an unfinished request."""

    async def _next(self, timeout: float) -> dict[str, Any]:
        waiter = _Waiter(timeout, self.model, self.request_id)
        key = self.client.keys.output(self.request_id)
        try:
            while not self._buffer:
                block = waiter.block_ms(self.client.settings.poll_interval)
                reply = await self.client.redis.xread({key: self._last_id}, count=256, block=block)
                _raise_if_cancelled()
                self._take(reply)
                if not reply:
                    if not await self.client.live_replicas(self.model):
                        raise waiter.dead()
                    if not await self.client.request_known(self.request_id, started=self._last_id != "0-0"):
                        raise _forgotten(self.request_id)
        except redis.RedisError as exc:
            raise _lost(exc) from exc
        return self._buffer.popleft()

    async def _wait_ack(self) -> None:
        try:
            while self._acc.prompt_tokens is None and not self._acc.finished:
                self._acc.feed(await self._next(self.client.settings.ack_timeout))
        except BaseException:
            if not self._acc.finished:
                await self._abort_shielded()
            raise

    async def __aiter__(self) -> AsyncIterator[P.RequestDelta]:
        try:
            while not self._acc.finished:
                delta = self._acc.feed(await self._next(self.client.settings.stream_timeout))
                if delta is not None:
                    yield delta
        finally:
            if not self._acc.finished:
                await self._abort_shielded()

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._acc.result()

    async def abort(self) -> None:
        if not self._acc.finished:
            self._acc.finished = True
            await self.client.abort(self.model, self.request_id)

    async def _abort_shielded(self) -> None:
        # The abort must reach Redis even when we got here because our task was cancelled.
        await asyncio.shield(self.abort())

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._abort_shielded()


class AsyncEngineClient:
    """asyncio bus client (Django async views, Channels consumers). Use one per event loop."""

    def __init__(
        self, redis_url: str | None = None, *, settings: ClientSettings | None = None, **overrides: Any
    ) -> None:
        self.settings = settings or ClientSettings(**overrides)
        self.keys = P.Keys(self.settings.prefix)
        url = redis_url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
        self.redis = aredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5
        )

    async def close(self) -> None:
        await self.redis.aclose()

    async def generate(
        self,
        model: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | dict | None = None,
        *,
        messages: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerationStream:
        """See `EngineClient.generate`."""
        request_id = request_id or uuid.uuid4().hex
        message = _request_message(
            P.GENERATE,
            request_id,
            prompt,
            messages,
            params=_params(params).to_dict(),
            priority=int(priority),
            arrival_time=time.time(),
        )
        stream = AsyncGenerationStream(self, model, request_id)
        await self._submit(
            model,
            *_request_streams(self.keys, model, int(priority)),
            message,
            backlog_limit=self.settings.max_queue,
        )
        await stream._wait_ack()
        return stream

    async def tokenize(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        add_special_tokens: bool = True,
        return_token_strs: bool = False,
    ) -> Tokenized:
        message = _tokenize_message(prompt, messages, add_special_tokens, return_token_strs)
        return _tokenized(await self._call(model, message))

    async def tokenizer_info(self, model: str) -> dict[str, Any]:
        return (await self._call(model, {"type": P.TOKENIZER_INFO, "id": uuid.uuid4().hex}))["info"]

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        message = {"type": P.DETOKENIZE, "id": uuid.uuid4().hex, "token_ids": list(token_ids)}
        return (await self._call(model, message))["text"]

    async def abort(self, model: str, request_id: str) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.abort(request_id), 1, ex=self.settings.id_ttl)
                pipe.xadd(
                    self.keys.aborts(model),
                    {"id": request_id},
                    maxlen=P.ABORT_STREAM_MAXLEN,
                    approximate=True,
                )
                await pipe.execute()
        except redis.RedisError as exc:
            raise _lost(exc) from exc

    async def request_known(self, request_id: str, started: bool) -> bool:
        keys = [self.keys.request_id(request_id)] + ([self.keys.output(request_id)] if started else [])
        return await self.redis.exists(*keys) == len(keys)

    async def live_replicas(self, model: str) -> list[str]:
        replica_ids = sorted(await self.redis.smembers(self.keys.replicas(model)))
        if not replica_ids:
            return []
        exists = await self.redis.mget([self.keys.replica(r) for r in replica_ids])
        return [r for r, v in zip(replica_ids, exists, strict=True) if v is not None]

    async def list_models(self) -> list[P.ModelInfo]:
        try:
            rows = []
            for name in sorted(await self.redis.smembers(self.keys.models)):
                replica_ids = sorted(await self.redis.smembers(self.keys.replicas(name)))
                keys = [self.keys.replica(r) for r in replica_ids]
                values = await self.redis.mget(keys) if keys else []
                rows.append((name, (replica_ids, values)))
        except redis.RedisError as exc:
            raise _lost(exc) from exc
        return _models_from(rows)

    async def _submit(
        self,
        model: str,
        stream_key: str,
        counted: tuple[str, ...],
        message: dict[str, Any],
        backlog_limit: int | None,
    ) -> None:
        request_id = message["id"]
        try:
            if not await self.live_replicas(model):
                raise ModelNotFoundError(f"model {model!r} is not served by any live engine.")
            if backlog_limit is not None:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key in counted:
                        pipe.xlen(key)
                    if sum(await pipe.execute()) >= backlog_limit:
                        raise _overloaded(model, backlog_limit)
            if not await self.redis.set(
                self.keys.request_id(request_id), model, nx=True, ex=self.settings.id_ttl
            ):
                raise InvalidRequestError(f"duplicate request id {request_id!r}.")
            await self.redis.xadd(stream_key, P.encode(message))
        except redis.RedisError as exc:
            raise _lost(exc) from exc

    async def _call(self, model: str, message: dict[str, Any]) -> dict[str, Any]:
        await self._submit(model, self.keys.utility(model), (), message, backlog_limit=None)
        answer = await AsyncGenerationStream(self, model, message["id"])._next(self.settings.ack_timeout)
        if answer["type"] == P.ERROR:
            P.raise_error(answer)
        return answer


__all__ = [
    "AsyncEngineClient",
    "AsyncGenerationStream",
    "ClientSettings",
    "EngineClient",
    "EngineError",
    "GenerationResult",
    "GenerationStream",
    "Tokenized",
]
