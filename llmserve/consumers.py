"""The WebSocket chat consumer: a conversation in, the answer streamed back token by token.

Protocol (JSON text frames). The client sends

    {"type": "chat", "id": <any>, "model": "...", "messages": [{"role", "content"}...],
     "params": {"temperature": 0.7, "max_tokens": 256, ...}}   # OpenAI chat fields: sampling,
                                                                # response_format, tools, tool_choice
    {"type": "stop"}                                            # abort the running answer
    {"type": "models"}                                          # ask for the live models again

and receives ``ready`` (with the live models and LoRA adapters the caller may use) once connected, then per
answer ``start`` (prompt token count), ``delta`` (new text; with tools, ``tool_calls`` pieces in the REST
stream's shape; from an engine with a reasoning parser, ``reasoning_content`` apart from the text), and
``end`` (finish_reason, usage, ttft seconds, tokens_per_s), or ``error`` (code, message, param) for anything
refused. A stopped answer ends with finish_reason ``"abort"``.

The token loop runs as its own task so that a ``stop`` message or a disconnect is handled while tokens are
still arriving: cancelling the task aborts the engine request, which frees its KV blocks within one step.

Who may chat: an API key (offered as the subprotocol ``llmserve.key.<key>`` — browsers cannot set headers
on a WebSocket — or an ``Authorization: Bearer`` header), else the session's logged-in user, else anyone
when ``LLMSERVE["CHAT_LOGIN_REQUIRED"]`` is False. A client that sends no ``Origin`` header is a program, not
a browser page (`llmserve.routing.SameOriginValidator` checks the header of those that do): it must bring an
API key. Every chat message counts against the caller's rate limit,
as every REST request does. The server always answers with the subprotocol ``llmserve.chat``, never echoing
a key.

A caller holds at most ``LLMSERVE["WS_CONNECTIONS_PER_KEY"]`` sockets at once, across every web worker
(slots in the bus's Redis that expire unless the connection renews them, so a killed worker's slots free
themselves); the next is told so and closed with 4429. A message over ``MAX_BODY_BYTES`` gets an error and
closes the socket with 4413.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db import close_old_connections

from inference_engine.bus.protocol import RequestDelta
from inference_engine.errors import EngineError
from llmserve import bus, conf
from llmserve.api import errors, generation, schema
from llmserve.api.models import model_objects
from llmserve.api.validation import validated
from llmserve.auth import (
    AuthenticationFailed,
    Principal,
    RateLimited,
    aauthenticate,
    acheck_rate,
    bearer_token,
    model_refused,
)

log = logging.getLogger("llmserve.chat")

SUBPROTOCOL = "llmserve.chat"
KEY_SUBPROTOCOL = "llmserve.key."
CLOSE_UNAUTHORIZED = 4401  # application close codes live in 4000-4999
CLOSE_TOO_MANY = 4429  # the caller already holds its quota of sockets
SLOT_SECONDS = 120.0  # a connection's slot lapses this long after its last renewal
CLOSE_TOO_BIG = 4413  # a message over the size limit (as HTTP's 413; 1009 is reserved to the transport)


class ChatError(Exception):
    """A refusal to report on the socket: ``{"type": "error", "code", "message", "param"}``."""

    def __init__(
        self, code: str, message: str, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after = code, message, param, retry_after

    @classmethod
    def from_api(cls, exc: errors.APIError) -> ChatError:
        return cls(exc.code or exc.type, exc.message, exc.param, exc.retry_after)


@dataclass
class Answer:
    """One answer's bookkeeping, kept outside its task so a stopped answer can still report its numbers."""

    id: Any
    model: str
    received: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None

    def saw(self, delta: RequestDelta) -> None:
        count = sum(len(o.token_ids) for o in delta.outputs)
        if count:
            self.last_token = time.monotonic()
            self.first_token = self.first_token or self.last_token
            self.completion_tokens += count

    def end_message(self, finish_reason: str | None) -> dict[str, Any]:
        ttft = None if self.first_token is None else self.first_token - self.received
        # Decode speed: the tokens after the first over the time they took (the first one includes prefill).
        rate = None
        if self.first_token is not None and self.last_token and self.last_token > self.first_token:
            rate = (self.completion_tokens - 1) / (self.last_token - self.first_token)
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        return {
            "type": "end",
            "id": self.id,
            "finish_reason": finish_reason,
            "usage": usage,
            "ttft": ttft,
            "tokens_per_s": rate,
            "elapsed": time.monotonic() - self.received,
        }


