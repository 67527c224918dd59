"""OpenAI response bodies and stream chunks, built from what the bus returns.

Shapes follow the OpenAI API reference (and vLLM's server): ``chat.completion`` / ``chat.completion.chunk``
and ``text_completion`` objects, usage counts, finish reasons, and logprobs in each endpoint's own format.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from inference_engine.bus.client import GenerationResult
from inference_engine.bus.protocol import CompletionDelta, Usage
from inference_engine.outputs import Logprob
from llmserve.api.schema import GenerationRequest

_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}


def _finish_reason(reason: str | None) -> str | None:
    # "abort" only happens when the client went away; it never reaches a client, but keep the enum valid.
    return "stop" if reason == "abort" else reason


def _usage(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chosen(position: dict[int, Logprob], token_id: int | None) -> Logprob:
    """The sampled token's entry of one position (the engine puts it first)."""
    if token_id is not None and token_id in position:
        return position[token_id]
    return next(iter(position.values()))


def chat_logprobs(logprobs: list[dict[int, Logprob]], token_ids: list[int], top: int) -> dict[str, Any]:
    content = []
    for i, position in enumerate(logprobs):
        chosen = _chosen(position, token_ids[i] if i < len(token_ids) else None)
        token = chosen.decoded_token or ""
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        content.append(
            {
                "token": token,
                "logprob": chosen.logprob,
                "bytes": _token_bytes(token),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": _token_bytes(lp.decoded_token or ""),
                    }
                    for _, lp in ranked[:top]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    logprobs: list[dict[int, Logprob]], token_ids: list[int], top: int, text_offset: int
) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for i, position in enumerate(logprobs):
        chosen = _chosen(position, token_ids[i] if i < len(token_ids) else None)
        token = chosen.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(chosen.logprob)
        ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in ranked[:top]} if top else None)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


class ResponseBuilder:
    """Builds one request's response (or its chunks) with a stable id and creation time."""

    def __init__(self, request: GenerationRequest, prompt_text: str = "") -> None:
        self.request = request
        self.id = _ID_PREFIX[request.kind] + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_text = prompt_text  # echoed before completions with `echo`
        self._text_offsets: dict[int, int] = {}

    def _head(self, streaming: bool) -> dict[str, Any]:
        kind = self.request.kind
        return {
            "id": self.id,
            "object": (_CHUNK_OBJECT if streaming else _OBJECT)[kind],
            "created": self.created,
            "model": self.request.model,
        }

    def _logprobs(self, logprobs: list | None, token_ids: list[int], index: int) -> dict[str, Any] | None:
        if not self.request.logprobs or logprobs is None:
            return None
        top = self.request.params.logprobs or 0
        if self.request.kind == "chat":
            return chat_logprobs(logprobs, token_ids, top)
        offset = self._text_offsets.get(index, 0)
        result = completion_logprobs(logprobs, token_ids, top, offset)
        self._text_offsets[index] = offset + sum(len(t) for t in result["tokens"])
        return result

    def full(self, result: GenerationResult) -> dict[str, Any]:
        choices = []
        for out in result.outputs:
            logprobs = self._logprobs(out.logprobs, out.token_ids, out.index)
            if self.request.kind == "chat":
                choices.append(
                    {
                        "index": out.index,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": logprobs,
                        "finish_reason": _finish_reason(out.finish_reason),
                    }
                )
            else:
                text = self.prompt_text + out.text if self.request.echo else out.text
                choices.append(
                    {
                        "index": out.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": _finish_reason(out.finish_reason),
                    }
                )
        return {**self._head(False), "choices": choices, "usage": _usage(result.usage)}

    def first_chunks(self) -> list[dict[str, Any]]:
        """What a stream starts with before any token: the assistant role (chat) or the echoed prompt."""
        n = self.request.params.n
        if self.request.kind == "chat":
            return [
                self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(n)
                    ]
                )
            ]
        if self.request.echo and self.prompt_text:
            return [
                self._chunk(
                    [
                        {"index": i, "text": self.prompt_text, "logprobs": None, "finish_reason": None}
                        for i in range(n)
                    ]
                )
            ]
        return []

    def delta_chunk(self, outputs: list[CompletionDelta]) -> dict[str, Any] | None:
        choices = []
        for d in outputs:
            finish = _finish_reason(d.finish_reason)
            if not d.text and not d.token_ids and finish is None:
                continue
            logprobs = self._logprobs(d.logprobs, d.token_ids, d.index) if d.token_ids else None
            if self.request.kind == "chat":
                delta = {"content": d.text} if d.text or finish is None else {}
                choices.append(
                    {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                )
            else:
                choices.append(
                    {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": finish}
                )
        return self._chunk(choices) if choices else None

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": _usage(usage)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(True), "choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk carries the key; only the last one a value
        return chunk
