"""The engine side of the bus: one loop that feeds an `LLMEngine` from Redis and streams its outputs back.

Each iteration: read aborts and new requests (non-blocking while there is work, blocking briefly when idle),
admit them (a new request joins the running batch at the next step) and acknowledge them at once, run one
engine step, and write every output entry of that step in one pipeline. Requests are read only up to
`max_inflight`, so a backlog stays in the shared stream where any replica of the model can take it. See
`protocol` for the wire format.

Priority-aware intake: interactive requests (``priority <= 0``) and low-priority ones (bulk jobs) come on
two streams. Interactive requests are read while fewer than `max_inflight` *interactive* ones are in flight,
however many bulk ones are; low-priority ones only while the total in flight is below `max_inflight`. So a
replica saturated with bulk work still sees a new interactive request at its next iteration, and the engine's
scheduler (ordered by priority) preempts a bulk sequence to run it at once. New low-priority requests are
also admitted a few per iteration (an eighth of `max_inflight`), and none in an iteration that admits an
interactive one: bulk prefills are spread over steps instead of arriving in waves (a step that prefills a
whole batch of bulk prompts is many decode steps long, and an interactive request arriving meanwhile waits it
out), and the step that prefills an interactive request carries no new bulk prompt.

Routing (see `routing`): each replica also has a request stream of its own, to which clients send the
interactive requests whose prompt prefix it served; it reads that stream before the shared one, publishes its
routing summary and load every `summary_interval`, hands unread routed entries back to the shared stream when
it stops, and takes over the routed entries of a replica that died.

Orphans: every `heartbeat_interval` the loop also looks up the liveness keys of the clients that own its
running requests (see `protocol`) and aborts the requests of those whose key lapsed, freeing their KV blocks:
a web worker killed mid-stream leaves nobody to send the abort.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from inference_engine.bus import protocol as P
from inference_engine.bus import routing
from inference_engine.bus.deltas import DeltaTracker
from inference_engine.bus.heartbeat import Heartbeat, new_replica_id
from inference_engine.errors import (
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestAbortedError,
)
from inference_engine.lora.registry import AdapterRegistry
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import EmbeddingRequestOutput
from inference_engine.pooling import PoolingParams
from inference_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class ServeSettings:
    prefix: str = P.DEFAULT_PREFIX
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 5.0  # a replica silent this long is dead: its requests are claimed
    claim_min_idle: float = 1.0  # XCLAIM guard: two survivors never both take one entry
    idle_block: float = 0.1  # seconds to block on Redis when there is no work
    max_inflight: int | None = None  # requests taken from the stream at once; None = engine's max_num_seqs
    output_ttl: int = 600  # seconds an output stream outlives its last write
    shutdown_grace: float = 10.0  # seconds to finish running requests on stop()
    # Seconds the engine idles after publishing a request's first token while other work remains: see
    # `first_token_pause_for`. 0 = never.
    first_token_pause: float = 0.0
    # Seconds between updates of the replica's routing summary and load (see `routing`).
    summary_interval: float = 0.25
    # Adapters served by name (`--lora-modules`): a request's `lora_name` picks one; in the heartbeat.
    lora_modules: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)


def first_token_pause_for(threads: int, cpus: int) -> float:
    """The pause `serve` gives a CPU engine whose `threads` take all `cpus` it may run on: long enough for the
    web process and Redis to deliver a first token to the client (benchmarks/results/bus-server-timings.md).

    Without it the next step starts at once on every core, and they wait for the scheduler to give them one
    back. The pause costs the other running requests its length once per new request. With a core to spare
    (or on a GPU) there is nothing to wait for: 0."""
    return 0.0015 if threads >= cpus else 0.0


@dataclass
class _Live:
    stream: str
    entry_id: str
    tracker: DeltaTracker
    n: int
    owner: str | None = None  # the client whose liveness keeps this request running
    embed: bool = False  # an embedding: answered by one Result, no ack or deltas


class EngineServer:
    """Serves one engine (one model) on the bus until `stop()`."""

    def __init__(
        self,
        engine: Any,
        redis_url: str,
        model_name: str | None = None,
        settings: ServeSettings | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings or ServeSettings()
        self.model = model_name or engine.model_name
        self.keys = P.Keys(self.settings.prefix)
        self.replica_id = new_replica_id()
        self.redis = redis.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5
        )
        self.heartbeat = Heartbeat(
            redis_url,
            self.keys,
            self.replica_id,
            self.model,
            self.settings.heartbeat_interval,
            self.settings.heartbeat_ttl,
        )
        self.max_inflight = self.settings.max_inflight or engine.config.max_num_seqs
        self.low_admit = max(1, self.max_inflight // 8)  # new low-priority requests per iteration
        self.req_stream, self.util_stream = self.keys.requests(self.model), self.keys.utility(self.model)
        self.low_stream = self.keys.low_priority_requests(self.model)
        self.routed_stream = routing.routed_stream(self.keys, self.model, self.replica_id)
        self.streams = (self.routed_stream, self.req_stream, self.low_stream, self.util_stream)
        self.interactive_streams = (self.routed_stream, self.req_stream)
        self.summary = routing.Summary(
            self.keys,
            self.replica_id,
            max(1, engine.stats().get("num_blocks", 1)),  # the cache holds at most that many prefixes
            self.settings.summary_interval,
            self.settings.heartbeat_ttl,
        )
        self._live: dict[str, _Live] = {}
        self._unacked: dict[str, P.Ack] = {}  # live requests waiting for their grammar: their ack
        self._writes: list[tuple[str, P.Message]] = []
        self._done: list[tuple[str, str]] = []  # (stream, entry id) to XACK + XDEL after the writes
        self._expire_set: dict[str, float] = {}  # request id -> when its output stream's TTL was last set
        self._abort_cursor = "0-0"
        # LoRA adapter updates (`protocol`: loracmd): read with the aborts, applied to the served adapters.
        self.lora_stream = self.keys.lora_commands(self.model)
        self._lora_cursor: str | None = None  # None until the first connect
        self.adapters = AdapterRegistry(self.settings.lora_modules, getattr(engine.runner, "lora", None))
        self._stopping = threading.Event()
        self._accepting = True
        self._next_maintenance = 0.0
        self._last_tokens = (time.monotonic(), 0)
        self._started_at = time.time()

    # ----------------------------------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask the loop to finish (safe from signal handlers and other threads)."""
        self._stopping.set()

    def run(self) -> None:
        self._connect()
        self.heartbeat.start()
        try:
            while not self._stopping.is_set():
                self._guarded(self._iterate)
            self._drain()
        finally:
            self.heartbeat.stop()
            self.redis.close()

    def _guarded(self, fn: Any) -> None:
        try:
            fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._redis_lost(exc)

    def _connect(self) -> None:
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, P.GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        last = self.redis.xrevrange(self.keys.aborts(self.model), count=1)
        self._abort_cursor = last[0][0] if last else "0-0"
        if self._lora_cursor is None:  # later connects read on from where the last one stopped
            self._sync_adapters()
        self._update_stats()
        self.heartbeat.beat()  # before the first read, so no survivor mistakes us for dead
        if self._accepting:
            self._publish_summary(force=True)  # routable from the start
        self._recover(self.replica_id)  # our own entries, if Redis kept them across a lost connection
        self._flush()
        log.info("replica %s serving %r on the bus", self.replica_id, self.model)

    def _redis_lost(self, exc: Exception) -> None:
        """In-flight requests cannot be delivered any more (their clients got errors too): drop them, then
        reconnect with backoff and carry on."""
        log.warning("lost Redis (%s); aborting %d in-flight request(s), reconnecting", exc, len(self._live))
        if self._live:
            self.engine.abort_request(list(self._live))
        self._live.clear()
        self._unacked.clear()
        self._writes.clear()
        self._done.clear()
        self._expire_set.clear()
        delay = 0.1
        while not self._stopping.is_set():
            try:
                self._connect()
                return
            except (redis.ConnectionError, redis.TimeoutError):
                self._stopping.wait(delay)
                delay = min(delay * 2, 2.0)

    def _drain(self) -> None:
        """Stop taking requests, finish the running ones within the grace period, fail the rest clearly."""
        self._accepting = False
        self._guarded(self._hand_back)
        deadline = time.monotonic() + self.settings.shutdown_grace
        while self._live and time.monotonic() < deadline:
            self._guarded(self._iterate)
        if self._live:
            self.engine.abort_request(list(self._live))
            for rid in list(self._live):
                self._fail(rid, EngineUnavailableError("the engine replica shut down before finishing."))
        self._guarded(self._flush)
        self._guarded(self._hand_back)  # what was routed here during the grace period
        self._guarded(lambda: self.redis.xlen(self.routed_stream) or self.redis.delete(self.routed_stream))

    # -------------------------------------------------------------------------------------------- loop

    def _iterate(self) -> None:
        busy = bool(self._live) or self.engine.has_unfinished_requests()
        aborts, entries, aborted = self._poll(block=not busy)
        for rid in aborts:
            self._abort(rid)
        self._admit(entries, aborted)
        if entries:  # acks out before the step: the web tier starts its response while the prompt prefills
            self._flush()
        firsts = 0
        if self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine is broken: fail everyone clearly, then die loudly
                for rid in list(self._live):
                    self._fail(rid, exc)
                self._flush()
                raise
            self._acknowledge_prepared()
            firsts = self._publish(outputs)
        self._flush()
        if self._accepting:
            self._publish_summary()
        if firsts and self.settings.first_token_pause and self.engine.has_unfinished_requests():
            self._stopping.wait(self.settings.first_token_pause)  # a core for those who deliver them
        if time.monotonic() >= self._next_maintenance:
            self._next_maintenance = time.monotonic() + self.settings.heartbeat_interval
            self._update_stats()
            for consumer in self._dead_consumers():
                self._recover(consumer)
            self._recover_routed()
            self._abort_orphans()
            self._flush()

    def _poll(self, block: bool) -> tuple[list[str], list[tuple[str, str, P.Message]], dict[str, bool]]:
        """Aborts, then new entries: utility ones, interactive requests up to the interactive capacity, then
        low-priority ones up to the total capacity (in that order, so interactive ones are never left in Redis
        for bulk ones). When idle, first blocks on every stream for one entry, then tops up the same way; the
        top-up's round trip also asks whether the request that woke us was aborted meanwhile (entry id ->
        aborted; `_admit` asks for the others)."""
        with self.redis.pipeline(transaction=False) as pipe:
            cursors = {self.keys.aborts(self.model): self._abort_cursor, self.lora_stream: self._lora_cursor}
            pipe.xread(cursors, count=1000)
            if block:
                taking = self._capacity([])[1] > 0
                streams = dict.fromkeys(self.streams if taking else [self.util_stream], ">")
                pipe.xreadgroup(
                    P.GROUP, self.replica_id, streams, count=1, block=int(self.settings.idle_block * 1000)
                )
            replies = self._execute(pipe)
        if replies is None:
            return [], [], {}
        aborts = []
        for stream, items in replies[0] or ():
            for entry_id, fields in items:
                if stream == self.lora_stream:
                    self._lora_cursor = entry_id
                    self._update_adapters(P.parse(fields))
                else:
                    self._abort_cursor = entry_id
                    aborts.append(fields["id"])
        entries = self._entries(replies[1]) if block else []
        aborted: dict[str, bool] = {}
        if entries or not block:
            read = self._read_more(entries)
            if read is None:
                return [], [], {}
            more, aborted = read
            entries += more
        return aborts, entries, aborted

    def _capacity(self, new: list[tuple[str, str, P.Message]]) -> tuple[int, int]:
        """(interactive, total) requests we may still take, counting `new` entries not yet admitted."""
        if not self._accepting:
            return 0, 0
        streams = [live.stream for live in self._live.values()] + [stream for stream, _, _ in new]
        interactive = sum(1 for stream in streams if stream in self.interactive_streams)
        total = sum(1 for stream in streams if stream != self.util_stream)
        return self.max_inflight - interactive, self.max_inflight - total

    def _read_more(
        self, entries: list[tuple[str, str, P.Message]]
    ) -> tuple[list[tuple[str, str, P.Message]], dict[str, bool]] | None:
        """Non-blocking reads after `entries`, and which of `entries` were aborted (entry id -> aborted),
        asked in the same round trip (None: Redis lost its data, see `_execute`)."""
        more: list[tuple[str, str, P.Message]] = []
        interactive, _ = self._capacity(entries)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.xreadgroup(P.GROUP, self.replica_id, {self.util_stream: ">"}, count=16)
            if interactive > 0:
                # Ours first, in one command for both streams (one round trip); its count applies to each.
                streams = {self.routed_stream: ">", self.req_stream: ">"}
                pipe.xreadgroup(P.GROUP, self.replica_id, streams, count=interactive)
            self._ask_aborted(pipe, entries)
            replies = self._execute(pipe)
        if replies is None:
            return None
        reads = len(replies) - len(entries)
        aborted = self._aborted(entries, replies[reads:])
        for reply in replies[:reads]:
            more += self._entries(reply)
        more = self._give_back_excess(more, interactive)
        _, total = self._capacity(entries + more)
        if total > 0 and not any(stream in self.interactive_streams for stream, _, _ in entries + more):
            with self.redis.pipeline(transaction=False) as pipe:
                count = min(total, self.low_admit)
                pipe.xreadgroup(P.GROUP, self.replica_id, {self.low_stream: ">"}, count=count)
                replies = self._execute(pipe)
            if replies is None:
                return None
            more += self._entries(replies[0])
        return more, aborted

    def _give_back_excess(
        self, read: list[tuple[str, str, P.Message]], capacity: int
    ) -> list[tuple[str, str, P.Message]]:
        """With a backlog on both interactive streams (some clients route, others do not) one read takes up to
        twice `capacity`: the routed entries past it go to the shared stream, where any replica takes them (a
        route is a preference), so a replica never holds more than `max_inflight`."""
        excess = sum(1 for stream, _, _ in read if stream in (self.routed_stream, self.req_stream)) - capacity
        back = [entry for entry in read if entry[0] == self.routed_stream][-excess:] if excess > 0 else []
        if not back:
            return read
        with self.redis.pipeline(transaction=False) as pipe:
            for _, entry_id, message in back:
                pipe.xadd(self.req_stream, P.encode(message))
                pipe.xack(self.routed_stream, P.GROUP, entry_id)
                pipe.xdel(self.routed_stream, entry_id)
            pipe.execute()
        return [entry for entry in read if entry not in back]

    def _ask_aborted(self, pipe: Any, entries: list[tuple[str, str, P.Message]]) -> None:
        """Queues on `pipe` whether each entry's request was aborted before we read it (its abort key)."""
        for _, _, message in entries:
            pipe.exists(self.keys.abort(message.id))

    @staticmethod
    def _aborted(entries: list[tuple[str, str, P.Message]], found: list) -> dict[str, bool]:
        """Entry id -> aborted, from the replies of `_ask_aborted`."""
        return {entry_id: bool(f) for (_, entry_id, _), f in zip(entries, found, strict=True)}

    @staticmethod
    def _entries(reply: Any) -> list[tuple[str, str, P.Message]]:
        """(stream, entry id, message) of each entry read."""
        return [
            (stream, entry_id, P.parse(fields)) for stream, items in reply or () for entry_id, fields in items
        ]

    def _execute(self, pipe: Any) -> list | None:
        """Runs a pipeline of reads; None when Redis lost its data."""
        try:
            return pipe.execute()
        except redis.ResponseError as exc:
            if not _data_lost(exc):
                raise
        self._lost_data()
        return None

    def _lost_data(self) -> None:
        """Redis lost its data (restart without persistence) and redis-py reconnected by itself, so no
        ConnectionError told us: the in-flight requests lost their entries and part of their output. Fail them
        as a lost connection would (their clients may still be reading), then recreate our groups (`_connect`
        flushes the errors)."""
        if self._live:
            log.warning("Redis lost its data; failing %d in-flight request(s)", len(self._live))
            self.engine.abort_request(list(self._live))
            for rid in list(self._live):
                self._fail(
                    rid,
                    EngineUnavailableError(
                        "Redis lost its data (restarted?) while this request ran; it was not finished."
                    ),
                )
        self._connect()

    def _admit(self, entries: list[tuple[str, str, P.Message]], aborted: dict[str, bool]) -> None:
        """Starts new requests, or ends those aborted before we read them. `aborted`: what `_poll` already
        knows of that (entry id -> aborted); the others are asked here, in one round trip."""
        if not entries:
            return
        unknown = [entry for entry in entries if entry[1] not in aborted]
        if unknown:
            with self.redis.pipeline(transaction=False) as pipe:
                self._ask_aborted(pipe, unknown)
                aborted = {**aborted, **self._aborted(unknown, pipe.execute())}
        for stream, entry_id, message in entries:
            if aborted[entry_id]:  # ended for anyone still reading its output (a bulk runner that reattached)
                if isinstance(message, P.Generate):
                    self._writes.append(
                        (message.id, P.Error.of(RequestAbortedError("the request was aborted.")))
                    )
                self._done.append((stream, entry_id))
            elif stream == self.util_stream:
                self._answer_utility(entry_id, message)
            else:
                self._start(stream, entry_id, message)

    def _start(self, stream: str, entry_id: str, message: P.Generate) -> None:
        rid = message.id
        embed = isinstance(message, P.Embed)
        try:
            params = (PoolingParams if embed else SamplingParams).from_dict(message.params)
            prompt_ids = self.engine.add_request(
                rid,
                self._prompt(message),
                params,
                priority=int(message.priority),
                arrival_time=message.arrival_time,
                lora_request=self._adapter(message.lora_name),
            )
        except Exception as exc:
            if not isinstance(exc, EngineError):  # a bug, not a refusal: fail it loudly, serve the others
                log.exception("request %s failed to start", rid)
            self._writes.append((rid, P.Error.of(exc)))
            self._done.append((stream, entry_id))
            return
        n = 1 if embed else params.n
        if not embed:
            self.summary.record(message)
        self._live[rid] = _Live(stream, entry_id, DeltaTracker(len(prompt_ids)), n, message.owner, embed)
        if embed:
            return
        ack = P.Ack(len(prompt_ids), self.replica_id)
        if message.tools:
            ack.tool_parser = self.engine.config.tool_call_parser
        if message.messages is not None:
            ack.reasoning_parser = self.engine.config.reasoning_parser
        if self.engine.preparing(rid):  # acknowledged (or refused) once its grammar has compiled
            self._unacked[rid] = ack
        else:
            self._writes.append((rid, ack))

    def _adapter(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        adapter = self.settings.lora_modules.get(name)
        if adapter is None:
            raise ModelNotFoundError(f"The model `{name}` does not exist: no such adapter of `{self.model}`.")
        return adapter

    def _sync_adapters(self) -> None:
        """At start: the adapters loaded at run time before this replica came (`protocol`: loraset), and
        the update stream's position from which it reads on."""
        last = self.redis.xrevrange(self.lora_stream, count=1)
        self._lora_cursor = last[0][0] if last else "0-0"
        for name, path in sorted(self.redis.hgetall(self.keys.lora_adapters(self.model)).items()):
            try:
                self.adapters.load(name, path)
            except EngineError as exc:
                log.warning("LoRA adapter %s (loaded at run time) not loaded: %s", name, exc)

    def _update_adapters(self, message: P.Message) -> None:
        """Applies one LoRA update and answers it on this replica's own output stream; the heartbeat goes
        out at once, so the web tier routes the adapter's name (or stops routing it) from now on."""
        try:
            if isinstance(message, P.LoadLoRA):
                self.adapters.load(message.lora_name, message.lora_path)
            elif isinstance(message, P.UnloadLoRA):
                self.adapters.unload(message.lora_name)
            else:
                raise InvalidRequestError(f"not a LoRA update: {message.type!r}")
            answer: P.Message = P.Result()
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("LoRA update %s failed", message.type)
            answer = P.Error.of(exc if isinstance(exc, EngineError) else InvalidRequestError(str(exc)))
        self._writes.append((f"{message.id}:{self.replica_id}", answer))
        self._update_stats()
        self.heartbeat.beat()

    def _acknowledge_prepared(self) -> None:
        """Acks the requests whose grammar compiled (ahead of this step's deltas); refuses those whose
        grammar failed."""
        for rid, error in self.engine.pop_refused().items():
            if rid in self._live:
                self._fail(rid, error)
        for rid, ack in list(self._unacked.items()):
            if not self.engine.preparing(rid):
                del self._unacked[rid]
                self._writes.append((rid, ack))

    def _prompt(self, message: P.Generate | P.Tokenize) -> str | list[int]:
        if message.messages is not None:
            try:
                template = self.engine.tokenizer.apply_chat_template
                tools = getattr(message, "tools", None)
                options = getattr(message, "chat_options", None) or {}
                return template(message.messages, tools=tools, **options)
            except Exception as exc:
                raise InvalidRequestError(f"cannot apply the chat template: {exc}") from exc
        if message.prompt_token_ids is not None:
            return [int(t) for t in message.prompt_token_ids]
        return message.prompt

    def _answer_utility(self, entry_id: str, message: P.Tokenize | P.Detokenize) -> None:
        answer: P.Message
        try:
            tokenizer = self.engine.tokenizer
            if isinstance(message, P.Detokenize):
                # Special tokens kept, as vLLM's /detokenize does: chat-templated ids round-trip.
                answer = P.Result(text=tokenizer.decode(message.token_ids, skip_special_tokens=False))
            elif isinstance(message, P.TokenizerInfo):
                answer = P.Result(info=self._tokenizer_info())
            else:
                prompt = self._prompt(message)
                special = message.add_special_tokens is not False
                ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt, special)
                answer = P.Result(
                    token_ids=list(ids), count=len(ids), max_model_len=self.engine.max_model_len
                )
                if message.return_token_strs:
                    answer.token_strs = [tokenizer.id_to_token(t) for t in ids]
        except Exception as exc:
            answer = P.Error.of(exc if isinstance(exc, EngineError) else InvalidRequestError(str(exc)))
        self._writes.append((message.id, answer))
        self._done.append((self.util_stream, entry_id))

    def _tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer facts vLLM's ``/tokenizer_info`` gives (lm-eval's remote tokenizer reads them)."""
        tokenizer = self.engine.tokenizer
        bos = tokenizer.bos_token_id
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.id_to_token(bos) if bos is not None else None,
            "eos_token": tokenizer.id_to_token(tokenizer.eos_token_id),
            "pad_token": None,
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": self.engine.max_model_len,
            "vocab_size": tokenizer.vocab_size,
        }

    def _publish(self, outputs: list) -> int:
        """Queues the outputs' new tokens for `_flush`; returns how many requests got their first token."""
        firsts = 0
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:  # aborted this iteration
                continue
            if isinstance(output, EmbeddingRequestOutput):
                if output.finished:
                    self._writes.append((output.request_id, _embedding_result(output)))
                    self._done.append((live.stream, live.entry_id))
                    del self._live[output.request_id]
                continue
            firsts += not live.tracker.started
            for message in live.tracker.messages(output, self.replica_id):
                self._writes.append((output.request_id, message))
            if output.finished:
                self._done.append((live.stream, live.entry_id))
                del self._live[output.request_id]
        return firsts

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        self._unacked.pop(rid, None)
        self.engine.abort_request(rid)
        if live.embed:
            self._writes.append((rid, P.Error.of(RequestAbortedError("the request was aborted."))))
        else:
            reasons = [(i, "abort", None) for i in range(live.n)]
            self._writes.append((rid, live.tracker.final(reasons, self.replica_id)))
        self._done.append((live.stream, live.entry_id))

    def _fail(self, rid: str, exc: BaseException) -> None:
        live = self._live.pop(rid)
        self._unacked.pop(rid, None)
        self._writes.append((rid, P.Error.of(exc)))
        self._done.append((live.stream, live.entry_id))

    def _flush(self) -> None:
        """Write this iteration's output entries, then acknowledge finished requests, in one round trip."""
        if not self._writes and not self._done:
            return
        now, ttl = time.monotonic(), self.settings.output_ttl
        with self.redis.pipeline(transaction=False) as pipe:
            for rid, message in self._writes:
                pipe.xadd(self.keys.output(rid), P.encode(message))
            # Not on every delta: with dozens of streams that doubled the commands of each step (throughput:
            # benchmarks/results/bus-server-timings.md).
            for rid in {rid for rid, _ in self._writes}:
                running = rid in self._live
                if not running or now - self._expire_set.get(rid, -ttl) >= ttl / 4:
                    pipe.expire(self.keys.output(rid), ttl)
                    if running:
                        self._expire_set[rid] = now
                    else:
                        self._expire_set.pop(rid, None)
            for stream, entry_id in self._done:
                pipe.xack(stream, P.GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            pipe.execute()
        self._writes.clear()
        self._done.clear()

    # -------------------------------------------------------------------------------- liveness, recovery

    def _update_stats(self) -> None:
        stats = self.engine.stats()
        now, tokens = time.monotonic(), stats.get("generation_tokens_total", 0)
        then, before = self._last_tokens
        self._last_tokens = (now, tokens)
        self.heartbeat.payload = {
            "replica": self.replica_id,
            "model": self.model,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self._started_at,
            "time": time.time(),
            "config": dataclasses.asdict(self.engine.config),
            "max_model_len": self.engine.max_model_len,
            "lora_modules": sorted(self.settings.lora_modules),
            "inflight": len(self._live),
            "max_inflight": self.max_inflight,
            "inflight_interactive": sum(
                1 for live in self._live.values() if live.stream in self.interactive_streams
            ),
            "tokens_per_s": (tokens - before) / (now - then) if now > then else 0.0,
            "stats": stats,
        }

    def _publish_summary(self, force: bool = False) -> None:
        """The routing summary and load, at most every `summary_interval` (see `routing`)."""
        if not self.summary.due(force):
            return
        stats = self.engine.stats()
        load = {
            "inflight": len(self._live),
            "inflight_routed": sum(1 for live in self._live.values() if live.stream == self.routed_stream),
            "running": stats.get("num_running", 0),
            "waiting": stats.get("num_waiting", 0),
            "free_blocks": stats.get("num_free_blocks", 0),
        }
        with self.redis.pipeline(transaction=False) as pipe:
            self.summary.publish(pipe, load)
            pipe.execute()

    def _hand_back(self) -> None:
        """On shutdown: withdraw from routing (clients then queue on the shared stream), and move what was
        routed here but not read yet to the shared stream, where the other replicas take it."""
        self.redis.delete(routing.load_key(self.keys, self.replica_id))
        reply = self.redis.xreadgroup(P.GROUP, self.replica_id, {self.routed_stream: ">"}, count=10_000)
        entries = [(entry_id, fields) for _, items in reply or () for entry_id, fields in items]
        if entries:
            with self.redis.pipeline(transaction=False) as pipe:
                for entry_id, fields in entries:
                    pipe.xadd(self.req_stream, fields)
                    pipe.xack(self.routed_stream, P.GROUP, entry_id)
                    pipe.xdel(self.routed_stream, entry_id)
                pipe.execute()
            log.info("handed %d routed request(s) back to the shared stream", len(entries))

    def _recover_routed(self) -> None:
        """Take over what was routed to dead replicas: the entries they read (pending under their name) and
        those they never read. A replica is dead here once both its heartbeat and its routing load expired,
        so no client routes to its stream any more; the stream is deleted once empty."""
        members = self.redis.smembers(self.keys.replicas(self.model))
        others = sorted(r for r in members if r != self.replica_id)
        if not others:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for r in others:
                pipe.exists(self.keys.replica(r), routing.load_key(self.keys, r))
            alive = pipe.execute()
        for replica in [r for r, count in zip(others, alive, strict=True) if count == 0]:
            stream = routing.routed_stream(self.keys, self.model, replica)
            try:
                self._take_routed(stream)
            except redis.ResponseError as exc:  # no such stream or group: nothing was routed there
                if not _data_lost(exc):
                    raise
            if not self.redis.xlen(stream):
                self.redis.delete(stream)
                self.redis.srem(self.keys.replicas(self.model), replica)

    def _take_routed(self, stream: str) -> None:
        pending = self.redis.xpending_range(stream, P.GROUP, min="-", max="+", count=1000)
        consumers = sorted({p["consumer"] for p in pending} - {self.replica_id})
        beats = self.redis.mget([self.keys.replica(c) for c in consumers]) if consumers else []
        dead = {c for c, beat in zip(consumers, beats, strict=True) if beat is None}
        ids = [p["message_id"] for p in pending if p["consumer"] in dead]
        min_idle = int(self.settings.claim_min_idle * 1000)
        claimed = self.redis.xclaim(stream, P.GROUP, self.replica_id, min_idle, ids) if ids else []
        for entry_id, fields in claimed:
            self._take_over(stream, entry_id, fields)
        _, total = self._capacity([])
        if total > 0:
            reply = self.redis.xreadgroup(P.GROUP, self.replica_id, {stream: ">"}, count=total)
            for _, items in reply or ():
                for entry_id, fields in items:
                    self._take_over(stream, entry_id, fields)

    def _abort_orphans(self) -> None:
        """Abort the running requests whose owner's liveness key lapsed, unless a live client adopted them."""
        owners = sorted({live.owner for live in self._live.values() if live.owner is not None})
        if not owners:
            return
        beats = self.redis.mget([self.keys.owner(owner) for owner in owners])
        lapsed = {owner for owner, beat in zip(owners, beats, strict=True) if beat is None}
        orphans = [rid for rid, live in self._live.items() if live.owner in lapsed]
        if not orphans:
            return
        adopters = self.redis.mget([self.keys.adopted(rid) for rid in orphans])
        candidates = sorted({a for a in adopters if a is not None and a not in lapsed})
        alive = self.redis.mget([self.keys.owner(a) for a in candidates]) if candidates else []
        adoptive = {a for a, beat in zip(candidates, alive, strict=True) if beat is not None}
        aborted = []
        for rid, adopter in zip(orphans, adopters, strict=True):
            if adopter in adoptive:
                self._live[rid].owner = adopter
            else:
                aborted.append(rid)
                self._abort(rid)
        if aborted:
            log.warning("aborted %d request(s) whose client is gone: %s", len(aborted), ", ".join(aborted))

    def _dead_consumers(self) -> set[str]:
        consumers = set()
        for stream in self.streams:
            try:
                infos = self.redis.xinfo_consumers(stream, P.GROUP)
            except redis.ResponseError as exc:
                if not _data_lost(exc):
                    raise
                self._lost_data()
                return set()
            consumers.update(info["name"] for info in infos)
        consumers.discard(self.replica_id)
        if not consumers:
            return set()
        names = sorted(consumers)
        alive = self.redis.mget([self.keys.replica(c) for c in names])
        return {c for c, beat in zip(names, alive, strict=True) if beat is None}

    def _recover(self, consumer: str) -> None:
        """Take over the pending entries of a dead consumer (or our own after a lost connection)."""
        min_idle = 0 if consumer == self.replica_id else int(self.settings.claim_min_idle * 1000)
        for stream in self.streams:
            pending = self.redis.xpending_range(
                stream, P.GROUP, min="-", max="+", count=1000, consumername=consumer
            )
            if pending:
                ids = [p["message_id"] for p in pending]
                for entry_id, fields in self.redis.xclaim(stream, P.GROUP, self.replica_id, min_idle, ids):
                    self._take_over(stream, entry_id, fields)
            elif consumer != self.replica_id:
                self.redis.xgroup_delconsumer(stream, P.GROUP, consumer)

    def _take_over(self, stream: str, entry_id: str, fields: dict | None) -> None:
        if not fields:  # the entry was deleted meanwhile
            self._done.append((stream, entry_id))
            return
        message = P.parse(fields)
        rid = message.id
        if rid in self._live:
            return
        if stream == self.util_stream:
            self._answer_utility(entry_id, message)
            return
        last = self.redis.xrevrange(self.keys.output(rid), count=1)
        seen = P.parse(last[0][1]).type if last else None
        log.warning("replica %s takes over request %s (last output: %s)", self.replica_id, rid, seen)
        if seen in (P.FINAL, P.ERROR, P.RESULT):  # (a result ends an embedding)
            self._done.append((stream, entry_id))
        elif self.redis.exists(self.keys.abort(rid)):
            self._writes.append((rid, P.Error.of(RequestAbortedError("the request was aborted."))))
            self._done.append((stream, entry_id))
        elif seen == P.DELTA:
            self._writes.append(
                (
                    rid,
                    P.Error.of(
                        EngineUnavailableError(
                            "the engine replica serving this request died after streaming part of it; "
                            "it was not re-run."
                        )
                    ),
                )
            )
            self._done.append((stream, entry_id))
        else:
            self._start(stream, entry_id, message)


def _embedding_result(output: EmbeddingRequestOutput) -> P.Result:
    """An embedding on the bus: its float32 values, base64 (exact, and a third of their JSON length)."""
    vector = output.outputs.embedding
    packed = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return P.Result(embedding=packed, count=len(output.prompt_token_ids))


def _data_lost(exc: redis.ResponseError) -> bool:
    """Whether a command failed because Redis no longer has our streams or groups (it restarted empty)."""
    return "NOGROUP" in str(exc) or "no such key" in str(exc)
