"""The one bus client every front end uses (REST views, WebSocket consumers, Celery tasks): sync and async.

`generate()` returns only once the engine has acknowledged the request (prompt token count) or refused it, so
engine-side errors (invalid parameters, prompt too long, unknown model, overloaded) raise the typed exceptions
of `inference_engine.errors` before any delta. Every wait is bounded: while waiting, the client checks
that some replica of the model is still alive and gives up with `EngineUnavailableError` when none is, or
when nothing arrives within the timeout. Leaving an iteration early, cancelling it, or calling `abort()`
aborts the request in the engine. No torch here: the web tier imports this.

Every client is the owner of the generations it submits: it keeps a liveness key on the bus (``SET`` with
`owner_ttl` when it submits, refreshed every `owner_beat` seconds while it has requests in flight), and the
engine aborts the running requests whose owner's key lapsed. So the requests of a web worker or Celery
process that died (SIGKILL, out of memory) stop within seconds instead of generating to the end for nobody.

Every operation is written once, in `_Core`, as a generator that yields the Redis commands of each round trip
and receives their results; `EngineClient` runs them with redis-py's blocking client, `AsyncEngineClient`
with its asyncio client. Both use a bounded connection pool that makes a request wait (up to
`pool_timeout`) for a free connection rather than fail. The async client reads the output streams of all its
requests through one `XREAD` (`_OutputReader`), so requests queued behind a busy engine wait on an asyncio
queue, not on a Redis connection each: a thousand waiting clients cost one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from inference_engine.bus import protocol as P
from inference_engine.bus.redis_server import REDIS_URL_ENV
from inference_engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestAbortedError,
)
from inference_engine.outputs import CompletionOutput, Logprob
from inference_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LIVE_CACHE_SECONDS = 0.5
T = TypeVar("T")


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
    max_connections: int = 32  # Redis connections of one client, shared by all its requests
    pool_timeout: float = 30.0  # longest wait for a free connection before a call fails as overloaded
    # The client's liveness key (see the module docstring): refreshed every `owner_beat` seconds while it has
    # requests in flight; the engine aborts them once it has been silent `owner_ttl` seconds.
    owner_beat: float = 1.0
    owner_ttl: float = 5.0


@dataclass
class GenerationResult:
    """A whole generation, accumulated from its deltas."""

    request_id: str
    prompt_tokens: int
    outputs: list[CompletionOutput]
    usage: P.Usage
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs
    tool_parser: str | None = None  # the format of the model's tool calls, for requests with tools
    reasoning_parser: str | None = None  # the format of the model's reasoning block, for chat requests


@dataclass
class Tokenized:
    token_ids: list[int]
    max_model_len: int | None
    token_strs: list[str | None] | None = None


def _tokenize_message(
    prompt: str | None, messages: list[dict] | None, add_special_tokens: bool, return_token_strs: bool
) -> P.Tokenize:
    fields = _prompt_fields(prompt, messages)
    return P.Tokenize(
        uuid.uuid4().hex, **fields, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs
    )


def _tokenized(answer: P.Result) -> Tokenized:
    return Tokenized(answer.token_ids, answer.max_model_len, answer.token_strs)


# ------------------------------------------------------------------------------------ the shared core

Command = tuple[str, tuple[Any, ...], dict[str, Any]]  # a redis-py method name and its arguments
Op = Generator[list[Command], list[Any], T]  # yields each round trip's commands, receives their results


def _cmd(name: str, *args: Any, **kwargs: Any) -> Command:
    return (name, args, kwargs)


# Admission in one atomic step, so concurrent submits never overshoot the backlog bound: refuse when the
# counted streams' backlog has reached the limit, refuse a reused request id, else mark the owner alive and
# queue the entry.
# KEYS: request-id key, target stream, owner key, counted streams...
# ARGV: limit (-1: none), model, id ttl, entry, owner ttl (ms).
_ADMIT = f"""
local limit = tonumber(ARGV[1])
if limit >= 0 then
  local backlog = 0
  for i = 4, #KEYS do backlog = backlog + redis.call('XLEN', KEYS[i]) end
  if backlog >= limit then return 'overloaded' end
