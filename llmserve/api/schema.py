"""OpenAI request bodies as pydantic models, and what the bus needs from them (prompts or messages,
`SamplingParams`).

One set of models serves the REST views, the WebSocket chat consumer and the Batch API, and `/openapi.json`
is generated from them. They accept what OpenAI's and vLLM's clients send: ``null`` for any optional field
(its default), every documented field (those the engine cannot honour are accepted, ignored and logged),
and fields they do not know, which vLLM ignores and logs too (once per name), or refuses with
``LLMSERVE["REJECT_UNKNOWN_FIELDS"]``. Known fields are checked strictly (JSON ``true`` is not a number,
``"5"`` is not an integer, no non-finite numbers), with the ranges `SamplingParams` enforces again on the
engine side. A refusal is a 400 whose ``param`` is the validation location in the body
(``messages[0].role``), so the engine only ever sees requests it can serve.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import (
    LOGIT_BIAS,
    MAX_STOP_STRINGS,
    RANGES,
    SamplingParams,
    StructuredOutputsParams,
)
from inference_engine.structured_outputs.grammars import check
from inference_engine.tool_parsers import required_schema
from llmserve import conf
from llmserve.api.errors import BadRequest

log = logging.getLogger("llmserve.api")

Kind = Literal["chat", "completion"]

MAX_BEST_OF = 20
_IGNORED = "x-llmserve-ignored"


def ignored(annotation_description: str = "") -> Any:
    """A documented OpenAI field the engine cannot honour: accepted (checked as documented), then ignored
    with a warning in the log, once per field name."""
    note = "Accepted and ignored" + (f": {annotation_description}" if annotation_description else "") + "."
    return Field(None, description=note, json_schema_extra={_IGNORED: True})


def _null_allowed(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Documents that every optional field takes ``null`` (for its default), as OpenAI's API does."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        prop = schema.get("properties", {}).get(key)
        if prop is None or info.is_required() or info.default is None:
            continue
        meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        schema["properties"][key] = {"anyOf": [prop, {"type": "null"}], **meta}


class RequestModel(BaseModel):
    model_config = ConfigDict(
        extra="ignore", strict=True, allow_inf_nan=False, json_schema_extra=_null_allowed
    )

    @model_validator(mode="wrap")
    @classmethod
    def _lenient(cls, data: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        """``null`` stands for a field's default; fields the model does not know, and documented ones it
        ignores, are noted in the validation context (`validate` logs or refuses them)."""
        if not isinstance(data, dict):
            return handler(data)
        known, defaults = _fields(cls)
        data = {k: v for k, v in data.items() if not (v is None and k in defaults)}
        model = handler(data)
        context = info.context
        if isinstance(context, Fields):
            context.unknown.update(k for k in data if k not in known)
            context.ignored.update(k for k in data if known.get(k) and data[k] is not None)
        return model


@functools.cache
def _fields(model: type[BaseModel]) -> tuple[dict[str, bool], set[str]]:
    """({name or alias: whether it is ignored}, the names of fields whose default is not None)."""
    known: dict[str, bool] = {}
    defaults: set[str] = set()
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        for key in {name, info.alias or name}:
            known[key] = bool(extra.get(_IGNORED))
            if not info.is_required() and info.default is not None:
                defaults.add(key)
    return known, defaults


@dataclass
class Fields:
    """The validation context: fields a request sent that its model does not know, or knows and ignores."""

    unknown: set[str] = field(default_factory=set)
    ignored: set[str] = field(default_factory=set)


_logged: set[str] = set()  # field names already logged (bounded: clients choose the names)
_MAX_LOGGED = 1024


def _stop_strings(value: str | list[str] | None) -> str | list[str] | None:
    strings = [value] if isinstance(value, str) else value or []
    if any(not s for s in strings):
        raise ValueError("stop strings must not be empty")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    return value


def _token_biases(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Checked here as a whole, so that every problem is reported as ``logit_bias`` (as OpenAI does)."""
    for token, bias in (value or {}).items():
        if not token.isdigit():
            raise ValueError(f"keys must be token ids, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or bias not in LOGIT_BIAS:
            raise ValueError(f"biases must be numbers {LOGIT_BIAS}, got {bias!r} for token {token}")
    return value


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stop_strings)]
LogitBias = Annotated[
    dict[str, Any] | None,
    AfterValidator(_token_biases),
    Field(json_schema_extra={"additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
]


def bounded(kind: type, name: str) -> Any:
    """A number type with `SamplingParams`' bounds for the option `name` (`RANGES`: one definition)."""
    return Annotated[kind, Field(**RANGES[name].field())]


Logprobs = bounded(int, "logprobs")
RequestId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Metadata = Annotated[dict[str, str], Field(max_length=16)]


class StreamOptions(RequestModel):
    include_usage: bool = False


JsonSchema = dict[str, Any]
Choices = Annotated[list[str], Field(min_length=1)]


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema", description="Default: any JSON object.")
    strict: bool | None = None


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: JsonSchema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = Field(None, description="Lark, or llama.cpp's GBNF.")
    json_object: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingFields(RequestModel):
    """The sampling fields chat and completion requests share (OpenAI's and vLLM's extra ones)."""

    model: Annotated[str, Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop: Stop = None
    n: bounded(int, "n") | None = None
    temperature: bounded(float, "temperature") | None = None
    top_p: bounded(float, "top_p") | None = None
    top_k: bounded(int, "top_k") | None = None
    min_p: bounded(float, "min_p") | None = None
    presence_penalty: bounded(float, "presence_penalty") | None = None
    frequency_penalty: bounded(float, "frequency_penalty") | None = None
    repetition_penalty: bounded(float, "repetition_penalty") | None = None
    seed: int | None = None
    max_tokens: bounded(int, "max_tokens") | None = Field(
        None, description="Default: the rest of the model's context."
    )
    min_tokens: bounded(int, "min_tokens") | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: LogitBias = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's extras
    prompt_logprobs: Logprobs | None = Field(
        None, description="Logprobs of each prompt token (vLLM's `prompt_logprobs`); not with `stream`."
    )
    truncate_prompt_tokens: int | None = Field(
        None, description="Keep only the prompt's last N tokens (-1: as many as the context holds)."
    )
    return_tokens_as_token_ids: bool | None = Field(
        None, description='Logprobs name tokens as "token_id:{id}".'
    )
    priority: int = Field(
        0, description="Lower runs earlier; above 0 waits behind interactive requests, as bulk jobs do."
    )
    request_id: RequestId | None = Field(None, description="The id's suffix of the answer (default: random).")
    # OpenAI's fields that change nothing here
    store: bool | None = ignored("nothing is stored for distillation or evals")
    metadata: Metadata | None = ignored("nothing is stored")
    service_tier: str | None = ignored("there is one tier")
    prompt_cache_key: str | None = ignored("the prefix cache needs no hint")
    safety_identifier: str | None = ignored()

    def sampling_values(self) -> dict[str, Any]:
        """The given `SamplingParams` fields; ``max_tokens`` always (None = the rest of the context)."""
        names = set(SamplingFields.model_fields) - _NOT_SAMPLING - CONSTRAINT_FIELDS
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        values["max_tokens"] = self.max_tokens or conf.get("MAX_TOKENS_DEFAULT")
        return values


_NOT_SAMPLING = {
    "model",
    "stream",
    "stream_options",
    "user",
    "return_tokens_as_token_ids",
    "priority",
    "request_id",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
}
CONSTRAINT_FIELDS = {  # the fields that may name an output constraint
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
}
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class RefusalPart(RequestModel):
    """An assistant's refusal, as an answer sent back carries it."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: str = Field(description="JSON text.")


class ToolCall(RequestModel):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = Field(
        None, description="Text, or text parts: a text model reads text."
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")
    function_call: FunctionCall | None = Field(None, description="An assistant's call (legacy functions).")
    # What an answer carries when a client sends it back (the openai SDK's `message.model_dump()`)
    refusal: str | None = Field(None, description="An assistant's refusal: the template reads it as text.")
    annotations: list[dict[str, Any]] | None = ignored()
    audio: dict[str, Any] | None = ignored("no audio answers")

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = self.content or []
        text = "".join(p.text if isinstance(p, TextPart) else p.refusal for p in parts)
        return text or (self.refusal or "")

    def as_engine_message(self) -> dict[str, Any]:
        """What the engine's chat template reads. ``developer`` is OpenAI's newer name for ``system``; the
        legacy ``function`` role and ``function_call`` are a tool's result and a tool call."""
        content = self.text
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        message: dict[str, Any] = {"role": role, "content": content}
        calls = self.tool_calls or (
            [ToolCall(id=f"call_{self.function_call.name}", function=self.function_call)]
            if self.function_call
            else []
        )
        if calls:
            message["tool_calls"] = [call.model_dump() for call in calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="A JSON schema; default: no parameters.")
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools.'
    )
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = Field(None, description="Legacy form of tools.")
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(
        None, description="Legacy form of tool_choice."
    )
    modalities: list[Literal["text", "audio"]] | None = Field(None, description='Only ["text"] here.')
    reasoning_effort: str | None = ignored("the model does not reason before it answers")
    verbosity: Literal["low", "medium", "high"] | None = ignored()
    prediction: dict[str, Any] | None = ignored("no predicted outputs")
    audio: dict[str, Any] | None = ignored("no audio answers")
    web_search_options: dict[str, Any] | None = ignored("no web search")
    # vLLM's extras
    echo: bool = Field(
        False, description="The answer starts with the last message's text if it is the assistant's."
    )
    add_generation_prompt: bool = Field(True, description="Open the assistant's turn after the messages.")
    continue_final_message: bool = Field(
        False, description="Continue the last (assistant) message instead of starting a new turn."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="More variables for the chat template (e.g. `enable_thinking`)."
    )


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
    best_of: Annotated[int, Field(ge=1, le=MAX_BEST_OF)] | None = Field(
        None, description="Generate this many and answer the `n` likeliest; not with `stream`."
    )


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


class ResponseFunctionCall(RequestModel):
    """A ``function_call`` item: a call the model made, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionCallOutput(RequestModel):
    """A ``function_call_output`` item: the result of a call."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionTool(RequestModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class ResponseNamedToolChoice(RequestModel):
    type: Literal["function"]
    name: FunctionName


class ResponseJsonSchemaFormat(RequestModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseText(RequestModel):
    format: (
        Annotated[TextFormat | JsonObjectFormat | ResponseJsonSchemaFormat, Field(discriminator="type")]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = ignored()


class ResponseReasoning(RequestModel):
    effort: str | None = ignored("the model does not reason before it answers")
    summary: str | None = ignored()
    generate_summary: str | None = ignored()


ResponseInputItem = ResponseInputMessage | ResponseFunctionCall | ResponseFunctionCallOutput


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``: what the chat path serves of OpenAI's Responses API: text and messages in,
    text and function calls out, held to a JSON schema with ``text.format``."""

    model: Annotated[str, Field(min_length=1)]
    input: Annotated[str, Field(min_length=1)] | Annotated[list[ResponseInputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="A system message for this response only.")
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    include: list[str] | None = ignored("answers carry no extra data")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="Default: disabled (a conversation longer than the context is refused)."
    )
    reasoning: ResponseReasoning | None = None
    top_logprobs: Logprobs | None = ignored()
    background: Literal[False] | None = Field(None, description="Only false: responses are made at once.")
    max_tool_calls: Annotated[int, Field(ge=1)] | None = ignored()
    service_tier: str | None = ignored("there is one tier")
    prompt_cache_key: str | None = ignored("the prefix cache needs no hint")
    safety_identifier: str | None = ignored()

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages: function calls in a row become one assistant message's calls, their
        outputs tool messages."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, ResponseFunctionCall):
                call = ToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                    messages[-1].tool_calls.append(call)
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif isinstance(item, ResponseFunctionCallOutput):
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
            else:
                messages.append(item.as_chat_message())
        return messages

    def chat_fields(self) -> dict[str, Any]:
        """Its tools, tool choice and output format as the chat request's fields."""
        fields: dict[str, Any] = {"parallel_tool_calls": self.parallel_tool_calls}
        if self.tools is not None:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, ResponseNamedToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, ResponseJsonSchemaFormat):
            json_schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            fields["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        return fields


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


def validate(model: type[Model], body: dict[str, Any], reject_unknown: bool | None = None) -> Model:
    """`body` as `model`, or `BadRequest` about the first problem, its ``param`` the path into the body.

    Fields no model knows are refused if `reject_unknown` (default: ``REJECT_UNKNOWN_FIELDS``), else ignored;
    they and the documented fields that are ignored are logged once per name (per process)."""
    # A batch line's body is checked when its request runs: the line's own error, the rest of the batch runs.
    checked = {k: v for k, v in body.items() if k != "body"} if model is BatchRequestLine else body
    where = lone_surrogate(checked)
    if where is not None:
        raise BadRequest(
            f"`{where}` holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not text.",
            param=where,
            code="invalid_value",
        )
    fields = Fields()
    try:
        validated = model.model_validate(body, context=fields)
    except ValidationError as exc:
        raise _bad_request(exc, body) from None
    if reject_unknown is None:
        reject_unknown = conf.get("REJECT_UNKNOWN_FIELDS")
    if fields.unknown and reject_unknown:
        param = _find_key(body, sorted(fields.unknown)) or sorted(fields.unknown)[0]
        raise BadRequest(
            f"Unrecognized request argument supplied: {param}.", param=param, code="unknown_parameter"
        )
    for what, names in (("unknown", fields.unknown), ("unsupported", fields.ignored)):
        for name in sorted(names - _logged)[: max(0, _MAX_LOGGED - len(_logged))]:
            _logged.add(name)
            log.warning("ignored the %s request field %r (logged once per field name)", what, name)
    return validated


def lone_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key of a decoded JSON body that holds a lone
    UTF-16 surrogate: JSON's escapes can carry one, but no UTF-8 text can, so the tokenizer, Redis and the
    database would each fail on it. None when there is none."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = str(key).encode(errors="backslashreplace").decode()  # the path itself is text
                child_path = f"{path}.{name}" if path else name
                stack.append((child_path, child))
                stack.append((child_path, key))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def _find_key(value: Any, names: list[str], path: str = "") -> str | None:
    """The path of the first of `names` found as a key in `value`, breadth first."""
    if isinstance(value, dict):
        for name in names:
            if name in value:
                return f"{path}.{name}" if path else name
        children = [(f"{path}.{k}" if path else k, v) for k, v in value.items()]
    elif isinstance(value, list):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for child_path, child in children:
        found = _find_key(child, names, child_path)
        if found is not None:
            return found
    return None


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
class ToolChoice:
    """How an answer's tool calls are written: ``auto`` (in the model's own format, found by its parser),
    ``required`` (a JSON array of calls) or ``named`` (the arguments of `function`), held by the grammar for
    the last two. `legacy`: the request used ``functions``, so the answer uses ``function_call``."""

    mode: Literal["auto", "required", "named"]
    function: str | None = None
    legacy: bool = False


@dataclass
class GenerationRequest:
    """A validated chat or completion request: what the bus needs, and what shapes the answer."""

    kind: Kind
    model: str
    params: SamplingParams
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # for the chat template
    tool_choice: ToolChoice | None = None  # how to read tool calls in the answer; None: there are none
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False  # whether the answer carries logprobs (their count is params.logprobs)
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt's logprobs, nothing generated
    chat_options: dict[str, Any] | None = None  # how the template renders `messages` (vLLM's fields)
    echo_text: str = ""  # a chat answer's start: the final assistant message it continues (chat `echo`)
    prompt_logprobs: bool = False  # the answer carries vLLM's `prompt_logprobs`
    token_ids_as_tokens: bool = False  # logprobs name tokens "token_id:{id}"
    best_of: int | None = None  # generated per prompt (params.n); the answer keeps the `n` likeliest
    n: int = 1  # choices per prompt in the answer
    priority: int = 0
    request_id: str | None = None  # the client's: the answer's id ends with it, and it names the bus request

    @property
    def prompt(self) -> str | list[int] | None:
        """The prompt of a single-prompt request."""
        return self.prompts[0] if self.prompts else None


def parse(
    kind: Kind,
    body: dict[str, Any],
    *,
    several_prompts: bool = False,
    reject_unknown: bool | None = None,
    min_priority: int | None = None,
) -> GenerationRequest:
    """Validate an OpenAI /v1/completions or /v1/chat/completions body.

    A completion may hold a list of prompts only with `several_prompts` (the REST endpoint answers them in
    one response; a batch line or a chat message is one engine request). `reject_unknown`: see `validate`.
    `min_priority`: the most urgent `priority` the caller may ask for (None: LLMSERVE['MIN_PRIORITY']).
    """
    if kind == "chat":
        return chat_request(validate(ChatCompletionRequest, body, reject_unknown), min_priority)
    return completion_request(
        validate(CompletionRequest, body, reject_unknown), several_prompts, min_priority
    )


def _stream_fields(body: SamplingFields) -> bool:
    if body.stream_options is not None and not body.stream:
        raise BadRequest("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    return body.stream_options is not None and body.stream_options.include_usage


def _common(body: SamplingFields, min_priority: int | None) -> dict[str, Any]:
    """The GenerationRequest fields chat and completions share: vLLM's extras and the stream options."""
    if body.prompt_logprobs is not None and body.stream:
        raise BadRequest("`prompt_logprobs` is not available with `stream`.", param="prompt_logprobs")
    floor = conf.get("MIN_PRIORITY") if min_priority is None else min_priority
    if body.priority < floor:
        raise BadRequest(f"`priority` must be at least {floor} here.", param="priority")
    return {
        "stream": body.stream,
        "include_usage": _stream_fields(body),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "token_ids_as_tokens": bool(body.return_tokens_as_token_ids),
        "priority": body.priority,
        "request_id": body.request_id,
    }


def chat_request(body: ChatCompletionRequest, min_priority: int | None = None) -> GenerationRequest:
    common = _common(body, min_priority)
    values = body.sampling_values()
    if body.max_completion_tokens is not None:
        values["max_tokens"] = body.max_completion_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("`top_logprobs` requires `logprobs` to be true.", param="top_logprobs")
    values["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    messages = [m.as_engine_message() for m in body.messages]
    tools, tool_choice, tool_constraint = _tools(body)
    constraint = _constraint(body)
    if tool_constraint is not None:
        if constraint is not None:
            raise BadRequest(
                "A required or named `tool_choice` cannot be combined with another output constraint.",
                param="tool_choice",
            )
        constraint = tool_constraint
    values["structured_outputs"] = constraint
    _check_size(sum(len(m["content"]) for m in messages) + len(json.dumps(tools or [])), "messages")
    params = _sampling_params(values)
    return GenerationRequest(
        "chat",
        body.model,
        params,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        logprobs=body.logprobs,
        chat_options=_chat_options(body),
        echo_text=messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else "",
        n=params.n,
        **common,
    )


def _chat_options(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """How the engine renders the messages, where it differs from a new assistant turn."""
    if "audio" in (body.modalities or []):
        raise BadRequest(
            'This model answers in text only: `modalities` may only hold "text".', param="modalities"
        )
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise BadRequest(
                "`continue_final_message` continues the last message: set `add_generation_prompt` to false.",
                param="continue_final_message",
            )
        if body.messages[-1].role != "assistant":
            raise BadRequest(
                "`continue_final_message` needs the last message to be the assistant's.",
                param="continue_final_message",
            )
    options: dict[str, Any] = {}
    if not body.add_generation_prompt:
        options["add_generation_prompt"] = False
    if body.continue_final_message:
        options["continue_final_message"] = True
    if body.chat_template_kwargs:
        options["chat_template_kwargs"] = body.chat_template_kwargs
    return options or None


def _tools(
    body: ChatCompletionRequest,
) -> tuple[list[dict[str, Any]] | None, ToolChoice | None, StructuredOutputsParams | None]:
    """(tools for the template, how to read the answer's calls, the constraint that enforces them)."""
    legacy = body.functions is not None
    if legacy and body.tools is not None:
        raise BadRequest("Give `tools` or the legacy `functions`, not both.", param="functions")
    functions = body.functions if legacy else [t.function for t in body.tools or []]
    choice = body.function_call if legacy else body.tool_choice
    param = "function_call" if legacy else "tool_choice"
    if not functions:
        if choice not in (None, "none"):
            raise BadRequest(f"`{param}` needs `{'functions' if legacy else 'tools'}`.", param=param)
        return None, None, None
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise BadRequest("Function names must be unique.", param="functions" if legacy else "tools")
    if choice == "none":
        return None, None, None
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]
    if choice in (None, "auto"):
        return tools, ToolChoice("auto", legacy=legacy), None
    if choice == "required":
        schema = required_schema([t["function"] for t in tools], body.parallel_tool_calls)
        return tools, ToolChoice("required", legacy=legacy), _checked({"json": schema}, "tools")
    name = choice.name if legacy else choice.function.name
    if name not in names:
        raise BadRequest(f"`{param}` names `{name}`, which is not among the functions given.", param=param)
    index = names.index(name)
    schema = functions[index].parameters or {"type": "object", "properties": {}}
    field = f"functions[{index}].parameters" if legacy else f"tools[{index}].function.parameters"
    return tools, ToolChoice("named", name, legacy), _checked({"json": schema}, field)


def _constraint(body: SamplingFields) -> StructuredOutputsParams | None:
    """The output constraint of `response_format`, `structured_outputs` or vLLM's ``guided_*`` fields (one
    of them), checked by llguidance: a bad schema, regex or grammar is a 400 naming its field."""
    given: list[tuple[dict[str, Any], str]] = []
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        given.append(({"json_object": True}, "response_format"))
    elif isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        given.append(({"json": schema}, "response_format.json_schema.schema"))
    if body.structured_outputs is not None:
        values = body.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        given.append((values, "structured_outputs"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            given.append(({kind: value}, f"guided_{kind}"))
    if len(given) > 1:
        raise BadRequest(
            f"Give one output constraint, not {' and '.join(f'`{p}`' for _, p in given)}.", param=given[1][1]
        )
    if not given:
        if body.guided_whitespace_pattern is not None:
            raise BadRequest(
                "`guided_whitespace_pattern` needs `guided_json`.", param="guided_whitespace_pattern"
            )
        return None
    values, param = given[0]
    if body.guided_whitespace_pattern is not None:
        values["whitespace_pattern"] = body.guided_whitespace_pattern
    return _checked(values, param)


def _checked(values: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        spec = StructuredOutputsParams(**values)
        check(spec)
    except InvalidRequestError as exc:
        # The engine names vLLM's field; the client gets the one it sent.
        inner = (exc.param or "").removeprefix("structured_outputs")
        field = param + inner if param == "structured_outputs" else param
        raise BadRequest(str(exc), param=field) from None
    return spec


def completion_request(
    body: CompletionRequest, several_prompts: bool = False, min_priority: int | None = None
) -> GenerationRequest:
    common = _common(body, min_priority)
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
    values["structured_outputs"] = _constraint(body)
    prompt_only = body.max_tokens == 0
    if prompt_only:
        if not body.echo:
            raise BadRequest("`max_tokens` 0 is only allowed with `echo`.", param="max_tokens")
        # As vLLM: generate one token to get the prompt scored, and show none of it.
        values["max_tokens"] = 1
    if body.echo and body.logprobs is not None:
        values["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
    values["logprobs"] = body.logprobs
    n = body.n or 1
    if body.best_of is not None:
        if body.best_of < n:
            raise BadRequest(f"`best_of` must be at least `n` ({n}).", param="best_of")
        if body.stream and body.best_of > n:
            raise BadRequest("`best_of` above `n` cannot be streamed.", param="best_of")
        # The likeliest candidates are chosen by their tokens' logprobs.
        values["n"] = body.best_of
        values["logprobs"] = body.logprobs or 0
    _check_size(sum(len(p) for p in prompts), "prompt")
    return GenerationRequest(
        "completion",
        body.model,
        _sampling_params(values),
        prompts=prompts,
        echo=body.echo,
        logprobs=body.logprobs is not None,
        prompt_only=prompt_only,
        best_of=body.best_of if body.best_of is not None and body.best_of > n else None,
        n=n,
        **common,
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
        raise BadRequest(str(exc), param=getattr(exc, "param", None)) from None
