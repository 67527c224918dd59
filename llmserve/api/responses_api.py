"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

A response is a chat completion underneath: its ``instructions``, the conversation of the response named by
``previous_response_id`` and its ``input`` become chat messages, validated and submitted by the chat path
(`schema.chat_request`, `generation.submit`), and so do its function ``tools``, ``tool_choice`` and
``text.format`` (a JSON schema); the answer's calls are read by the chat path's tool-call parsers and come
out as ``function_call`` items. Stored responses (``store``, the default) live in `StoredResponse`, readable
by the key that created them. Streams send the Responses event types (``response.created`` ...
``response.completed``), each with its ``sequence_number``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from inference_engine.errors import EngineError
from inference_engine.tool_parsers import ParsedDelta, ToolCall, ToolParser
from llmserve.api import errors, generation, schema
from llmserve.api.decorators import api_view
from llmserve.api.responses import tool_parser
from llmserve.api.validation import validated
from llmserve.auth import Principal
from llmserve.models import StoredResponse


class _Turn:
    """One response being made: its request, the conversation it answers, and its object as it grows."""

    def __init__(self, body: schema.ResponsesRequest, history: list[dict[str, str]], principal: Principal):
        self.body, self.principal = body, principal
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.conversation = history + [m.as_engine_message() for m in body.input_messages()]
        self.text = ""
        self.calls: list[ToolCall] = []
        self.items: list[str | int] = []  # the output items in order: "message", or a call's index
        self.parser: ToolParser | None = None

    def chat(self) -> schema.GenerationRequest:
        messages = list(self.conversation)
        if self.body.instructions:
            messages.insert(0, {"role": "system", "content": self.body.instructions})
        fields = {
            "model": self.body.model,
            "messages": messages,
            "max_completion_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "user": self.body.user,
            **self.body.chat_fields(),
        }
        try:
            request = schema.validate(schema.ChatCompletionRequest, fields)
            return schema.chat_request(request, self.principal.min_priority)
        except errors.BadRequest as exc:
            exc.param = _responses_param(exc.param)
            raise

    def start(self, request: schema.GenerationRequest, model_format: str | None) -> None:
        if request.tool_choice is not None:
            self.parser = tool_parser(request.tool_choice, model_format)

    def read(self, text: str, finished: bool) -> ParsedDelta:
        """Takes the next text of the answer: what it says, and the pieces of its calls."""
        parsed = ParsedDelta(text)
        if self.parser is not None:
            parsed = self.parser.feed(text)
            if finished:
                parsed.extend(self.parser.finish())
        if parsed.content and "message" not in self.items:
            self.items.append("message")
        self.text += parsed.content
        for d in parsed.tool_calls:
            if d.id is not None:
                self.calls.append(ToolCall(d.id, d.name, ""))
                self.items.append(d.index)
            self.calls[d.index].arguments += d.arguments
        return parsed

    def message(self, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [self.text_part()] if status != "in_progress" else [],
        }

    def call_item(self, index: int, status: str) -> dict[str, Any]:
        call = self.calls[index]
        return {
            "type": "function_call",
            "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "",
            "status": status,
        }

    def output(self, status: str) -> list[dict[str, Any]]:
        items = self.items or ["message"]
        return [self.message(status) if i == "message" else self.call_item(i, status) for i in items]

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def object(self, status: str, usage: Any = None, finish_reason: str | None = None) -> dict[str, Any]:
        incomplete = status == "completed" and finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "model": self.body.model,
            "output": self.output("incomplete" if incomplete else status) if status != "in_progress" else [],
            "parallel_tool_calls": self.body.parallel_tool_calls,
            "previous_response_id": self.body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.body.store,
            "temperature": 1.0 if self.body.temperature is None else self.body.temperature,
            "text": {"format": _format(self.body)},
            "tool_choice": _tool_choice(self.body),
            "tools": [t.model_dump(exclude_none=True) for t in self.body.tools or []],
            "top_p": 1.0 if self.body.top_p is None else self.body.top_p,
            "truncation": "disabled",
            "usage": _usage(usage),
            "user": self.body.user,
            "metadata": self.body.metadata or {},
        }

    async def store(self, body: dict[str, Any]) -> None:
        if self.body.store:
            await StoredResponse.objects.acreate(
                id=self.id,
                owner=self.principal.key,
                model=self.body.model,
                conversation=[*self.conversation, self.answer()],
                body=body,
            )

    def answer(self) -> dict[str, Any]:
        """The answer as the conversation's next message."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        return message


def _responses_param(param: str | None) -> str | None:
    """A chat request's field as the Responses API names it."""
    if param is None:
        return None
    param = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)
    param = re.sub(r"^response_format(\.json_schema)?", "text.format", param)
    return re.sub(r"^messages(\[\d+\])?", "input", param)


def _format(body: schema.ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    return fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}


def _tool_choice(body: schema.ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, schema.ResponseNamedToolChoice):
        return choice.model_dump()
    return choice or ("auto" if body.tools else "none")


def _usage(usage: Any) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


async def _stored(response_id: str, principal: Principal, param: str | None = None) -> StoredResponse:
    found = await StoredResponse.objects.filter(id=response_id, owner=principal.key).afirst()
    if found is None:
        raise errors.NotFound(f"No response with id `{response_id}` was found.", param=param)
    return found