end
if not redis.call('SET', KEYS[1], ARGV[2], 'NX', 'EX', ARGV[3]) then return 'duplicate' end
redis.call('SET', KEYS[3], 1, 'PX', ARGV[5])
redis.call('XADD', KEYS[2], '*', '{P.FIELD}', ARGV[4])
return 'ok'
"""


# One slot of a bounded set (the WebSocket connections of one API key): members expire unless renewed, so a
# dead process's slots free themselves. KEYS: the set (a sorted set, score = expiry).
# ARGV: now (ms), ttl (ms), limit, member. Returns 1 when the member holds a slot, 0 when the set is full.
_HOLD = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[4]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class _Core:
    """The bus operations, free of I/O: each yields the commands of one round trip at a time."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self.keys = P.Keys(settings.prefix)
        self._output_prefix = self.keys.output("")
        self._seen_live: dict[str, float] = {}  # model -> when a live replica of it was last seen
        self.owner_id = uuid.uuid4().hex
        self._owner_key = self.keys.owner(self.owner_id)

    def _owner_beat(self) -> Command:
        return _cmd("set", self._owner_key, 1, px=int(self.settings.owner_ttl * 1000))

    def beat(self) -> Op[None]:
        """Tell the engines this client is alive, so its requests keep running."""
        yield [self._owner_beat()]

    def adopt(self, request_id: str) -> Op[None]:
        """Make this client the owner of a request another client submitted (see `attach`)."""
        yield [
            self._owner_beat(),
            _cmd("set", self.keys.adopted(request_id), self.owner_id, ex=self.settings.id_ttl),
        ]

    def live_replicas(self, model: str) -> Op[list[str]]:
        (members,) = yield [_cmd("smembers", self.keys.replicas(model))]
        replica_ids = sorted(members)
        beats = (yield [_cmd("mget", [self.keys.replica(r) for r in replica_ids])])[0] if replica_ids else []
        live = [r for r, beat in zip(replica_ids, beats, strict=True) if beat is not None]
        if live:
            self._seen_live[model] = time.monotonic()
        else:
            self._seen_live.pop(model, None)
        return live

    def served(self, model: str) -> Op[bool]:
        """Whether a replica serves `model`, taking a sighting of the last `LIVE_CACHE_SECONDS` as a yes: a
        burst of submissions then costs one round trip each. (A replica that died since is noticed by the
        request's own wait, `check_waiting`, which always looks afresh.)"""
        if time.monotonic() - self._seen_live.get(model, -LIVE_CACHE_SECONDS) < LIVE_CACHE_SECONDS:
            return True
        return bool((yield from self.live_replicas(model)))

    def submit(
        self, model: str, message: P.Generate | P.Tokenize | P.Detokenize | P.TokenizerInfo
    ) -> Op[None]:
        """Queue a request: generations on the stream of their priority, bounded by `max_queue` (interactive
        ones count only the interactive stream, so a bulk backlog never refuses them; low-priority ones count
        both, so bulk never grows the total past the bound); tokenizer requests on the utility stream."""
        if isinstance(message, P.Generate):
            stream = self.keys.request_stream(model, message.priority)
            interactive = self.keys.requests(model)
            counted = (stream,) if stream == interactive else (interactive, stream)
            limit = self.settings.max_queue
        else:
            stream, counted, limit = self.keys.utility(model), (), -1
        if not (yield from self.served(model)):
            raise ModelNotFoundError(f"model {model!r} is not served by any live engine.")
        keys = (self.keys.request_id(message.id), stream, self._owner_key, *counted)
        entry = P.encode(message)[P.FIELD]
        owner_ttl = int(self.settings.owner_ttl * 1000)
        (verdict,) = yield [
            _cmd("eval", _ADMIT, len(keys), *keys, limit, model, self.settings.id_ttl, entry, owner_ttl)
        ]
        if verdict == "overloaded":
            raise EngineOverloadedError(f"model {model!r} has {limit} requests queued; retry later.")
        if verdict == "duplicate":
            raise InvalidRequestError(f"duplicate request id {message.id!r}.")

    def abort(self, model: str, request_id: str) -> Op[None]:
        yield [
            _cmd("set", self.keys.abort(request_id), 1, ex=self.settings.id_ttl),
            _cmd(
                "xadd",
                self.keys.aborts(model),
                {"id": request_id},
                maxlen=P.ABORT_STREAM_MAXLEN,
                approximate=True,
            ),
        ]

    def read(
        self,
        positions: dict[str, str],
        block_ms: int | None,
        wake: tuple[str, str] | None = None,
        beat: bool = False,
    ) -> Op[tuple[dict[str, list[tuple[str, P.Message]]], str | None]]:
        """New output entries of the requests in `positions` (request id -> last entry id seen). With `wake`
        (a stream, the last id seen there) a blocking read also ends when that stream gets an entry (see
        `wake`); the second item is then the newest id there. With `beat`, the same round trip refreshes the
        client's liveness key."""
        streams = {self.keys.output(rid): last for rid, last in positions.items()}
        woken = None
        if wake is not None:
            streams[wake[0]] = woken = wake[1]
        read = _cmd("xread", streams, count=256, block=block_ms)
        reply = (yield [self._owner_beat(), read] if beat else [read])[-1]
        found: dict[str, list[tuple[str, P.Message]]] = {}
        for key, entries in reply.items() if isinstance(reply, dict) else reply or ():
            if wake is not None and key == wake[0]:
                woken = entries[-1][0]
            else:
                found[key[len(self._output_prefix) :]] = [
                    (entry_id, P.parse(fields)) for entry_id, fields in entries
                ]
        return found, woken

    def wake(self, stream: str) -> Op[None]:
        """Ends a blocking `read` watching `stream` (or the next one: it reads from the last id it saw). The
        stream keeps one entry and expires soon after its client's last wake-up."""
        yield [_cmd("xadd", stream, {"w": "1"}, maxlen=1), _cmd("expire", stream, 60)]

    def count(self, name: str, ttl: int) -> Op[int]:
        """Add one to a counter that expires `ttl` seconds after its last count; the new value."""
        key = self.keys.counter(name)
        count, _ = yield [_cmd("incr", key), _cmd("expire", key, ttl)]
        return count

    def hold(self, name: str, member: str, limit: int, ttl: float) -> Op[bool]:
        """Take (or renew) `member`'s slot among at most `limit` under `name`, for `ttl` seconds; False when
        they are all taken."""
        key, now = self.keys.counter(f"slots:{name}"), int(time.time() * 1000)
        (held,) = yield [_cmd("eval", _HOLD, 1, key, now, int(ttl * 1000), limit, member)]
        return bool(held)

    def release(self, name: str, member: str) -> Op[None]:
        yield [_cmd("zrem", self.keys.counter(f"slots:{name}"), member)]

    def request_known(self, request_id: str, started: bool) -> Op[bool]:
        """Whether Redis still holds the request (its id key, and its output stream once it has one); both
        vanish when Redis restarts without persistence, which the engine cannot tell the client about."""
        keys = [self.keys.request_id(request_id)] + ([self.keys.output(request_id)] if started else [])
        (count,) = yield [_cmd("exists", *keys)]
        return count == len(keys)

    def check_attachable(self, request_id: str) -> Op[None]:
        """Raises when reading an earlier submitted request is pointless because it was aborted: an engine
        running it ends its output with an abort, but one that finds it aborted in the queue (or among a dead
        replica's requests) drops it without a word."""
        (aborted,) = yield [_cmd("exists", self.keys.abort(request_id))]
        if aborted:
            raise RequestAbortedError(f"request {request_id!r} was aborted.")

    def check_waiting(self, model: str, request_id: str, started: bool) -> Op[None]:
        """Raises when waiting longer for this request is pointless: no replica left, or Redis forgot it."""
        if not (yield from self.live_replicas(model)):
            raise EngineUnavailableError(f"no live engine replica for model {model!r}.")
        if not (yield from self.request_known(request_id, started)):
            raise EngineUnavailableError("the request bus lost the state of this request (Redis restarted?).")

    def list_models(self) -> Op[list[P.ModelInfo]]:
        """Served models with at least one live replica, and their heartbeats."""
        (names,) = yield [_cmd("smembers", self.keys.models)]
        names = sorted(names)
        if not names:
            return []
        members = yield [_cmd("smembers", self.keys.replicas(name)) for name in names]
        replica_ids = [sorted(m) for m in members]
        flat = [self.keys.replica(r) for ids in replica_ids for r in ids]
        beats = (yield [_cmd("mget", flat)])[0] if flat else []
        models, beats = [], iter(beats)
        for name, ids in zip(names, replica_ids, strict=True):
            replicas = [P.ReplicaInfo(r, name, json.loads(b)) for r in ids if (b := next(beats)) is not None]
            if replicas:
                models.append(P.ModelInfo(name, replicas))
        return models

    def control(self, supervisor: str, message: P.Load | P.Unload) -> Op[None]:
        (alive,) = yield [_cmd("exists", self.keys.supervisor(supervisor))]
        if not alive:
            raise EngineUnavailableError(f"no live engine supervisor named {supervisor!r}.")
        yield [_cmd("xadd", self.keys.control(supervisor), P.encode(message))]


