"""OpenAI request bodies as pydantic models, and what the bus needs from them (prompts or messages,
`SamplingParams`).

One set of models serves the REST views, the WebSocket chat consumer and the Batch API, and `/openapi.json`
is generated from them. They are strict (JSON ``true`` is not a number, ``"5"`` is not an integer), refuse
unknown fields (``extra="forbid"``) and non-finite numbers, and carry the ranges `SamplingParams` enforces
again on the engine side. A refusal is a 400 whose ``param`` is the validation location in the body
(``messages[0].role``), so the engine only ever sees requests it can serve.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import SamplingParams, StructuredOutputsParams
from inference_engine.structured_outputs.grammars import check
from inference_engine.tool_parsers import required_schema
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The given `SamplingParams` fields; ``max_tokens`` always (None = the rest of the context)."""
        names = (
            set(SamplingFields.model_fields) - {"model", "stream", "stream_options", "user"} - _CONSTRAINTS
        )
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        values["max_tokens"] = self.max_tokens or conf.get("MAX_TOKENS_DEFAULT")
        return values


_CONSTRAINTS = {
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


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: str = Field(description="JSON text.")


class ToolCall(RequestModel):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = Field(
        None, description="Text, or text parts: a text model reads text."
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")
    function_call: FunctionCall | None = Field(None, description="An assistant's call (legacy functions).")

    def as_engine_message(self) -> dict[str, Any]:
        """What the engine's chat template reads. ``developer`` is OpenAI's newer name for ``system``; the
        legacy ``function`` role and ``function_call`` are a tool's result and a tool call."""
        content = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        )
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
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools.'
    )
    parallel_tool_calls: bool = True
    functions: Annotated[list[FunctionDefinition], Field(min_length=1)] | None = Field(
        None, description="Legacy form of tools."
    )
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(
        None, description="Legacy form of tool_choice."
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
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None

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
    return GenerationRequest(
        "chat",
        body.model,
        _sampling_params(values),
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        stream=body.stream,
        include_usage=include_usage,
        logprobs=body.logprobs,
    )


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
    values["structured_outputs"] = _constraint(body)
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
