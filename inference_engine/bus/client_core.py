"""What the sync and async bus clients share: their settings and results, the bus operations (`Core`), and
the bookkeeping of one generation's output (`Accumulator`, `Waiter`, `StreamState`).

Every operation is written once, in `Core`, as a generator that yields the Redis commands of each round trip
and receives their results; the clients (`inference_engine.bus.client`) only run them, with redis-py's
blocking or asyncio client. No torch here: the web tier imports this.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from inference_engine.bus import protocol as P
from inference_engine.bus import routing
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
from inference_engine.pooling import PoolingParams
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
    # The client's liveness key (see `bus.client`): refreshed every `owner_beat` seconds while
    # it has requests in flight; the engine aborts them once it has been silent `owner_ttl` seconds.
    owner_beat: float = 1.0
    owner_ttl: float = 5.0
    # Interactive generations go to the replica holding the longest part of their prompt ("prefix"), or all
    # to the model's shared stream ("shared"); see `routing`.
    routing: str = routing.PREFIX
    # Requests by which the prefix's replica may be busier than the least loaded one and still get it.
    routing_load_margin: int = 4


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


def tokenize_message(
    prompt: str | None, messages: list[dict] | None, add_special_tokens: bool, return_token_strs: bool
) -> P.Tokenize:
    fields = _prompt_fields(prompt, messages)
    return P.Tokenize(
        uuid.uuid4().hex, **fields, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs
    )


def tokenized(answer: P.Result) -> Tokenized:
    return Tokenized(answer.token_ids, answer.max_model_len, answer.token_strs)


Command = tuple[str, tuple[Any, ...], dict[str, Any]]  # a redis-py method name and its arguments
Op = Generator[list[Command], list[Any], T]  # yields each round trip's commands, receives their results


def _cmd(name: str, *args: Any, **kwargs: Any) -> Command:
    return (name, args, kwargs)


# Admission in one atomic step, so concurrent submits never overshoot the backlog bound: refuse when the
# counted streams' backlog has reached the limit, refuse a reused request id, else mark the owner alive and
# queue the entry: on the target stream, or on the fallback stream when the target is a replica's own stream
# and that replica withdrew from routing (its load key is gone: it died or is shutting down), so that nothing
# is queued where no replica reads it.
# KEYS: request-id key, target stream, owner key, the target replica's load key, fallback stream, counted
# streams... ARGV: limit (-1: none), model, id ttl, entry, owner ttl (ms), 1 when the target is a replica's.
_ADMIT = f"""
local limit = tonumber(ARGV[1])
if limit >= 0 then
  local backlog = 0
  for i = 6, #KEYS do backlog = backlog + redis.call('XLEN', KEYS[i]) end
  if backlog >= limit then return 'overloaded' end
end
if not redis.call('SET', KEYS[1], ARGV[2], 'NX', 'EX', ARGV[3]) then return 'duplicate' end
redis.call('SET', KEYS[3], 1, 'PX', ARGV[5])
if ARGV[6] == '1' and redis.call('EXISTS', KEYS[4]) == 0 then
  redis.call('XADD', KEYS[5], '*', '{P.FIELD}', ARGV[4])
  return 'fallback'
end
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