def _prompt_fields(prompt: str | list[int] | None, messages: list[dict] | None) -> dict[str, Any]:
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages.")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} objects.")
        return {"messages": messages}
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": [int(t) for t in prompt]}


def _generate_message(
    prompt: str | list[int] | None,
    params: SamplingParams | dict | None,
    messages: list[dict] | None,
    request_id: str | None,
    priority: int,
    tools: list[dict] | None = None,
    owner: str | None = None,
) -> P.Generate:
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        params = SamplingParams.from_dict(params)
    return P.Generate(
        id=request_id or uuid.uuid4().hex,
        params=params.to_dict(),
        priority=int(priority),
        arrival_time=time.time(),
        tools=tools,
        owner=owner,
        **_prompt_fields(prompt, messages),
    )


def _answer(message: P.Message) -> P.Result:
    """The result of a tokenizer request."""
    if isinstance(message, P.Error):
        raise message.exception()
    assert isinstance(message, P.Result), message
    return message


def _bus_error(exc: redis.RedisError) -> EngineError:
    """A Redis failure as the engine error the front ends report; its details (addresses) go to the log."""
    if isinstance(exc, redis.ConnectionError) and "No connection available" in str(exc):
        return EngineOverloadedError("too many requests are waiting for the request bus; retry later.")
    log.warning("request bus error: %s", exc)
    return EngineUnavailableError("lost the connection to the request bus.")


