"""The Redis request bus: key layout and wire format shared by clients and engine processes.

Everything here is torch-free: the web tier imports it through the client.

Keys (``{p}`` is the namespace prefix, ``llmserve`` by default)
----------------------------------------------------------------
``{p}:req:{model}``         Interactive request stream of one served model (generations with ``priority <=
                            0``). Engine replicas of that model read it through the consumer group
                            ``engines`` (each entry goes to exactly one replica). An entry stays pending (in
                            the group's PEL) until its request is finished; it is then XACKed *and* XDELed, so
                            ``XLEN`` is the stream's backlog (queued + in flight).
``{p}:reqlow:{model}``      Low-priority request stream (``priority > 0``: bulk jobs), same group, same life
                            cycle. Two streams so that bulk work never hides an interactive request from the
                            engine: a replica takes up to ``max_inflight`` *interactive* requests whatever its
                            bulk load, and takes low-priority ones only while its total in flight is below
                            ``max_inflight``. The engine's scheduler, which orders by (priority, arrival),
                            then preempts running bulk sequences for an interactive one that does not fit.
                            Bounded admission (the client's ``max_queue``): an interactive request is refused
                            when ``XLEN`` of the interactive stream reaches ``max_queue``, a low-priority one
                            when the two streams' ``XLEN`` together reach it. So a bulk backlog never makes
                            interactive requests fail as overloaded, bulk never grows the total past
                            ``max_queue``, and the total stays below ``2 * max_queue``.
``{p}:util:{model}``        Tokenize / detokenize requests, same group; read every step regardless of load
                            (they need the engine's tokenizer, not a batch slot) and answered at once.
``{p}:out:{request_id}``    Output stream of one request, written only by the engine; ``EXPIRE``
                            (``output_ttl``) set on its first and last write and refreshed every quarter TTL
                            in between. A stream, not pub/sub: late readers lose nothing.
``{p}:rid:{request_id}``    ``SET NX`` by the client when it submits: a request id is accepted once
                            (``id_ttl``), so duplicates never run twice.
``{p}:abort:{request_id}``  Abort marker (``SET`` with TTL) checked by the engine when it picks a request up.
``{p}:aborts:{model}``      Abort stream of one model (capped). Every replica XREADs it once per scheduler
                            step and aborts the ids it serves, freeing their KV blocks within one step.
``{p}:replica:{replica}``   Heartbeat of one engine replica, ``SET`` with a TTL (``heartbeat_ttl``): its
                            model, engine config, running/waiting counts, KV usage and free/total blocks,
                            tokens/s. The key's existence *is* the replica's liveness.
``{p}:replicas:{model}``    Set of replica ids that have served ``model`` (pruned lazily when keys expire).
``{p}:models``              Set of served model names (pruned lazily).
``{p}:control:{name}``      Control stream of the supervisor ``name``: ``load`` / ``unload`` messages.
``{p}:supervisor:{name}``   Heartbeat of a supervisor: its children and their state.

Entries
-------
Every stream entry has a single field ``d`` holding a JSON object with a ``type``.

Request (client -> ``req`` stream, or ``reqlow`` for ``generate`` with ``priority > 0``):
  ``{"type": "generate", "id", "prompt" | "prompt_token_ids" | "messages", "params": SamplingParams.to_dict(),
  "priority": int (lower = earlier, vLLM's convention), "arrival_time": float}``
  ``{"type": "tokenize", "id", "prompt" | "messages", "add_special_tokens"?, "return_token_strs"?}`` /
  ``{"type": "detokenize", "id", "token_ids"}`` / ``{"type": "tokenizer_info", "id"}``

Output (engine -> ``out`` stream), in this order:
  ``ack``    ``{"prompt_tokens": int, "replica": str}`` -- the engine accepted the request. Clients wait for
             it (or ``error``) before yielding anything, so the HTTP layer can still answer 400. A request
             re-run after a crash may be acknowledged twice; clients skip the second ack.
  ``delta``  ``{"outputs": [{"index", "text", "token_ids", "logprobs"}], "replica"}`` -- what is new since the
             previous delta, one entry per scheduler step covering every output index that progressed.
             ``logprobs`` is ``null`` or one list per new token of ``[token_id, logprob, rank, decoded]``.
             The first delta of a request that asked for ``prompt_logprobs`` also carries
             ``"prompt_logprobs"`` (one such list per prompt token, ``null`` for the first) and
             ``"prompt_token_ids"``.
  ``final``  ``{"outputs": [{"index", "finish_reason", "stop_reason"}], "usage": {"prompt_tokens",
             "completion_tokens", "total_tokens"}, "replica"}`` -- always the last entry of a generation.
  ``error``  ``{"code": EngineError.code, "message"}`` -- terminal; may replace ``ack``.
  ``result`` ``{"token_ids": [...], "count", "max_model_len", "token_strs"?}``, ``{"text"}`` or
             ``{"info": {...}}`` -- answers tokenize / detokenize / tokenizer_info.

Control (client -> ``control`` stream):
  ``{"type": "load", "name", "model": path | null, "engine_args": {...}}`` / ``{"type": "unload", "name"}``

Crash recovery
--------------
Replicas publish heartbeats from a thread, so a long scheduler step does not look like death. Every
``heartbeat_interval`` each replica lists the group's consumers of all three streams (``req``, ``reqlow``,
``util``); for a consumer whose heartbeat key is gone it claims that consumer's pending entries of each stream
(``XPENDING`` + ``XCLAIM`` with a minimum idle time, so two survivors never both win an entry) and looks at
the request's output stream: finished (``final``/``error``) -> just acknowledge; already streamed a ``delta``
-> end it with ``engine_unavailable`` rather than re-run it (the client has seen part of an answer that a
re-run would not reproduce for sampled requests); otherwise run it. (``XAUTOCLAIM`` alone would also steal
entries from a live replica whose long prefill outlasts the idle threshold, so the claim is gated on the
owner's death instead.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from inference_engine.errors import ERRORS_BY_CODE, EngineError
from inference_engine.outputs import Logprob

DEFAULT_PREFIX = "llmserve"
GROUP = "engines"
FIELD = "d"
ABORT_STREAM_MAXLEN = 10_000

# Message types.
GENERATE, TOKENIZE, DETOKENIZE, TOKENIZER_INFO = "generate", "tokenize", "detokenize", "tokenizer_info"
ACK, DELTA, FINAL, ERROR, RESULT = "ack", "delta", "final", "error", "result"
LOAD, UNLOAD = "load", "unload"


@dataclass(frozen=True)
class Keys:
    """All Redis key names, in one place, under one prefix (tests use their own prefix or database)."""

    prefix: str = DEFAULT_PREFIX

    def requests(self, model: str) -> str:
        """The interactive request stream (``priority <= 0``)."""
        return f"{self.prefix}:req:{model}"

    def low_priority_requests(self, model: str) -> str:
        """The low-priority (bulk) request stream (``priority > 0``). The kind comes before the model name,
        so no model name can make it collide with another model's interactive stream."""
        return f"{self.prefix}:reqlow:{model}"

    def request_stream(self, model: str, priority: int) -> str:
        """Where a generation of this priority is queued."""
        return self.low_priority_requests(model) if priority > 0 else self.requests(model)

    def utility(self, model: str) -> str:
        return f"{self.prefix}:util:{model}"

    def output(self, request_id: str) -> str:
        return f"{self.prefix}:out:{request_id}"

    def request_id(self, request_id: str) -> str:
        return f"{self.prefix}:rid:{request_id}"

    def abort(self, request_id: str) -> str:
        return f"{self.prefix}:abort:{request_id}"

    def aborts(self, model: str) -> str:
        return f"{self.prefix}:aborts:{model}"

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    def replicas(self, model: str) -> str:
        return f"{self.prefix}:replicas:{model}"

    @property
    def models(self) -> str:
        return f"{self.prefix}:models"

    def control(self, supervisor: str) -> str:
        return f"{self.prefix}:control:{supervisor}"

    def supervisor(self, supervisor: str) -> str:
        return f"{self.prefix}:supervisor:{supervisor}"