class ChatConsumer(AsyncJsonWebsocketConsumer):
    """One browser tab (or client) chatting; at most one answer streams at a time per connection."""

    principal: Principal | None = None
    answer: Answer | None = None
    task: asyncio.Task[None] | None = None
    slot: tuple[str, str] | None = None  # (the caller's slot set, this connection's member), while held
    renewer: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        # Accept before authenticating so that a refusal can say why (a refused handshake reaches the browser
        # only as an anonymous close).
        await self.accept(SUBPROTOCOL if SUBPROTOCOL in self.scope.get("subprotocols", ()) else None)
        try:
            self.principal = await self._authenticate()
        except AuthenticationFailed as exc:
            await self._send_error(ChatError("login_required", str(exc)))
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        if not await self._hold_slot(self.principal):
            limit = conf.get("WS_CONNECTIONS_PER_KEY")
            await self._send_error(
                ChatError("too_many_connections", f"At most {limit} chat connections are open at once.")
            )
            await self.close(code=CLOSE_TOO_MANY)
            return
        await self.send_json(
            {
                "type": "ready",
                "models": await self._models_or_empty(),
                "max_prompt_chars": conf.get("MAX_PROMPT_CHARS"),
            }
        )

    async def disconnect(self, code: int) -> None:
        await self._cancel()
        if self.renewer is not None:
            self.renewer.cancel()
        if self.slot is not None:
            with contextlib.suppress(EngineError):
                await bus.async_client().release(*self.slot)

    async def _hold_slot(self, principal: Principal) -> bool:
        """Take one of the caller's connection slots (see the module docstring). With the bus down no slot
        can be counted; the socket stays open and its chat messages get the bus's error."""
        self.slot = (f"ws:{principal.identity}", uuid.uuid4().hex)
        limit = int(conf.get("WS_CONNECTIONS_PER_KEY"))
        try:
            held = await bus.async_client().hold(*self.slot, limit, SLOT_SECONDS)
        except EngineError:
            return True
        if held:
            self.renewer = asyncio.create_task(self._renew(limit))
        else:
            self.slot = None
        return held

    async def _renew(self, limit: int) -> None:
        while True:
            await asyncio.sleep(SLOT_SECONDS / 3)
            with contextlib.suppress(EngineError):
                await bus.async_client().hold(*self.slot, limit, SLOT_SECONDS)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        """Parse defensively: bad input gets an error message, never an exception that closes the socket."""
        if self.principal is None:
            return
        if text_data is None:
            await self._send_error(ChatError("invalid_message", "Send JSON text frames, not binary ones."))
            return
        if len(text_data) > conf.get("MAX_BODY_BYTES"):
            # Said, then closed: a client that sends this much is not following the protocol.
            await self._send_error(
                ChatError("request_too_large", f"Messages are limited to {conf.get('MAX_BODY_BYTES')} bytes.")
            )
            await self.close(code=CLOSE_TOO_BIG)
            return
        try:
            content = json.loads(text_data)
        except (ValueError, RecursionError) as exc:
            await self._send_error(ChatError("invalid_json", f"The message is not valid JSON: {exc}"))
            return
        try:
            await self.receive_json(content)
        except ChatError as exc:
            await self._send_error(exc, content.get("id") if isinstance(content, dict) else None)
        except Exception:
            log.exception("chat message handling failed")
            await self._send_error(ChatError("internal_error", "The server failed to handle the message."))

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "chat":
            await self._start(content)
        elif kind == "stop":
            await self._stop()
        elif kind == "models":
            await self.send_json({"type": "models", "models": await self._models()})
        else:
            raise ChatError(
                "invalid_message",
                "A message is an object whose `type` is chat, stop or models.",
                param="type",
            )

    # ---------------------------------------------------------------------------------------- answering

    async def _start(self, content: dict[str, Any]) -> None:
        if self.task is not None and not self.task.done():
            raise ChatError("busy", "An answer is still streaming; stop it first.")
        principal = await self._authenticate_again()
        try:
            await acheck_rate(principal)
        except RateLimited as exc:
            raise ChatError("rate_limit_exceeded", str(exc), retry_after=exc.retry_after) from None
        params = content.get("params")
        try:
            request = await validated(
                principal.identity, params if isinstance(params, dict) else {}, _parse, content
            )
        except errors.APIError as exc:  # the constraint pool's budgets
            raise ChatError.from_api(exc) from None
        if not principal.may_use(request.model):
            raise ChatError.from_api(model_refused(request.model))
        await sync_to_async(close_old_connections)()  # as REST does: no connection held while streaming
        self.answer = Answer(content.get("id"), request.model)
        self.task = asyncio.create_task(self._stream(self.answer, request))

    async def _stream(self, answer: Answer, request: schema.GenerationRequest) -> None:
        """The token loop: its own task, so cancelling it (stop, disconnect) aborts the engine request. The
        request goes through the REST API's own submit and stream chunks; each chunk's choice becomes a
        ``delta`` frame."""
        try:
            submitted = await generation.submit(request)
            try:
                answer.prompt_tokens = submitted.streams[0].prompt_tokens or 0
                await self.send_json(
                    {
                        "type": "start",
                        "id": answer.id,
                        "model": answer.model,
                        "prompt_tokens": answer.prompt_tokens,
                    }
                )
                builder = await generation.response_builder(submitted)
                async for _, delta in submitted.deltas():
                    answer.saw(delta)
                    chunk = builder.delta_chunk(delta)
                    choice = chunk["choices"][0] if chunk is not None else {"delta": {}}
                    said = choice["delta"]
                    if any(said.values()):  # not a token that says nothing yet
                        await self.send_json(
                            {"type": "delta", "id": answer.id, "text": said.pop("content", ""), **said}
                        )
                    if delta.finished:
                        if delta.usage is not None:
                            answer.completion_tokens = delta.usage.completion_tokens
                        await self.send_json(answer.end_message(_end_reason(delta, choice)))
            finally:
                await submitted.abort()  # stopped or disconnected: the engine request ends too
        except ChatError as exc:
            await self._send_error(exc, answer.id)
        except errors.APIError as exc:
            await self._send_error(ChatError.from_api(exc), answer.id)
        except EngineError as exc:
            await self._send_error(ChatError.from_api(errors.from_engine_error(exc)), answer.id)
        except Exception:
            log.exception("chat answer failed")
            await self._send_error(ChatError("internal_error", "The answer failed on the server."), answer.id)

    async def _stop(self) -> None:
        """Stop the running answer (a late stop, after the answer ended, is harmless)."""
        answer = self.answer
        if await self._cancel() and answer is not None:
            await self.send_json(answer.end_message("abort"))

    async def _cancel(self) -> bool:
        """Cancel the token loop and wait until its engine request is aborted; whether one was running."""
        task, self.task = self.task, None
        if task is None or task.done():
            return False
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # we are being cancelled ourselves, not just the task
                raise
        return True

    # ---------------------------------------------------------------------------------------- helpers

    def _api_key(self) -> str | None:
        for protocol in self.scope.get("subprotocols", ()):
            if protocol.startswith(KEY_SUBPROTOCOL):
                return protocol[len(KEY_SUBPROTOCOL) :]
        header = dict(self.scope.get("headers", ())).get(b"authorization")
        return bearer_token(header.decode("latin-1")) if header else None

    async def _authenticate(self) -> Principal:
        key = self._api_key()
        address = (self.scope.get("client") or ["-"])[0]
        if key is not None:
            return await aauthenticate(f"Bearer {key}", address)
        if b"origin" not in dict(self.scope.get("headers", ())):
            raise AuthenticationFailed("Programs (clients sending no Origin header) connect with an API key.")
        user = self.scope.get("user")
        if user is not None and user.is_authenticated:
            return Principal(None, f"user:{user.pk}", conf.get("DEFAULT_RATE_LIMIT"))
        if conf.get("CHAT_LOGIN_REQUIRED"):
            raise AuthenticationFailed("Log in to chat, or connect with an API key.")
        return Principal(None, f"addr:{address}", conf.get("DEFAULT_RATE_LIMIT"))

    async def _authenticate_again(self) -> Principal:
        """Per message, as REST does per request: a key revoked mid-conversation stops working."""
        if self.principal is not None and self.principal.key is None:
            return self.principal
        try:
            self.principal = await self._authenticate()
        except AuthenticationFailed as exc:
            raise ChatError("invalid_api_key", str(exc)) from None
        return self.principal

    async def _models(self) -> list[dict[str, Any]]:
        """The served models and their LoRA adapters (``parent``: the adapter's base model) that the caller
        may use."""
        try:
            served = await model_objects()
        except EngineError as exc:
            raise ChatError.from_api(errors.from_engine_error(exc)) from None
        return [
            {
                "id": m["id"],
                "max_model_len": m["max_model_len"],
                **({"parent": m["parent"]} if m["parent"] else {}),
            }
            for m in served
            if self.principal is None or self.principal.may_use(m["id"])
        ]

    async def _models_or_empty(self) -> list[dict[str, Any]]:
        try:
            return await self._models()
        except ChatError as exc:
            await self._send_error(exc)
            return []

    async def _send_error(self, exc: ChatError, request_id: Any = None) -> None:
        await self.send_json(
            {
                "type": "error",
                "id": request_id,
                "code": exc.code,
                "message": exc.message,
                "param": exc.param,
                "retry_after": exc.retry_after,
            }
        )


