"""OpenAI response bodies and stream chunks of chat and completion requests, built from what the bus returns.

Shapes follow the OpenAI API reference (and vLLM's server): ``chat.completion`` / ``chat.completion.chunk``
and ``text_completion`` objects, usage counts, finish reasons, and logprobs in each endpoint's own format. A
completion request with several prompts is one engine request per prompt; its choices are numbered
``prompt * n + sample``, as OpenAI and vLLM number them.

A chat request with tools has its answers read by a tool-call parser (`tool_parser`): the calls go out as
``tool_calls`` (``function_call`` for the legacy ``functions``) with ``finish_reason: "tool_calls"``; a stream
sends each call's id and name once its name is written, then its arguments as they are written. An engine
with a reasoning parser (its ack names it) has its chat answers' reasoning block returned apart, as
``reasoning_content`` in the message and in stream deltas (`AnswerReader`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from inference_engine.bus.client import GenerationResult
from inference_engine.bus.protocol import CompletionDelta, RequestDelta, Usage
from inference_engine.outputs import CompletionOutput, Logprob
from inference_engine.reasoning_parsers import ReasoningParser, get_reasoning_parser
from inference_engine.tool_parsers import (
    NamedToolCall,
    ParsedDelta,
    RequiredToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_parser,
)
from llmserve.api.schema import GenerationRequest, ToolChoice

_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}

Positions = list[dict[int, Logprob] | None]


@dataclass
class Echo:
    """What an echoing completion shows of one prompt: its text, and the text of its first token (the one
    position without a logprob)."""

    text: str
    first_token: str = ""


def answer_id(request: GenerationRequest) -> str:
    """The answer's id: the client's ``request_id`` (vLLM's field) after the kind's prefix, else random.
    The engine requests carry it too (`bus_ids`), so it is also what an operator aborts."""
    return _ID_PREFIX[request.kind] + (request.request_id or uuid.uuid4().hex)


def bus_ids(request: GenerationRequest, prompts: int) -> list[str | None]:
    """The engine requests' ids: the answer's, numbered when it has several prompts; None: the bus's own."""
    if request.request_id is None:
        return [None] * prompts
    base = answer_id(request)
    return [base] if prompts == 1 else [f"{base}-{i}" for i in range(prompts)]


def likeliest(result: GenerationResult, n: int) -> GenerationResult:
    """The `n` outputs of a ``best_of`` request with the highest mean logprob per token, renumbered."""

    def mean_logprob(out: CompletionOutput) -> float:
        chosen = [_chosen(p, t)[1].logprob for p, t in zip(out.logprobs or [], out.token_ids, strict=False)]
        return sum(chosen) / len(chosen) if chosen else float("-inf")

    best = sorted(result.outputs, key=mean_logprob, reverse=True)[:n]
    outputs = [dataclasses.replace(out, index=i) for i, out in enumerate(best)]
    return dataclasses.replace(result, outputs=outputs)


def finish_reason(reason: str | None) -> str | None:
    # "abort" only happens when the client went away; it never reaches a client, but keep the enum valid.
    return "stop" if reason == "abort" else reason


def tool_parser(choice: ToolChoice, model_format: str | None) -> ToolParser:
    """The parser of an answer: the grammar's format for a required or named choice, else the model's."""
    if choice.mode == "named":
        return NamedToolCall(choice.function)
    if choice.mode == "required":
        return RequiredToolCalls()
    return get_parser(model_format or "hermes")


class AnswerReader:
    """One chat answer as it is read, whole or streamed: the model's reasoning block apart (the engine's
    reasoning parser), then the tool calls (`tool_parser`) out of the rest.

    An answer a grammar wrote (`constrained`: structured outputs, a required or named tool choice) is what
    the grammar describes from its first token: it has reasoning only where it writes ``<think>`` itself."""

    def __init__(
        self,
        choice: ToolChoice | None,
        tool_format: str | None,
        reasoning_format: str | None,
        constrained: bool = False,
    ) -> None:
        self.tools = tool_parser(choice, tool_format) if choice is not None else None
        self.reasoning: ReasoningParser | None = None
        if reasoning_format is not None:
            self.reasoning = get_reasoning_parser(reasoning_format, opened_by_prompt=not constrained)

    def feed(self, text: str, finished: bool) -> tuple[str, ParsedDelta]:
        """(reasoning, the rest) of the answer's next piece of text; `finished`: it was the last."""
        reasoning = ""
        if self.reasoning is not None:
            parsed = self.reasoning.feed(text)
            if finished:
                parsed.extend(self.reasoning.finish())
            reasoning, text = parsed.reasoning, parsed.content
        if self.tools is None:
            return reasoning, ParsedDelta(content=text)
        rest = self.tools.feed(text)
        if finished:
            rest.extend(self.tools.finish())
        return reasoning, rest

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole answer; content is None where it is only calls or only
        reasoning."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
        return reasoning, None if reasoning is not None and not content else content, calls


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_body(delta: ToolCallDelta) -> dict[str, Any]:
    body: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.arguments}}
    if delta.id is not None:
        body |= {"id": delta.id, "type": "function"}
        body["function"]["name"] = delta.name
    return body


