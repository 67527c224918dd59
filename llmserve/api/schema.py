"""OpenAI request bodies as pydantic models, and what the bus needs from them (prompts or messages,
`SamplingParams`).

One set of models serves the REST views, the WebSocket chat consumer and the Batch API, and `/openapi.json`
is generated from them. They are strict (JSON ``true`` is not a number, ``"5"`` is not an integer), refuse
unknown fields (``extra="forbid"``) and non-finite numbers, and carry the ranges `SamplingParams` enforces
again on the engine side. A refusal is a 400 whose ``param`` is the validation location in the body
(``messages[0].role``), so the engine only ever sees requests it can serve.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import SamplingParams
from llmserve import conf
from llmserve.api.errors import BadRequest

Kind = Literal["chat", "completion"]

MAX_LOGPROBS = 20


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _stop_strings(value: str | list[str] | None) -> str | list[str] | None:
    strings = [value] if isinstance(value, str) else value or []
    if any(not s for s in strings):
        raise ValueError("stop strings must not be empty")
    if len(strings) > 16:
        raise ValueError("at most 16 stop strings are allowed")
    return value


def _token_biases(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Checked here as a whole, so that every problem is reported as ``logit_bias`` (as OpenAI does)."""
    for token, bias in (value or {}).items():
        if not token.isdigit():
            raise ValueError(f"keys must be token ids, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise ValueError(f"biases must be numbers in [-100, 100], got {bias!r} for token {token}")
    return value


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stop_strings)]
LogitBias = Annotated[
    dict[str, Any] | None,
    AfterValidator(_token_biases),
    Field(json_schema_extra={"additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """The sampling fields chat and completion requests share (OpenAI's and vLLM's extra ones)."""

    model: Annotated[str, Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    seed: int | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Default: the rest of the model's context."
    )
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: LogitBias = None

    def sampling_values(self) -> dict[str, Any]:
        """The given `SamplingParams` fields; ``max_tokens`` always (None = the rest of the context)."""
        names = set(SamplingFields.model_fields) - {"model", "stream", "stream_options", "user"}
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        values["max_tokens"] = self.max_tokens or conf.get("MAX_TOKENS_DEFAULT")
        return values


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="Text, or text parts: a text model reads text."
    )
    name: str | None = None

    def as_engine_message(self) -> dict[str, str]:
        """What the engine's chat template reads. ``developer`` is OpenAI's newer name for ``system``."""
        content = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="A prompt (text or token ids), or a list of prompts answered in one response.")
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Default: the rest of the model's context. 0 (with `echo`): only the prompt's logprobs.",
    )
    logprobs: Logprobs | None = None
    echo: bool = False
    suffix: str | None = None


class ResponseInputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # on output_text parts a client sends back
    logprobs: list[dict[str, Any]] | None = None


class ResponseInputMessage(RequestModel):
    """A message of a Responses API ``input``; also what its ``output`` items look like when sent back."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponseInputText]
    id: str | None = None
    status: str | None = None

    def as_chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``: what the chat path serves of OpenAI's Responses API (text in, text out)."""

    model: Annotated[str, Field(min_length=1)]
    input: Annotated[str, Field(min_length=1)] | Annotated[list[ResponseInputMessage], Field(min_length=1)]
    instructions: str | None = Field(None, description="A system message for this response only.")
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None

    def input_messages(self) -> list[ChatMessage]:
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [item.as_chat_message() for item in self.input]


class TokenizeRequest(RequestModel):
    model: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="Default: the only served model."
    )
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="Default: the only served model."
    )
    tokens: list[Annotated[int, Field(ge=0)]]


class BatchRequestLine(RequestModel):
    """A line of a Batch API input file."""

    custom_id: Annotated[str, Field(min_length=1)]
    method: Literal["POST"] = "POST"
    url: str
    body: dict[str, Any]


Model = TypeVar("Model", bound=BaseModel)


def validate(model: type[Model], body: dict[str, Any]) -> Model:
    """`body` as `model`, or `BadRequest` about the first problem, its ``param`` the path into the body."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _bad_request(exc, body) from None


def _bad_request(exc: ValidationError, body: dict[str, Any]) -> BadRequest:
    problems = exc.errors(include_url=False)
    param = _param(problems[0]["loc"], body, problems[0]["type"] == "missing")
    # A field of several types fails once per type; say them all.
    reasons = [_reason(p) for p in problems if _param(p["loc"], body, p["type"] == "missing") == param]
    first = problems[0]["type"]
    code = (
        "unknown_parameter"
        if first == "extra_forbidden"
        else "missing_required_parameter"
        if first == "missing"
        else "invalid_type"
        if first.endswith("_type") or first in ("model_attributes_type", "union_tag_invalid")
        else "invalid_value"
    )
    if first == "extra_forbidden":
        return BadRequest(f"Unrecognized request argument supplied: {param}.", param=param, code=code)
    return BadRequest(f"`{param}`: {', or '.join(dict.fromkeys(reasons))}.", param=param, code=code)


def _reason(problem: dict[str, Any]) -> str:
    """pydantic's message, without what only a Python programmer would follow."""
    message = re.sub(r" or instance of \w+", "", problem["msg"].removeprefix("Value error, "))
    return message[0].lower() + message[1:]


def _param(loc: tuple[int | str, ...], body: Any, missing: bool) -> str | None:
    """The location of a validation error as a path into what was sent (``messages[0].content``).

    Locations also name the member of a union that failed (``list[str]``); only steps that exist in the
    body are kept, plus the last one for a missing field.
    """
    path, value = "", body
    for i, step in enumerate(loc):
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}" if path else step, value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif missing and i == len(loc) - 1 and isinstance(step, str):
            path = f"{path}.{step}" if path else step
    return path or None


