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
                            Bounded admission (the client's ``max_queue``, checked and queued in one
                            Lua script): an interactive request is refused
                            when ``XLEN`` of the interactive stream reaches ``max_queue``, a low-priority one
                            when the two streams' ``XLEN`` together reach it. So a bulk backlog never makes
                            interactive requests fail as overloaded, bulk never grows the total past
                            ``max_queue``, and the total stays below ``2 * max_queue``.
``{p}:util:{model}``        Tokenize / detokenize requests, same group; read every step regardless of load
                            (they need the engine's tokenizer, not a batch slot) and answered at once.
``{p}:out:{request_id}``    Output stream of one request, written only by the engine; ``EXPIRE``
                            (``output_ttl``) set on its first and last write and refreshed every quarter TTL
                            in between. A stream, not pub/sub: late readers lose nothing.
``{p}:wake:{reader}``        Wake-up stream of one async client's shared output read (one entry, expires):
                            a new request adds an entry, which ends the blocking ``XREAD`` in progress so
                            the next one includes the new request's output stream.
``{p}:rid:{request_id}``    ``SET NX`` by the client when it submits: a request id is accepted once
                            (``id_ttl``), so duplicates never run twice.
``{p}:owner:{owner}``      Liveness of one client (a web worker's event loop, a Celery runner): ``SET`` with
                            a TTL when it submits and again every second while it has requests in flight. A
                            replica aborts the running requests whose owner's key is gone (the process died,
                            or its loop stalled past the TTL), unless ``adopted`` names a live owner.
``{p}:adopted:{request_id}`` The owner now reading a request submitted by another (a bulk runner that took
                            the request over, `attach`).
``{p}:abort:{request_id}``  Abort marker (``SET`` with TTL) checked by the engine when it picks a request up.
``{p}:aborts:{model}``      Abort stream of one model (capped). Every replica XREADs it once per scheduler
                            step and aborts the ids it serves, freeing their KV blocks within one step.
``{p}:replica:{replica}``   Heartbeat of one engine replica, ``SET`` with a TTL (``heartbeat_ttl``): its
                            model, engine config, running/waiting counts, KV usage and free/total blocks,
                            tokens/s. The key's existence *is* the replica's liveness.
``{p}:replicas:{model}``    Set of replica ids that have served ``model`` (pruned lazily when keys expire).
``{p}:models``              Set of served model names (pruned lazily).
``{p}:control:{name}``      Control stream of the supervisor ``name``: ``load`` / ``unload`` messages.
``{p}:loracmd:{model}``     LoRA adapter updates of one model (``load_lora`` / ``unload_lora``, capped). Every
                            replica XREADs it with its aborts, applies each entry and answers on
                            ``{p}:out:{id}:{replica}``, so the client hears from each replica it counted.
``{p}:loraset:{model}``     Hash of the adapters loaded at run time (name -> path): a replica that starts
                            later loads them too.
``{p}:supervisor:{name}``   Heartbeat of a supervisor: its children and their state.

Entries
-------
Every stream entry has a single field ``d`` holding a JSON object with a ``type``. Each type is one message
class below (`Generate`, `Ack`, `Delta`, ...); the engine and the client build and read entries only through
them (`encode`, `parse`).

Request (client -> ``req`` stream, or ``reqlow`` for ``generate`` with ``priority > 0``):
  ``{"type": "generate", "id", "prompt" | "prompt_token_ids" | "messages", "tools"?, "params":
  SamplingParams.to_dict(), "priority": int (lower = earlier, vLLM's convention), "arrival_time": float,
  "owner"?: str, "lora_name"?: str}`` (``lora_name``: an adapter the engine serves by that name)
  (``tools``: OpenAI's function tools, rendered into the chat template with ``messages``; ``chat_options``?:
  how the template renders them, `Tokenizer.apply_chat_template`'s keyword arguments)
  ``{"type": "embed", "id", "prompt" | "prompt_token_ids", "params": PoolingParams.to_dict(), "priority",
  "arrival_time", "owner"?}`` -- on the same streams as ``generate``; answered by one ``result``
  ``{"embedding": base64 float32, "count"}`` or an ``error``
  ``{"type": "tokenize", "id", "prompt" | "messages", "add_special_tokens"?, "return_token_strs"?}`` /
  ``{"type": "detokenize", "id", "token_ids"}`` / ``{"type": "tokenizer_info", "id"}``

Output (engine -> ``out`` stream), in this order:
  ``ack``    ``{"prompt_tokens": int, "replica": str, "tool_parser"?: str, "reasoning_parser"?: str}`` -- the
             engine accepted the request (a structured-output request once its grammar compiled). Clients
             wait for it (or ``error``) before yielding anything, so the HTTP layer can still answer 400. A
             request re-run after a crash may be acknowledged twice; clients skip the second ack.
             ``tool_parser`` (when the request has tools) names the format of the model's tool calls
             (`inference_engine.tool_parsers`); ``reasoning_parser`` (for a chat request, when the engine has
             one) that of its reasoning block (`inference_engine.reasoning_parsers`).
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

LoRA updates (client -> ``loracmd`` stream, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter):
  ``{"type": "load_lora", "id", "lora_name", "lora_path"}`` / ``{"type": "unload_lora", "id", "lora_name"}``,
  answered by each replica with a ``result`` ``{}`` or an ``error`` on ``out:{id}:{replica}``.

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
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from inference_engine.errors import ERRORS_BY_CODE, EngineError
from inference_engine.outputs import Logprob

DEFAULT_PREFIX = "llmserve"
GROUP = "engines"
FIELD = "d"
ABORT_STREAM_MAXLEN = 10_000
LORA_STREAM_MAXLEN = 1_000


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

    def wake(self, reader_id: str) -> str:
        """An async client's wake-up stream: a new request wakes the client's blocked output read with it."""
        return f"{self.prefix}:wake:{reader_id}"

    def request_id(self, request_id: str) -> str:
        return f"{self.prefix}:rid:{request_id}"

    def abort(self, request_id: str) -> str:
        return f"{self.prefix}:abort:{request_id}"

    def owner(self, owner_id: str) -> str:
        return f"{self.prefix}:owner:{owner_id}"

    def adopted(self, request_id: str) -> str:
        return f"{self.prefix}:adopted:{request_id}"

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

    def lora_commands(self, model: str) -> str:
        return f"{self.prefix}:loracmd:{model}"

    def lora_adapters(self, model: str) -> str:
        return f"{self.prefix}:loraset:{model}"

    def counter(self, name: str) -> str:
        """A counter of the app's (`AsyncEngineClient.count`): the web processes' shared rate limits."""
        return f"{self.prefix}:count:{name}"


# ---------------------------------------------------------------------------------------------- messages
# One class per entry type; `type` is the wire tag. Fields left None are not sent.


@dataclass
class Message:
    type: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"type": self.type, **{k: v for k, v in data.items() if v is not None}}

    @staticmethod
    def from_wire(data: dict[str, Any]) -> Message:
        """The typed message of a decoded entry (fields it does not know are ignored)."""
        kind = MESSAGE_TYPES.get(data.get("type", ""))
        if kind is None:
            raise ValueError(f"unknown bus message type {data.get('type')!r}")
        names = {f.name for f in fields(kind)}
        return kind(**{k: v for k, v in data.items() if k in names})


@dataclass
class Generate(Message):
    """A generation; exactly one of `prompt`, `prompt_token_ids` and `messages` (chat, rendered by the engine
    with the model's chat template)."""

    type: ClassVar[str] = "generate"
    id: str
    params: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # OpenAI's function tools, for the chat template
    # How the template renders `messages`: `Tokenizer.apply_chat_template`'s add_generation_prompt,
    # continue_final_message and chat_template_kwargs (vLLM's request fields of those names).
    chat_options: dict[str, Any] | None = None
    priority: int = 0  # lower runs earlier (vLLM's convention)
    arrival_time: float | None = None
    owner: str | None = None  # the client whose liveness key keeps the request running (None: nobody's)
    lora_name: str | None = None  # an adapter the engine serves (`--lora-modules`); None: the base model


@dataclass
class Tokenize(Message):
    type: ClassVar[str] = "tokenize"
    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None  # None = True (the model's BOS where it wants one)
    return_token_strs: bool | None = None


@dataclass
class TokenizerInfo(Message):
    """Asks for the tokenizer facts vLLM's ``/tokenizer_info`` gives."""

    type: ClassVar[str] = "tokenizer_info"
    id: str


@dataclass
class Detokenize(Message):
    type: ClassVar[str] = "detokenize"
    id: str
    token_ids: list[int]


@dataclass
class Ack(Message):
    type: ClassVar[str] = "ack"
    prompt_tokens: int
    replica: str
    tool_parser: str | None = None  # the model's tool-call format, for requests with tools
    reasoning_parser: str | None = None  # the model's reasoning-block format, for chat requests


@dataclass
class Delta(Message):
    """``outputs``: ``[{"index", "text", "token_ids", "logprobs"}]``, what is new per output index."""

    type: ClassVar[str] = "delta"
    outputs: list[dict[str, Any]]
    replica: str
    # On the first delta of a request that asked for them: one logprob list per prompt token (None for the
    # first), and the prompt's ids.
    prompt_logprobs: list | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class Final(Message):
    """``outputs``: ``[{"index", "finish_reason", "stop_reason"}]``; ``usage``: prompt, completion and total
    token counts."""

    type: ClassVar[str] = "final"
    outputs: list[dict[str, Any]]
    usage: dict[str, int]
    replica: str


@dataclass
class Error(Message):
    type: ClassVar[str] = "error"
    code: str
    message: str
    param: str | None = None  # the request field at fault, where the error names one

    @classmethod
    def of(cls, exc: BaseException) -> Error:
        code = exc.code if isinstance(exc, EngineError) else EngineError.code
        return cls(code, str(exc) or type(exc).__name__, getattr(exc, "param", None))

    def exception(self) -> EngineError:
        """The typed exception the engine raised."""
        exc = ERRORS_BY_CODE.get(self.code, EngineError)(self.message)
        if self.param is not None:
            exc.param = self.param
        return exc


@dataclass
class Result(Message):
    """The answer to a tokenize (`token_ids`, `count`, `max_model_len`, `token_strs` when asked), detokenize
    (`text`) or tokenizer_info (`info`) request."""

    type: ClassVar[str] = "result"
    token_ids: list[int] | None = None
    count: int | None = None
    max_model_len: int | None = None
    token_strs: list[str | None] | None = None
    text: str | None = None
    info: dict[str, Any] | None = None
    embedding: str | None = None  # an embed request's vector: base64 of its little-endian float32 values


@dataclass
class Embed(Generate):
    """An embedding of one prompt (`params`: `PoolingParams.to_dict()`). Queued, prioritised and aborted as a
    generation is (it is a prompt prefilled in the same batch); answered with one `Result` carrying
    `embedding` and `count` (the prompt's tokens), or an `error`; no ack."""

    type: ClassVar[str] = "embed"


@dataclass
class Load(Message):
    type: ClassVar[str] = "load"
    name: str
    model: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Unload(Message):
    type: ClassVar[str] = "unload"
    name: str


@dataclass
class LoadLoRA(Message):
    """Load the PEFT adapter in folder `lora_path` as `lora_name` on every replica of a model."""

    type: ClassVar[str] = "load_lora"
    id: str
    lora_name: str
    lora_path: str


@dataclass
class UnloadLoRA(Message):
    """Stop serving `lora_name`: new requests for it are refused, running ones finish."""

    type: ClassVar[str] = "unload_lora"
    id: str
    lora_name: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    kind.type: kind
    for kind in (
        Generate,
        Embed,
        Tokenize,
        Detokenize,
        TokenizerInfo,
        Ack,
        Delta,
        Final,
        Error,
        Result,
        Load,
        Unload,
        LoadLoRA,
        UnloadLoRA,
    )
}
GENERATE, TOKENIZE, DETOKENIZE, TOKENIZER_INFO = (
    Generate.type,
    Tokenize.type,
    Detokenize.type,
    TokenizerInfo.type,
)
ACK, DELTA, FINAL, ERROR, RESULT = Ack.type, Delta.type, Final.type, Error.type, Result.type
LOAD, UNLOAD = Load.type, Unload.type


def encode(message: Message | dict[str, Any]) -> dict[str, str]:
    """A message as the fields of one stream entry."""
    data = message.to_wire() if isinstance(message, Message) else message
    return {FIELD: json.dumps(data, separators=(",", ":"))}


def decode(fields: dict) -> dict[str, Any]:
    """The raw JSON object of one stream entry (accepts bytes or str field names and values)."""
    raw = fields.get(FIELD, fields.get(FIELD.encode()))
    return json.loads(raw)


def parse(fields: dict) -> Message:
    """The typed message of one stream entry."""
    return Message.from_wire(decode(fields))


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


def delta_from_message(request_id: str, message: Delta | Final) -> RequestDelta:
    """A `Delta` or `Final` message as the client's `RequestDelta`."""
    if isinstance(message, Delta):
        outputs = [
            CompletionDelta(o["index"], o["text"], o["token_ids"], decode_logprobs(o.get("logprobs")))
            for o in message.outputs
        ]
        return RequestDelta(
            request_id,
            outputs,
            prompt_logprobs=decode_prompt_logprobs(message.prompt_logprobs),
            prompt_token_ids=message.prompt_token_ids,
        )
    outputs = [
        CompletionDelta(o["index"], finish_reason=o["finish_reason"], stop_reason=o.get("stop_reason"))
        for o in message.outputs
    ]
    return RequestDelta(request_id, outputs, finished=True, usage=Usage(**message.usage))


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

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters some replica serves by name (their `model` in a request), sorted."""
        return sorted({name for r in self.replicas for name in r.data.get("lora_modules", ())})