def _pool_kwargs(settings: ClientSettings, retry: type[Retry] | type[AsyncRetry]) -> dict[str, Any]:
    return {
        "decode_responses": True,
        "max_connections": settings.max_connections,
        "timeout": settings.pool_timeout,
        "socket_timeout": 10,
        "socket_connect_timeout": 5,
        # A few quick reconnects, so a restarted Redis is found again without failing the call.
        "retry": retry(ExponentialBackoff(cap=0.2, base=0.02), retries=3),
        "retry_on_error": [redis.ConnectionError],
    }


class _Accumulator:
    """Turns output messages into deltas and remembers enough to build a `GenerationResult`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_tokens: int | None = None
        self.tool_parser: str | None = None
        self.reasoning_parser: str | None = None
        self.finished = False
        self.outputs: dict[int, CompletionOutput] = {}
        self.usage: P.Usage | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.prompt_token_ids: list[int] | None = None

    def feed(self, message: P.Message) -> P.RequestDelta | None:
        if isinstance(message, P.Ack):
            if self.prompt_tokens is None:  # a request re-run after a crash may be acknowledged twice
                self.prompt_tokens, self.tool_parser = message.prompt_tokens, message.tool_parser
                self.reasoning_parser = message.reasoning_parser
            return None
        if isinstance(message, P.Error | P.Result):
            self.finished = True
            if isinstance(message, P.Error):
                raise message.exception()
            return None
        assert isinstance(message, P.Delta | P.Final), message
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
            self.tool_parser,
            self.reasoning_parser,
        )


class _Waiter:
    """Deadline bookkeeping shared by the sync and async read loops."""

    def __init__(self, timeout: float, model: str) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout, self.model = timeout, model

    def block_s(self, poll: float) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise EngineUnavailableError(
                f"no answer from the engine for model {self.model!r} within {self.timeout:g}s."
            )
        return max(0.001, min(remaining, poll))


class _StreamState:
    """What the sync and async streams share: the request, its read position and the buffered entries."""

    def __init__(self, client: EngineClient | AsyncEngineClient, model: str, request_id: str) -> None:
        self.client, self.model, self.request_id = client, model, request_id
        self._acc = _Accumulator(request_id)
        self._buffer: deque[P.Message] = deque()
        self._last_id = "0-0"

    @property
    def prompt_tokens(self) -> int | None:
        return self._acc.prompt_tokens

    @property
    def tool_parser(self) -> str | None:
        """The format of the model's tool calls (`inference_engine.tool_parsers`), for requests with tools."""
        return self._acc.tool_parser

    @property
    def reasoning_parser(self) -> str | None:
        """The format of the model's reasoning block (`inference_engine.reasoning_parsers`), for chat requests
        to an engine that has one."""
        return self._acc.reasoning_parser

    @property
    def finished(self) -> bool:
        return self._acc.finished

    def _take(self, entries: list[tuple[str, P.Message]]) -> None:
        for entry_id, message in entries:
            self._last_id = entry_id
            self._buffer.append(message)

    def _check_waiting(self) -> Op[None]:
        return self.client._core.check_waiting(self.model, self.request_id, self._last_id != "0-0")


