"""OpenAI request bodies -> what the bus needs (prompt or messages, `SamplingParams`), validated.

Every check here answers 400 with the offending ``param``: types are checked strictly (JSON ``true`` is not a
number), ranges by `SamplingParams` itself, so the engine only ever sees requests it can serve. Pure
functions of the body, so the Batch API (Celery tasks) reuses them for its JSONL lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import SamplingParams
from llmserve import conf
from llmserve.api.errors import BadRequest

Kind = Literal["chat", "completion"]

_NUMBER = (int, float)
# Body field -> accepted JSON types; None is always accepted and means "default".
_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "n": (int,),
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "seed": (int,),
    "max_tokens": (int,),
    "min_tokens": (int,),
    "ignore_eos": (bool,),
    "stop_token_ids": (list,),
    "include_stop_str_in_output": (bool,),
    "skip_special_tokens": (bool,),
    "logit_bias": (dict,),
}
_COMMON_FIELDS = {"model", "stream", "stream_options", "user", "stop", *_SAMPLING_FIELDS}
_FIELDS: dict[Kind, set[str]] = {
    "chat": _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"},
    "completion": _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"},
}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class GenerationRequest:
    kind: Kind
    model: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False  # whether the answer carries logprobs (their count is params.logprobs)


def parse(kind: Kind, body: dict[str, Any]) -> GenerationRequest:
    """Validate an OpenAI /v1/completions or /v1/chat/completions body."""
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise BadRequest(
            f"Unrecognized request argument supplied: {unknown[0]}.",
            param=unknown[0],
            code="unknown_parameter",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a non-empty string.", param="model")
    stream = _typed(body, "stream", (bool,), False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest(
                "`stream_options` is only allowed when `stream` is true.", param="stream_options"
            )
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest(
                '`stream_options` must be an object like {"include_usage": true}.', param="stream_options"
            )
        include_usage = _typed(options, "include_usage", (bool,), False, param="stream_options.include_usage")
    _typed(body, "user", (str,), None)

    values = {name: _typed(body, name, types, None) for name, types in _SAMPLING_FIELDS.items()}
    values["stop"] = _stop(body.get("stop"))
    if kind == "chat":
        messages = _messages(body.get("messages"))
        prompt = None
        max_completion = _typed(body, "max_completion_tokens", (int,), None)
        if max_completion is not None:
            values["max_tokens"] = max_completion
        wants_logprobs = _typed(body, "logprobs", (bool,), False)
        top = _typed(body, "top_logprobs", (int,), None)
        if top is not None and not wants_logprobs:
            raise BadRequest("`top_logprobs` requires `logprobs` to be true.", param="top_logprobs")
        values["logprobs"] = (top or 0) if wants_logprobs else None
        echo = False
        size = sum(len(m["content"]) for m in messages)
    else:
        messages, prompt = None, _prompt(body.get("prompt"))
        if body.get("suffix") is not None:
            raise BadRequest("`suffix` is not supported.", param="suffix")
        values["logprobs"] = _typed(body, "logprobs", (int,), None)
        wants_logprobs = values["logprobs"] is not None
        echo = _typed(body, "echo", (bool,), False)
        if echo and wants_logprobs:
            raise BadRequest("`echo` together with `logprobs` is not supported.", param="echo")
        size = len(prompt)
    if size > conf.get("MAX_PROMPT_CHARS"):
        raise BadRequest(
            f"The prompt has {size} characters; the limit is {conf.get('MAX_PROMPT_CHARS')}.",
            param="messages" if kind == "chat" else "prompt",
            code="prompt_too_long",
        )
    if values["max_tokens"] is None:
        values["max_tokens"] = conf.get("MAX_TOKENS_DEFAULT")
    params = _sampling_params(values, renamed={"logprobs": "top_logprobs"} if kind == "chat" else {})
    return GenerationRequest(
        kind, model, params, prompt, messages, stream, include_usage, echo, wants_logprobs
    )


def _typed(
    body: dict[str, Any], name: str, types: tuple[type, ...], default: Any, param: str | None = None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass in Python but not a number in JSON.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        expected = " or ".join(_JSON_NAMES[t] for t in types)
        raise BadRequest(
            f"`{param or name}` must be {expected}, got {type(value).__name__} {value!r:.40}.",
            param=param or name,
            code="invalid_type",
        )
    return value


_JSON_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("`stop` must be a string or an array of strings.", param="stop", code="invalid_type")
    return value


def _prompt(value: Any) -> str | list[int]:
    # OpenAI also accepts a list of prompts; one request here is one engine request, so one prompt.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise BadRequest("`prompt` must not be empty.", param="prompt")
        return value
    if is_token_ids(value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise BadRequest(
            "Only one prompt per request is supported; send one request per prompt.", param="prompt"
        )
    raise BadRequest("`prompt` must be a non-empty string or array of token ids.", param="prompt")


def is_token_ids(value: Any, allow_empty: bool = False) -> bool:
    """A JSON array of integers (not booleans, which Python counts as ints)."""
    return (
        isinstance(value, list)
        and (allow_empty or bool(value))
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("`messages` must be a non-empty array.", param="messages")
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"`{param}` must be an object.", param=param)
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequest(
                f"`{param}.role` must be one of {', '.join(sorted(_ROLES))}.", param=param + ".role"
            )
        messages.append({"role": role, "content": _content(message.get("content"), param + ".content")})
    return messages


def _content(value: Any, param: str) -> str:
    """Message content as text: a string, or an array of text parts (all a text model reads)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise BadRequest(
                    f'`{param}` parts must be {{"type": "text", "text": ...}}; this model reads text only.',
                    param=param,
                )
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(
        f"`{param}` must be a string or an array of text parts.", param=param, code="invalid_type"
    )


def _sampling_params(values: dict[str, Any], renamed: dict[str, str]) -> SamplingParams:
    """`SamplingParams` from the body's values; `renamed` maps its field names back to the body's."""
    given = {k: v for k, v in values.items() if v is not None}
    if "logit_bias" in given:
        try:
            given["logit_bias"] = {int(k): float(v) for k, v in given["logit_bias"].items()}
        except (TypeError, ValueError):
            raise BadRequest("`logit_bias` must map token ids to numbers.", param="logit_bias") from None
    if "stop_token_ids" in given and not is_token_ids(given["stop_token_ids"], allow_empty=True):
        raise BadRequest("`stop_token_ids` must be an array of integers.", param="stop_token_ids")
    try:
        return SamplingParams(**given)
    except InvalidRequestError as exc:
        param = _param_of(str(exc))
        raise BadRequest(str(exc), param=renamed.get(param, param)) from None


def _param_of(message: str) -> str | None:
    """The parameter a SamplingParams message is about (it starts with the field name)."""
    head = message.split(" ", 1)[0]
    return head if head in _SAMPLING_FIELDS or head in ("stop", "logprobs") else None