@api_view(("POST",), json_body=True)
async def create(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    data = schema.validate(schema.ResponsesRequest, body)
    history = []
    if data.previous_response_id is not None:
        previous = await _stored(data.previous_response_id, principal, param="previous_response_id")
        history = previous.conversation
    turn = _Turn(data, history, principal)
    request = await validated(principal.identity, body, turn.chat)
    submitted = await generation.submit(request)
    turn.start(request, submitted.streams[0].tool_parser)
    if data.stream:
        response = StreamingHttpResponse(_events(turn, submitted), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    try:
        async for _, delta in submitted.deltas():
            turn.read("".join(o.text for o in delta.outputs), delta.finished)
    finally:
        await submitted.abort()  # a cancelled view (client gone) leaves nothing running
    result = await submitted.streams[0].result()
    answer = turn.object("completed", result.usage, result.outputs[0].finish_reason)
    await turn.store(answer)
    return JsonResponse(answer)


async def _events(turn: _Turn, submitted: generation.Submitted) -> AsyncIterator[bytes]:
    """The stream: each output item is added when its first piece is written (the message at its first
    text, a function call once its name is known) and done at the end."""
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return generation.sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    def where(item: str | int) -> dict[str, Any]:
        item_id = turn.message_id if item == "message" else turn.call_item(item, "completed")["id"]
        return {"item_id": item_id, "output_index": turn.items.index(item)}

    def added(item: str | int) -> list[bytes]:
        if item != "message":
            return [
                event(
                    "response.output_item.added",
                    output_index=turn.items.index(item),
                    item=turn.call_item(item, "in_progress"),
                )
            ]
        return [
            event(
                "response.output_item.added",
                output_index=turn.items.index(item),
                item=turn.message("in_progress"),
            ),
            event("response.content_part.added", **where(item), content_index=0, part=turn.text_part()),
        ]

    try:
        yield event("response.created", response=turn.object("in_progress"))
        yield event("response.in_progress", response=turn.object("in_progress"))
        finish, usage = None, None
        async for _, delta in submitted.deltas():
            known = len(turn.items)
            parsed = turn.read("".join(o.text for o in delta.outputs), delta.finished)
            for item in turn.items[known:]:
                for chunk in added(item):
                    yield chunk
            if parsed.content:
                yield event(
                    "response.output_text.delta",
                    **where("message"),
                    content_index=0,
                    delta=parsed.content,
                    logprobs=[],
                )
            for d in parsed.tool_calls:
                if d.arguments:
                    yield event("response.function_call_arguments.delta", **where(d.index), delta=d.arguments)
            if delta.finished:
                finish, usage = delta.outputs[0].finish_reason, delta.usage
        if not turn.items:  # nothing was said: an empty message
            turn.items.append("message")
            for chunk in added("message"):
                yield chunk
        answer = turn.object("completed", usage, finish)
        for item, done in zip(turn.items, answer["output"], strict=True):
            if item == "message":
                yield event(
                    "response.output_text.done", **where(item), content_index=0, text=turn.text, logprobs=[]
                )
                yield event(
                    "response.content_part.done", **where(item), content_index=0, part=turn.text_part()
                )
            else:
                yield event(
                    "response.function_call_arguments.done",
                    **where(item),
                    name=done["name"],
                    arguments=done["arguments"],
                )
            yield event("response.output_item.done", output_index=turn.items.index(item), item=done)
        await turn.store(answer)
        yield event("response.completed", response=answer)
    except EngineError as exc:
        error = errors.from_engine_error(exc)
        yield event("error", code=error.code, message=error.message, param=error.param)
    finally:
        await submitted.abort()


@api_view(("GET", "DELETE"))
async def detail(request: HttpRequest, principal: Principal, response_id: str) -> HttpResponse:
    stored = await _stored(response_id, principal)
    if request.method == "DELETE":
        await stored.adelete()
        return JsonResponse({"id": response_id, "object": "response.deleted", "deleted": True})
    return JsonResponse(stored.body)


@api_view(("GET",))
async def input_items(request: HttpRequest, principal: Principal, response_id: str) -> HttpResponse:
    """The items the stored response answered (the conversation it continued and its input; instructions are
    not items), newest first unless ``order=asc``, ``limit`` (1-100, default 20) at a time after ``after``."""
    stored = await _stored(response_id, principal)
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.BadRequest('`order` must be "asc" or "desc".', param="order")
    raw_limit = request.GET.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise errors.BadRequest("`limit` must be an integer in [1, 100].", param="limit")
    limit = int(raw_limit)
    items = _as_items(stored.id, stored.conversation[:-1])
    if order == "desc":
        items.reverse()
    after = request.GET.get("after")
    if after:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise errors.NotFound(f"No input item with id `{after}` was found.", param="after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return JsonResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(items) > limit,
        }
    )


def _as_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses API items, with ids that stay the same for every listing."""
    stem = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{stem}_{i}",
                    "call_id": message.get("tool_call_id"),
                    "output": content,
                    "status": "completed",
                }
            )
            continue
        if content or not message.get("tool_calls"):
            part = "output_text" if role == "assistant" else "input_text"
            text: dict[str, Any] = {"type": part, "text": content}
            if part == "output_text":
                text["annotations"] = []
            items.append(
                {
                    "type": "message",
                    "id": f"msg_{stem}_{i}",
                    "role": role,
                    "content": [text],
                    "status": "completed",
                }
            )
        for call in message.get("tool_calls") or []:
            items.append(
                {
                    "type": "function_call",
                    "id": "fc_" + call["id"].removeprefix("call_"),
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
    return items