def _end_reason(delta: RequestDelta, choice: dict[str, Any]) -> str | None:
    """The chunk's finish reason where the answer called tools; else the engine's own, "abort" included (the
    REST stream says "stop" for that, since its client is gone)."""
    reason = choice.get("finish_reason")
    return reason if reason in ("tool_calls", "function_call") else delta.outputs[0].finish_reason


# Body fields the chat decides itself: one streamed answer, no logprobs.
_NOT_SETTINGS = {"model", "messages", "stream", "stream_options", "n", "logprobs", "top_logprobs"}


def _parse(content: dict[str, Any]) -> schema.GenerationRequest:
    """Validate a chat message with the REST API's own rules (same fields, same limits, same wording)."""
    params = content.get("params") or {}
    if not isinstance(params, dict):
        raise ChatError("invalid_type", "`params` must be an object of sampling settings.", "params")
    reserved = _NOT_SETTINGS & set(params)
    if reserved:
        name = sorted(reserved)[0]
        raise ChatError("unknown_parameter", f"`params.{name}` is not a chat setting.", f"params.{name}")
    try:
        body = {**params, "model": content.get("model"), "messages": content.get("messages")}
        # The socket's settings are the chat page's own: an unknown one is a mistake worth saying.
        return schema.parse("chat", body, reject_unknown=True)
    except errors.APIError as exc:
        raise ChatError.from_api(exc) from None
