"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: its ``instructions``, the conversation of the response named by
``previous_response_id`` and its ``input`` become chat messages, validated and submitted by the chat path
(`schema.chat_request`, `generation.submit`), so whatever the chat path learns (tools, structured output)
is there to share. Stored responses (``store``, the default) live in `StoredResponse`, readable by the key
that created them. Streams send the Responses event types (``response.created`` ...
``response.completed``), each with its ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from inference_engine.errors import EngineError
from llmserve.api import errors, generation, schema
from llmserve.api.decorators import api_view
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

    def chat(self) -> schema.GenerationRequest:
        messages = list(self.conversation)
        if self.body.instructions:
            messages.insert(0, {"role": "system", "content": self.body.instructions})
        return schema.chat_request(
            schema.validate(
                schema.ChatCompletionRequest,
                {
                    "model": self.body.model,
                    "messages": messages,
                    "max_completion_tokens": self.body.max_output_tokens,
                    "temperature": self.body.temperature,
                    "top_p": self.body.top_p,
                    "user": self.body.user,
                },
            )
        )

    def message(self, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [self.text_part()] if status != "in_progress" else [],
        }

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
            "output": [self.message("incomplete" if incomplete else status)]
            if status != "in_progress"
            else [],
            "parallel_tool_calls": False,
            "previous_response_id": self.body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.body.store,
            "temperature": 1.0 if self.body.temperature is None else self.body.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
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
                conversation=[*self.conversation, {"role": "assistant", "content": self.text}],
                body=body,
            )


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
    submitted = await generation.submit(turn.chat())
    if data.stream:
        response = StreamingHttpResponse(_events(turn, submitted), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    try:
        async for _, delta in submitted.deltas():
            turn.text += "".join(o.text for o in delta.outputs)
    finally:
        await submitted.abort()  # a cancelled view (client gone) leaves nothing running
    result = await submitted.streams[0].result()
    answer = turn.object("completed", result.usage, result.outputs[0].finish_reason)
    await turn.store(answer)
    return JsonResponse(answer)


async def _events(turn: _Turn, submitted: generation.Submitted) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return generation.sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    where = {"item_id": turn.message_id, "output_index": 0}
    try:
        yield event("response.created", response=turn.object("in_progress"))
        yield event("response.in_progress", response=turn.object("in_progress"))
        yield event("response.output_item.added", output_index=0, item=turn.message("in_progress"))
        yield event("response.content_part.added", **where, content_index=0, part=turn.text_part())
        finish, usage = None, None
        async for _, delta in submitted.deltas():
            text = "".join(o.text for o in delta.outputs)
            if text:
                turn.text += text
                yield event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            if delta.finished:
                finish, usage = delta.outputs[0].finish_reason, delta.usage
        yield event("response.output_text.done", **where, content_index=0, text=turn.text, logprobs=[])
        yield event("response.content_part.done", **where, content_index=0, part=turn.text_part())
        answer = turn.object("completed", usage, finish)
        yield event("response.output_item.done", output_index=0, item=answer["output"][0])
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