def encode(message: dict[str, Any]) -> dict[str, str]:
    """A message as the fields of one stream entry."""
    return {FIELD: json.dumps(message, separators=(",", ":"))}


def decode(fields: dict) -> dict[str, Any]:
    """The message of one stream entry (accepts bytes or str field names and values)."""
    raw = fields.get(FIELD, fields.get(FIELD.encode()))
    return json.loads(raw)


def error_message(exc: BaseException) -> dict[str, Any]:
    code = exc.code if isinstance(exc, EngineError) else EngineError.code
    return {"type": ERROR, "code": code, "message": str(exc) or type(exc).__name__}


def raise_error(message: dict[str, Any]) -> None:
    """Re-raise an ``error`` entry as the typed exception the engine raised."""
    cls = ERRORS_BY_CODE.get(message.get("code", ""), EngineError)
    raise cls(message.get("message", "engine error"))


def encode_logprobs(logprobs: list[dict[int, Logprob]] | None) -> list | None:
    if logprobs is None:
        return None
    return [[[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in pos.items()] for pos in logprobs]


def decode_logprobs(data: list | None) -> list[dict[int, Logprob]] | None:
    if data is None:
        return None
    return [{int(t): Logprob(lp, rank, tok) for t, lp, rank, tok in pos} for pos in data]


def encode_prompt_logprobs(logprobs: list[dict[int, Logprob] | None]) -> list:
    """Prompt logprobs: the first position has none (nothing precedes it)."""
    return [None if pos is None else encode_logprobs([pos])[0] for pos in logprobs]


def decode_prompt_logprobs(data: list | None) -> list[dict[int, Logprob] | None] | None:
    if data is None:
        return None
    return [None if pos is None else decode_logprobs([pos])[0] for pos in data]


@dataclass
class CompletionDelta:
    """What is new for one output index since the previous delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", on the final delta only
    stop_reason: int | str | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class RequestDelta:
    """One step of a streamed request; the last one has ``finished`` set, finish reasons and ``usage``."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool = False
    usage: Usage | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # on the first delta, when asked for
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs


def delta_from_message(request_id: str, message: dict[str, Any]) -> RequestDelta:
    """Decode a ``delta`` or ``final`` entry."""
    if message["type"] == DELTA:
        outputs = [
            CompletionDelta(o["index"], o["text"], o["token_ids"], decode_logprobs(o.get("logprobs")))
            for o in message["outputs"]
        ]
        return RequestDelta(
            request_id,
            outputs,
            prompt_logprobs=decode_prompt_logprobs(message.get("prompt_logprobs")),
            prompt_token_ids=message.get("prompt_token_ids"),
        )
    outputs = [
        CompletionDelta(o["index"], finish_reason=o["finish_reason"], stop_reason=o.get("stop_reason"))
        for o in message["outputs"]
    ]
    return RequestDelta(request_id, outputs, finished=True, usage=Usage(**message["usage"]))


@dataclass
class ReplicaInfo:
    """A replica's heartbeat, as published by the engine process."""

    replica_id: str
    model: str
    data: dict[str, Any]

    @property
    def num_free_blocks(self) -> int:
        return self.data["stats"]["num_free_blocks"]

    @property
    def num_blocks(self) -> int:
        return self.data["stats"]["num_blocks"]


@dataclass
class ModelInfo:
    """A served model and its live replicas (what ``/v1/models`` and ``/health`` show)."""

    name: str
    replicas: list[ReplicaInfo]

    @property
    def max_model_len(self) -> int | None:
        return self.replicas[0].data.get("max_model_len") if self.replicas else None