# ------------------------------------------------------------------------------------- the bus request


@dataclass
class GenerationRequest:
    """A validated chat or completion request: what the bus needs, and what shapes the answer."""

    kind: Kind
    model: str
    params: SamplingParams
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False  # whether the answer carries logprobs (their count is params.logprobs)
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt's logprobs, nothing generated

    @property
    def prompt(self) -> str | list[int] | None:
        """The prompt of a single-prompt request."""
        return self.prompts[0] if self.prompts else None


def parse(kind: Kind, body: dict[str, Any], *, several_prompts: bool = False) -> GenerationRequest:
    """Validate an OpenAI /v1/completions or /v1/chat/completions body.

    A completion may hold a list of prompts only with `several_prompts` (the REST endpoint answers them in
    one response; a batch line or a chat message is one engine request).
    """
    if kind == "chat":
        return chat_request(validate(ChatCompletionRequest, body))
    return completion_request(validate(CompletionRequest, body), several_prompts)


def _stream_fields(body: SamplingFields) -> bool:
    if body.stream_options is not None and not body.stream:
        raise BadRequest("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    return body.stream_options is not None and body.stream_options.include_usage


def chat_request(body: ChatCompletionRequest) -> GenerationRequest:
    include_usage = _stream_fields(body)
    values = body.sampling_values()
    if body.max_completion_tokens is not None:
        values["max_tokens"] = body.max_completion_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("`top_logprobs` requires `logprobs` to be true.", param="top_logprobs")
    values["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    messages = [m.as_engine_message() for m in body.messages]
    _check_size(sum(len(m["content"]) for m in messages), "messages")
    return GenerationRequest(
        "chat",
        body.model,
        _sampling_params(values),
        messages=messages,
        stream=body.stream,
        include_usage=include_usage,
        logprobs=body.logprobs,
    )


def completion_request(body: CompletionRequest, several_prompts: bool = False) -> GenerationRequest:
    include_usage = _stream_fields(body)
    prompt = body.prompt
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], str | list) else [prompt]
    if len(prompts) > 1 and not several_prompts:
        raise BadRequest("Only one prompt per request is supported here.", param="prompt")
    if body.suffix is not None:
        raise BadRequest(
            "`suffix` needs a model whose template has fill-in-the-middle tokens; this one has none.",
            param="suffix",
        )
    values = body.sampling_values()
    prompt_only = body.max_tokens == 0
    if prompt_only:
        if not body.echo:
            raise BadRequest("`max_tokens` 0 is only allowed with `echo`.", param="max_tokens")
        # As vLLM: generate one token to get the prompt scored, and show none of it.
        values["max_tokens"] = 1
    if body.echo and body.logprobs is not None:
        values["prompt_logprobs"] = body.logprobs
    values["logprobs"] = body.logprobs
    _check_size(sum(len(p) for p in prompts), "prompt")
    return GenerationRequest(
        "completion",
        body.model,
        _sampling_params(values),
        prompts=prompts,
        stream=body.stream,
        include_usage=include_usage,
        echo=body.echo,
        logprobs=body.logprobs is not None,
        prompt_only=prompt_only,
    )


def _check_size(size: int, param: str) -> None:
    limit = conf.get("MAX_PROMPT_CHARS")
    if size > limit:
        raise BadRequest(
            f"The prompt has {size} characters; the limit is {limit}.", param=param, code="prompt_too_long"
        )


def _sampling_params(values: dict[str, Any]) -> SamplingParams:
    """What the models cannot check field by field (e.g. ``min_tokens`` against ``max_tokens``)."""
    try:
        return SamplingParams(**values)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc)) from None