class Core:
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
        decision = routing.Decision(routing.SHARED)
        if self._routable(message):
            decision = yield from self.route(model, message)
        fallback, alive = stream, stream
        if decision.replica is not None:
            stream = routing.routed_stream(self.keys, model, decision.replica)
            alive = routing.load_key(self.keys, decision.replica)
            counted = (*counted, stream)
        keys = (self.keys.request_id(message.id), stream, self._owner_key, alive, fallback, *counted)
        entry = P.encode(message)[P.FIELD]
        owner_ttl = int(self.settings.owner_ttl * 1000)
        routed = int(decision.replica is not None)
        (verdict,) = yield [
            _cmd(
                "eval", _ADMIT, len(keys), *keys, limit, model, self.settings.id_ttl, entry, owner_ttl, routed
            )
        ]
        if verdict == "overloaded":
            raise EngineOverloadedError(f"model {model!r} has {limit} requests queued; retry later.")
        if verdict == "duplicate":
            raise InvalidRequestError(f"duplicate request id {message.id!r}.")
        if verdict == "fallback":
            decision = routing.Decision(routing.SHARED)
        if self._routable(message):
            log.info(
                "request %s: routed %s (%s, %d of its prompt cached there)",
                message.id,
                f"to replica {decision.replica}" if decision.replica else "to the shared stream",
                decision.policy,
                decision.matched,
            )
            routing.routed(model, decision.policy)

    def _routable(self, message: P.Message) -> bool:
        """Interactive generations are routed (see `routing`); bulk ones and tokenizer calls are not."""
        return (
            self.settings.routing == routing.PREFIX
            and isinstance(message, P.Generate)
            and not isinstance(message, P.Embed)
            and message.priority <= 0
        )

    def route(self, model: str, message: P.Generate) -> Op[routing.Decision]:
        """Where to queue an interactive generation: two round trips (the replicas, then their loads, queued
        requests and which of the prompt's prefix digests they hold)."""
        (members,) = yield [_cmd("smembers", self.keys.replicas(model))]
        replicas = sorted(members)
        if len(replicas) < 2:
            return routing.Decision(routing.SHARED)
        digests = routing.prefix_digests(message)
        commands = []
        for replica in replicas:
            commands.append(_cmd("hgetall", routing.load_key(self.keys, replica)))
            commands.append(_cmd("xlen", routing.routed_stream(self.keys, model, replica)))
            if digests:
                names = [digest for digest, _ in digests]
                commands.append(_cmd("zmscore", routing.summary_key(self.keys, replica), names))
        replies = iter((yield commands))
        loads, matches = {}, {}
        for replica in replicas:
            load, queued = next(replies), next(replies)
            scores = next(replies) if digests else []
            if load:
                loads[replica] = routing.replica_load(load, queued)
                matches[replica] = routing.longest_match(digests, scores)
        return routing.choose(loads, matches, self.settings.routing_load_margin)

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

    def update_lora(self, model: str, message: P.LoadLoRA | P.UnloadLoRA, timeout: float) -> Op[int]:
        """Sends a LoRA update to every replica of `model` (`protocol`: loracmd) and waits for each live one's
        answer; returns how many applied it. The first refusal is raised (InvalidRequestError for an adapter
        that cannot be served, ModelNotFoundError for an unknown name on unload); a load that every replica
        refused is not remembered for replicas that start later."""
        replicas = yield from self.live_replicas(model)
        if not replicas:
            raise ModelNotFoundError(f"model {model!r} is not served by any live engine.")
        known = self.keys.lora_adapters(model)
        if isinstance(message, P.LoadLoRA):
            remember = _cmd("hsetnx", known, message.lora_name, message.lora_path)
        else:
            remember = _cmd("hdel", known, message.lora_name)
        command = _cmd(
            "xadd",
            self.keys.lora_commands(model),
            P.encode(message),
            maxlen=P.LORA_STREAM_MAXLEN,
            approximate=True,
        )
        remembered, _ = yield [remember, command]
        waiter = Waiter(timeout, model)
        pending = {f"{message.id}:{r}": "0-0" for r in replicas}
        answers: list[P.Message] = []
        while pending:
            found, _ = yield from self.read(pending, int(waiter.block_s(self.settings.poll_interval) * 1000))
            for rid, entries in found.items():
                answers.append(entries[0][1])
                del pending[rid]
            if pending and not found:  # a replica that died meanwhile will not answer
                alive = set((yield from self.live_replicas(model)))
                pending = {rid: last for rid, last in pending.items() if rid.rsplit(":", 1)[1] in alive}
        yield [_cmd("delete", *(self.keys.output(f"{message.id}:{r}") for r in replicas))]
        refusals = [a for a in answers if isinstance(a, P.Error)]
        if refusals and isinstance(message, P.LoadLoRA) and remembered and len(refusals) == len(answers):
            yield [_cmd("hdel", known, message.lora_name)]
        if refusals:
            raise refusals[0].exception()
        return len(answers)

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


def generate_message(
    prompt: str | list[int] | None,
    params: SamplingParams | dict | None,
    messages: list[dict] | None,
    request_id: str | None,
    priority: int,
    tools: list[dict] | None,
    owner: str,
    chat_options: dict | None,
    lora_name: str | None = None,
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
        chat_options=chat_options,
        lora_name=lora_name,
        **_prompt_fields(prompt, messages),
    )


def embed_message(
    prompt: str | list[int],
    params: PoolingParams | dict | None,
    request_id: str | None,
    priority: int,
    owner: str,
) -> P.Embed:
    if params is None:
        params = PoolingParams()
    elif not isinstance(params, PoolingParams):
        params = PoolingParams.from_dict(params)
    return P.Embed(
        id=request_id or uuid.uuid4().hex,
        params=params.to_dict(),
        priority=int(priority),
        arrival_time=time.time(),
        owner=owner,
        **_prompt_fields(prompt, None),
    )


def answer(message: P.Message) -> P.Result:
    """The result of a one-answer request (tokenizer, embedding)."""
    if isinstance(message, P.Error):
        raise message.exception()
    assert isinstance(message, P.Result), message
    return message


def bus_error(exc: redis.RedisError) -> EngineError:
    """A Redis failure as the engine error the front ends report; its details (addresses) go to the log."""
    if isinstance(exc, redis.ConnectionError) and "No connection available" in str(exc):
        return EngineOverloadedError("too many requests are waiting for the request bus; retry later.")
    log.warning("request bus error: %s", exc)
    return EngineUnavailableError("lost the connection to the request bus.")


class ClientBase:
    """What both clients hold: their settings, the core, and a bounded pool of Redis connections."""

    def __init__(
        self,
        redis_url: str | None,
        settings: ClientSettings | None,
        overrides: dict[str, Any],
        redis_api: ModuleType,
        retry: type[Retry] | type[AsyncRetry],
    ) -> None:
        """`redis_api` is `redis` or `redis.asyncio`, with its `retry` class."""
        self.settings = settings or ClientSettings(**overrides)
        self._core = Core(self.settings)
        self.keys = self._core.keys
        url = redis_url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
        pool = redis_api.BlockingConnectionPool.from_url(url, **_pool_kwargs(self.settings, retry))
        self.redis = redis_api.Redis(connection_pool=pool)


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


class Accumulator:
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


class Waiter:
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


class StreamState:
    """What the sync and async streams share: the request, its read position and the buffered entries."""

    def __init__(self, client: ClientBase, model: str, request_id: str) -> None:
        self.client, self.model, self.request_id = client, model, request_id
        self._acc = Accumulator(request_id)
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