def assistant_message(
    content: str | None, calls: list[ToolCall], choice: ToolChoice | None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls and choice is not None and choice.legacy:
        message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
    elif calls:
        message["tool_calls"] = [tool_call_body(c) for c in calls]
    return message


def call_finish_reason(reason: str | None, called: bool, choice: ToolChoice | None) -> str | None:
    """A complete answer that called tools ends with ``tool_calls`` (``function_call``, legacy)."""
    if called and reason == "stop":
        return "function_call" if choice is not None and choice.legacy else "tool_calls"
    return finish_reason(reason)


def usage_body(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chosen(position: dict[int, Logprob], token_id: int | None) -> tuple[int, Logprob]:
    """The sampled token's id and entry of one position (the engine puts it first)."""
    if token_id is not None and token_id in position:
        return token_id, position[token_id]
    return next(iter(position.items()))


def _ranked(position: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)


def _name(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """How logprobs name a token: its text, or vLLM's ``token_id:{id}`` (``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token or ""


def chat_logprobs(
    logprobs: list[dict[int, Logprob]], token_ids: list[int], top: int, as_ids: bool = False
) -> dict[str, Any]:
    content = []
    for i, position in enumerate(logprobs):
        chosen_id, chosen = _chosen(position, token_ids[i] if i < len(token_ids) else None)
        token = _name(chosen_id, chosen, as_ids)
        content.append(
            {
                "token": token,
                "logprob": chosen.logprob,
                "bytes": _token_bytes(token),
                "top_logprobs": [
                    {
                        "token": _name(tid, lp, as_ids),
                        "logprob": lp.logprob,
                        "bytes": _token_bytes(_name(tid, lp, as_ids)),
                    }
                    for tid, lp in _ranked(position)[:top]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    logprobs: Positions,
    token_ids: list[int],
    top: int,
    text_offset: int,
    first_token: str = "",
    as_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI's legacy logprobs. The first prompt token (echoed) has none: ``null``, its text `first_token`.
    The chosen token is among each position's ``top_logprobs`` besides the `top` most likely, as in vLLM."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for i, position in enumerate(logprobs):
        offsets.append(text_offset)
        if position is None:
            tokens.append(first_token)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen_id, chosen = _chosen(position, token_ids[i] if i < len(token_ids) else None)
            tokens.append(_name(chosen_id, chosen, as_ids))
            token_logprobs.append(chosen.logprob)
            top_logprobs.append(
                {tokens[-1]: chosen.logprob}
                | {_name(tid, lp, as_ids): lp.logprob for tid, lp in _ranked(position)[:top]}
            )
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs_body(positions: Positions | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, ``null`` for the first, else each candidate's logprob,
    rank and text under its token id."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in position.items()
        }
        for position in positions
    ]


def add_usage(usages: list[Usage | None]) -> Usage | None:
    if any(u is None for u in usages):
        return None
    return Usage(
        *(sum(getattr(u, f) for u in usages) for f in ("prompt_tokens", "completion_tokens", "total_tokens"))
    )


class ResponseBuilder:
    """Builds one request's response (or its chunks) with a stable id and creation time.

    `echoes` holds, per prompt, what an ``echo`` completion shows before its text (a bare string is the
    echoed text of a single prompt).
    """

    def __init__(
        self,
        request: GenerationRequest,
        echoes: list[Echo] | str = "",
        tool_format: str | None = None,
        reasoning_format: str | None = None,
    ) -> None:
        """`tool_format`, `reasoning_format`: the model's parsers, as the engine's ack named them."""
        self.request = request
        self.tool_format = tool_format
        self.reasoning_format = reasoning_format
        self._readers: dict[int, AnswerReader] = {}  # a stream's, per choice
        self._called: set[int] = set()  # choices whose stream has made a call
        self.id = answer_id(request)
        self.created = int(time.time())
        self.echoes = [Echo(echoes)] if isinstance(echoes, str) else echoes
        self._text_offsets: dict[int, int] = {}
        self._echoed: set[int] = set()  # prompts whose echo a stream has sent

    def _head(self, streaming: bool) -> dict[str, Any]:
        kind = self.request.kind
        return {
            "id": self.id,
            "object": (_CHUNK_OBJECT if streaming else _OBJECT)[kind],
            "created": self.created,
            "model": self.request.model,
        }

    def _index(self, prompt: int, index: int) -> int:
        return prompt * self.request.n + index

    def _usage(self, usage: Usage | None) -> Usage | None:
        """What the client is told: a prompt-only echo generated nothing it will see."""
        if usage is not None and self.request.prompt_only:
            return Usage(usage.prompt_tokens, 0, usage.prompt_tokens)
        return usage

    def _completion_choice(
        self,
        prompt: int,
        index: int,
        text: str,
        positions: Positions | None,
        token_ids: list[int],
        reason: str | None,
        echo: tuple[Positions | None, list[int]] | None,
    ) -> dict[str, Any]:
        """One completion choice; `echo` (the prompt's logprobs and token ids) puts the prompt first."""
        if self.request.prompt_only:
            text, positions, token_ids = "", [], []
        first_token = ""
        if echo is not None:
            text = self.echoes[prompt].text + text
            first_token = self.echoes[prompt].first_token
            if echo[0] is not None:
                positions, token_ids = echo[0] + (positions or []), echo[1] + token_ids
        logprobs = None
        if self.request.logprobs and positions:
            choice = self._index(prompt, index)
            offset = self._text_offsets.get(choice, 0)
            top = self.request.params.logprobs or 0
            as_ids = self.request.token_ids_as_tokens
            logprobs = completion_logprobs(positions, token_ids, top, offset, first_token, as_ids)
            self._text_offsets[choice] = offset + sum(len(t) for t in logprobs["tokens"])
        return {
            "index": self._index(prompt, index),
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(reason),
        }

    def full(self, results: GenerationResult | list[GenerationResult]) -> dict[str, Any]:
        results = [results] if isinstance(results, GenerationResult) else results
        if self.request.best_of is not None:
            results = [likeliest(result, self.request.n) for result in results]
        choices = []
        for prompt, result in enumerate(results):
            for out in result.outputs:
                if self.request.kind == "chat":
                    logprobs = None
                    if self.request.logprobs and out.logprobs is not None:
                        logprobs = chat_logprobs(
                            out.logprobs,
                            out.token_ids,
                            self.request.params.logprobs or 0,
                            self.request.token_ids_as_tokens,
                        )
                    choice = self.request.tool_choice
                    reader = self._reader(choice, result.tool_parser, result.reasoning_parser)
                    reasoning, content, calls = reader.whole(out.text)
                    if self.request.echo_text:
                        content = self.request.echo_text + (content or "")
                    message = assistant_message(content, calls, choice)
                    if reader.reasoning is not None:
                        message["reasoning_content"] = reasoning
                    choices.append(
                        {
                            "index": out.index,
                            "message": message,
                            "logprobs": logprobs,
                            "finish_reason": call_finish_reason(out.finish_reason, bool(calls), choice),
                        }
                    )
                    continue
                echo = (result.prompt_logprobs, result.prompt_token_ids or []) if self.request.echo else None
                choices.append(
                    self._completion_choice(
                        prompt, out.index, out.text, out.logprobs, out.token_ids, out.finish_reason, echo
                    )
                )
                if self.request.prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = prompt_logprobs_body(result.prompt_logprobs)
        usage = add_usage([self._usage(r.usage) for r in results])
        body = {**self._head(False), "choices": choices, "usage": usage_body(usage)}
        if self.request.kind == "chat" and self.request.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_body(results[0].prompt_logprobs)
        return body

    def first_chunks(self) -> list[dict[str, Any]]:
        """What a chat stream starts with before any token: the assistant role."""
        if self.request.kind != "chat":
            return []
        role = {"role": "assistant", "content": self.request.echo_text}
        n = self.request.n
        return [
            self._chunk(
                [{"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(n)]
            )
        ]

    def delta_chunk(self, delta: RequestDelta, prompt: int = 0) -> dict[str, Any] | None:
        """The chunk of one engine delta of prompt number `prompt`; an echoing completion's first chunk of a
        prompt starts with the prompt."""
        choices = []
        echo = self.request.echo and prompt not in self._echoed
        self._echoed.add(prompt)
        for d in delta.outputs:
            finish = finish_reason(d.finish_reason)
            if not d.text and not d.token_ids and finish is None and not echo:
                continue
            if self.request.kind == "chat":
                chat = self._chat_delta(d)
                if chat is not None:
                    choices.append(chat)
                continue
            positions = d.logprobs if d.token_ids else None
            echoed = (delta.prompt_logprobs, delta.prompt_token_ids or []) if echo else None
            choices.append(
                self._completion_choice(prompt, d.index, d.text, positions, d.token_ids, finish, echoed)
            )
        return self._chunk(choices) if choices else None

    def _chat_delta(self, d: CompletionDelta) -> dict[str, Any] | None:
        logprobs = None
        if self.request.logprobs and d.token_ids and d.logprobs is not None:
            logprobs = chat_logprobs(
                d.logprobs, d.token_ids, self.request.params.logprobs or 0, self.request.token_ids_as_tokens
            )
        choice = self.request.tool_choice
        if d.index not in self._readers:
            self._readers[d.index] = self._reader(choice, self.tool_format, self.reasoning_format)
        reasoning, parsed = self._readers[d.index].feed(d.text, d.finish_reason is not None)
        finish = call_finish_reason(
            d.finish_reason, d.index in self._called or bool(parsed.tool_calls), choice
        )
        delta = tool_delta(parsed, choice)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if parsed.tool_calls:
            self._called.add(d.index)
        if not delta and finish is None:
            if not d.token_ids:
                return None
            delta = {"content": ""}  # text not said yet: the chunk still carries the token's logprobs
        return {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _reader(
        self, choice: ToolChoice | None, tool_format: str | None, reasoning_format: str | None
    ) -> AnswerReader:
        constrained = self.request.params.structured_outputs is not None
        return AnswerReader(choice, tool_format, reasoning_format, constrained)

    def usage_chunk(self, usages: list[Usage | None]) -> dict[str, Any]:
        usage = add_usage([self._usage(u) for u in usages])
        return {**self._head(True), "choices": [], "usage": usage_body(usage)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(True), "choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk carries the key; only the last one a value
        return chunk


def tool_delta(parsed: ParsedDelta, choice: ToolChoice | None) -> dict[str, Any]:
    """A chat chunk's ``delta`` of parsed text: its content and the pieces of calls."""
    delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
    if parsed.tool_calls and choice is not None and choice.legacy:
        first = [d for d in parsed.tool_calls if d.index == 0]
        if first:
            call: dict[str, Any] = {"arguments": "".join(d.arguments for d in first)}
            if first[0].name is not None:
                call["name"] = first[0].name
            delta["function_call"] = call
    elif parsed.tool_calls:
        delta["tool_calls"] = [tool_call_delta_body(d) for d in parsed.tool_calls]
    return delta