# --------------------------------------------------------------------------------------------------- sync


class GenerationStream(_StreamState):
    """A submitted, acknowledged generation. Iterate it for `RequestDelta`s; use it as a context manager (or
    call `abort()`) to make sure an abandoned request is aborted in the engine."""

    client: EngineClient

    def _next(self, timeout: float) -> P.Message:
        waiter = _Waiter(timeout, self.model)
        while not self._buffer:
            block = waiter.block_s(self.client.settings.poll_interval)
            found, _ = self.client._run(
                self.client._core.read({self.request_id: self._last_id}, int(block * 1000))
            )
            self._take(found.get(self.request_id, []))
            if not found:
                self.client._run(self._check_waiting())
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
        self._core = _Core(self.settings)
        self.keys = self._core.keys
        url = redis_url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
        pool = redis.BlockingConnectionPool.from_url(url, **_pool_kwargs(self.settings, Retry))
        self.redis = redis.Redis(connection_pool=pool)
        # The streams still running, for the thread that keeps the owner key alive while there are any: a
        # thread, since a caller may hold a stream unread for a while (a Celery task storing results).
        self._streams: weakref.WeakSet[GenerationStream] = weakref.WeakSet()
        self._closed = threading.Event()
        self._beater: threading.Thread | None = None
        self._beater_lock = threading.Lock()

    def close(self) -> None:
        self._closed.set()
        self.redis.close()
        self.redis.connection_pool.disconnect()

    def _owned(self, stream: GenerationStream) -> None:
        self._streams.add(stream)
        with self._beater_lock:
            if self._beater is None or not self._beater.is_alive():
                self._beater = threading.Thread(target=self._beat, name="llmserve-owner", daemon=True)
                self._beater.start()

    def _beat(self) -> None:
        while not self._closed.wait(self.settings.owner_beat):
            if not any(not stream.finished for stream in list(self._streams)):
                continue
            try:
                self._run(self._core.beat())
            except EngineError as exc:  # Redis is gone: the streams' own reads report it
                log.debug("owner beat failed: %s", exc)

    def _run(self, op: Op[T]) -> T:
        """Runs one operation of the core: each round trip as one command or one pipeline."""
        try:
            commands = next(op)
            while True:
                if len(commands) == 1:
                    name, args, kwargs = commands[0]
                    results = [getattr(self.redis, name)(*args, **kwargs)]
                else:
                    with self.redis.pipeline(transaction=False) as pipe:
                        for name, args, kwargs in commands:
                            getattr(pipe, name)(*args, **kwargs)
                        results = pipe.execute()
                commands = op.send(results)
        except StopIteration as done:
            return done.value
        except redis.RedisError as exc:
            raise _bus_error(exc) from exc

    def generate(
        self,
        model: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | dict | None = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        chat_options: dict | None = None,
    ) -> GenerationStream:
        """Submit a generation and wait for the engine's acknowledgement: typed errors come before any delta.

        `prompt` is text or token ids; `messages` (chat) is rendered with the engine's chat template, with
        `tools` (OpenAI's function tools) where given, and `chat_options` (`Tokenizer.apply_chat_template`'s
        add_generation_prompt, continue_final_message, chat_template_kwargs). `priority`: lower runs earlier
        (interactive 0, bulk jobs e.g. 10).
        """
        message = _generate_message(
            prompt, params, messages, request_id, priority, tools, self._core.owner_id
        )
        message.chat_options = chat_options
        self._run(self._core.submit(model, message))
        stream = GenerationStream(self, model, message.id)
        self._owned(stream)
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
        return self._call(model, P.TokenizerInfo(uuid.uuid4().hex)).info

    def detokenize(self, model: str, token_ids: list[int]) -> str:
        return self._call(model, P.Detokenize(uuid.uuid4().hex, list(token_ids))).text

    def abort(self, model: str, request_id: str) -> None:
        """Abort a request wherever it is (queued or running); idempotent, unknown ids are harmless."""
        self._run(self._core.abort(model, request_id))

    def request_known(self, request_id: str, started: bool) -> bool:
        return self._run(self._core.request_known(request_id, started))

    def live_replicas(self, model: str) -> list[str]:
        return self._run(self._core.live_replicas(model))

    def list_models(self) -> list[P.ModelInfo]:
        """Served models with at least one live replica, and their heartbeats."""
        return self._run(self._core.list_models())

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
        self._run(self._core.control(supervisor, P.Load(name, model, engine_args or {})))
        if timeout is not None:
            self._wait_for(lambda: bool(self.live_replicas(name)), timeout, f"model {name!r} to load")

    def unload_model(self, name: str, *, supervisor: str = "default", timeout: float | None = None) -> None:
        self._run(self._core.control(supervisor, P.Unload(name)))
        if timeout is not None:
            self._wait_for(lambda: not self.live_replicas(name), timeout, f"model {name!r} to unload")

    def _wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"timed out after {timeout:g}s waiting for {what}.")
            time.sleep(0.1)

    def _call(self, model: str, message: P.Tokenize | P.Detokenize | P.TokenizerInfo) -> P.Result:
        """A one-answer request (tokenize / detokenize) on the model's utility stream."""
        self._run(self._core.submit(model, message))
        return _answer(GenerationStream(self, model, message.id)._next(self.settings.ack_timeout))


# -------------------------------------------------------------------------------------------------- async


@dataclass
class _Subscription:
    last_id: str = "0-0"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # entry lists, or the error that ended them


class _OutputReader:
    """Reads the output streams of every request of one async client with one ``XREAD`` at a time and hands
    each request its entries. A new request joins the next read: the read in progress (blocking up to
    `BLOCK_MS`) also watches the client's wake-up stream, and subscribing adds an entry there, so the new
    request's acknowledgement and first token are not held up by a read that does not include it. The task
    ends when no request is left (and starts again with the next): an idle client leaves nothing running."""

    BLOCK_MS = 20

    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client
        self._subscriptions: dict[str, _Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self._reading = False  # a read is in progress (a new subscription is not part of it)
        self._wake_stream, self._woken = client._core.keys.wake(uuid.uuid4().hex), "0-0"
        self._wakers: set[asyncio.Task[None]] = set()
        self._beaten = -float("inf")  # when the owner key was last refreshed (monotonic)

    def subscribe(self, request_id: str) -> asyncio.Queue:
        subscription = self._subscriptions[request_id] = _Subscription()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._reading and len(self._wakers) == 0:  # one wake-up ends the read for every newcomer
            waker = asyncio.get_running_loop().create_task(self._wake())
            self._wakers.add(waker)
            waker.add_done_callback(self._wakers.discard)
        return subscription.queue

    async def _wake(self) -> None:
        with contextlib.suppress(EngineError):  # the read fails the same way and reports it
            await self.client._run(self.client._core.wake(self._wake_stream))

    def unsubscribe(self, request_id: str) -> None:
        self._subscriptions.pop(request_id, None)

    async def _run(self) -> None:
        while self._subscriptions:
            current, self._reading = dict(self._subscriptions), True
            positions = {rid: s.last_id for rid, s in current.items()}
            now = time.monotonic()
            beat = now - self._beaten >= self.client.settings.owner_beat
            try:
                read = self.client._core.read(
                    positions, self.BLOCK_MS, (self._wake_stream, self._woken), beat=beat
                )
                found, self._woken = await self.client._run(read)
                if beat:
                    self._beaten = now
            except EngineError as exc:  # Redis is gone: every waiting request fails cleanly
                for rid, subscription in current.items():
                    subscription.queue.put_nowait(exc)
                    self.unsubscribe(rid)
                continue
            finally:
                self._reading = False
            for rid, entries in found.items():
                subscription = current[rid]
                subscription.last_id = entries[-1][0]
                subscription.queue.put_nowait(entries)

    async def close(self) -> None:
        self._subscriptions.clear()
        for waker in self._wakers:
            waker.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class AsyncGenerationStream(_StreamState):
    """Async twin of `GenerationStream`. `async for` over it; cancelling the consuming task, leaving the loop
    (the generator is closed when collected), `async with` exit, or dropping the stream unfinished abort the
    request."""

    client: AsyncEngineClient

    def __init__(
        self, client: AsyncEngineClient, model: str, request_id: str, *, owns_request: bool = True
    ) -> None:
        super().__init__(client, model, request_id)
        self._queue = client._reader.subscribe(request_id)
        self._loop = asyncio.get_running_loop()
        self._owns_request = owns_request

    def __del__(self) -> None:
        # A generation dropped before its end that nobody aborted: a Django view cancelled (its client gone)
        # after returning a streaming response whose iterator never started, so no `finally` of ours ran.
        # Without this the engine would generate it to the end for nobody.
        if getattr(self, "_owns_request", False) and not self._acc.finished and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.client._abort_dropped, self.model, self.request_id)

    async def _next(self, timeout: float) -> P.Message:
        waiter = _Waiter(timeout, self.model)
        try:
            while not self._buffer:
                try:
                    async with asyncio.timeout(waiter.block_s(self.client.settings.poll_interval)):
                        got = await self._queue.get()
                except TimeoutError:
                    await self.client._run(self._check_waiting())
                    continue
                if isinstance(got, BaseException):
                    raise got
                self._take(got)
        except BaseException:
            self._unsubscribe()
            raise
        message = self._buffer.popleft()
        if isinstance(message, P.Final | P.Error | P.Result):
            self._unsubscribe()
        return message

    def _unsubscribe(self) -> None:
        self.client._reader.unsubscribe(self.request_id)

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
        self._unsubscribe()
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
        self._core = _Core(self.settings)
        self.keys = self._core.keys
        url = redis_url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
        pool = aredis.BlockingConnectionPool.from_url(url, **_pool_kwargs(self.settings, AsyncRetry))
        self.redis = aredis.Redis(connection_pool=pool)
        self._reader = _OutputReader(self)
        self._dropped: set[asyncio.Task] = set()  # aborts of dropped streams, until they are sent
        self.draining = False  # see `drain`

    def drain(self) -> None:
        """Refuse new generations (`EngineUnavailableError`): the process is shutting down and lets the
        requests in flight finish (see `inflight`, `fail_inflight`)."""
        self.draining = True

    @property
    def inflight(self) -> int:
        """Requests whose output this client is reading."""
        return len(self._reader._subscriptions)

    def fail_inflight(self, error: EngineError) -> None:
        """End every request in flight with `error` (its reader raises it, and aborts the request)."""
        for subscription in list(self._reader._subscriptions.values()):
            subscription.queue.put_nowait(error)

    def _abort_dropped(self, model: str, request_id: str) -> None:
        self._reader.unsubscribe(request_id)
        task = asyncio.get_running_loop().create_task(self._abort_quietly(model, request_id))
        self._dropped.add(task)
        task.add_done_callback(self._dropped.discard)

    async def _abort_quietly(self, model: str, request_id: str) -> None:
        try:
            await self.abort(model, request_id)
        except EngineError as exc:  # Redis is gone; nothing more can be done from here
            log.warning("could not abort dropped request %s: %s", request_id, exc)

    async def close(self) -> None:
        await self._reader.close()
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    async def _run(self, op: Op[T]) -> T:
        """See `EngineClient._run`."""
        try:
            commands = next(op)
            while True:
                if len(commands) == 1:
                    name, args, kwargs = commands[0]
                    results = [await getattr(self.redis, name)(*args, **kwargs)]
                else:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for name, args, kwargs in commands:
                            getattr(pipe, name)(*args, **kwargs)
                        results = await pipe.execute()
                commands = op.send(results)
        except StopIteration as done:
            return done.value
        except redis.RedisError as exc:
            raise _bus_error(exc) from exc

    async def generate(
        self,
        model: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | dict | None = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        chat_options: dict | None = None,
    ) -> AsyncGenerationStream:
        """See `EngineClient.generate`."""
        if self.draining:
            raise EngineUnavailableError("this server is shutting down; retry the request.")
        message = _generate_message(
            prompt, params, messages, request_id, priority, tools, self._core.owner_id
        )
        message.chat_options = chat_options
        try:
            await self._run(self._core.submit(model, message))
        except asyncio.CancelledError:  # the request may have reached Redis before the cancellation did
            await asyncio.shield(self._abort_quietly(model, message.id))
            raise
        stream = AsyncGenerationStream(self, model, message.id)
        await stream._wait_ack()
        return stream

    async def attach(self, model: str, request_id: str) -> AsyncGenerationStream:
        """The stream of a request submitted earlier, by this client or another (a bulk task that took over
        another's items), read from its first entry; leaving it early aborts the request as for `generate`.
        This client becomes the request's owner (its first one may be dead). Raises `RequestAbortedError` if
        the request was aborted."""
        await self._run(self._core.check_attachable(request_id))
        await self._run(self._core.adopt(request_id))
        return AsyncGenerationStream(self, model, request_id)

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
        return (await self._call(model, P.TokenizerInfo(uuid.uuid4().hex))).info

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        return (await self._call(model, P.Detokenize(uuid.uuid4().hex, list(token_ids)))).text

    async def abort(self, model: str, request_id: str) -> None:
        await self._run(self._core.abort(model, request_id))

    async def request_known(self, request_id: str, started: bool) -> bool:
        return await self._run(self._core.request_known(request_id, started))

    async def count(self, name: str, ttl: int) -> int:
        """See `_Core.count`: one round trip."""
        return await self._run(self._core.count(name, ttl))

    async def hold(self, name: str, member: str, limit: int, ttl: float) -> bool:
        """See `_Core.hold`: one round trip."""
        return await self._run(self._core.hold(name, member, limit, ttl))

    async def release(self, name: str, member: str) -> None:
        await self._run(self._core.release(name, member))

    async def live_replicas(self, model: str) -> list[str]:
        return await self._run(self._core.live_replicas(model))

    async def list_models(self) -> list[P.ModelInfo]:
        return await self._run(self._core.list_models())

    async def _call(self, model: str, message: P.Tokenize | P.Detokenize | P.TokenizerInfo) -> P.Result:
        await self._run(self._core.submit(model, message))
        # an answer, not a generation: dropping it after the answer aborts nothing
        stream = AsyncGenerationStream(self, model, message.id, owns_request=False)
        return _answer(await stream._next(self.settings.ack_timeout))


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
