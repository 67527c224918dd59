"""The OpenAPI document of the API (``GET /openapi.json``), generated from the request models the views
validate with and the response models below, which describe what the views return (the schema-driven
fuzz test checks every answer against them)."""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from llmserve.api import schema
from llmserve.api.embeddings import EmbeddingRequest


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal and failure, whatever the endpoint."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[TokenLogprob] | None


class FunctionCallBody(Body):
    name: str
    arguments: str


class ToolCallBody(Body):
    id: str
    type: Literal["function"]
    function: FunctionCallBody


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallBody] | None = None
    function_call: FunctionCallBody | None = None


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "function_call"] | None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class OutputText(Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(Body):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(Body):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(Body):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(Body):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    previous_response_id: str | None
    instructions: str | None
    usage: ResponseUsage | None
    metadata: dict[str, str]


class ItemList(Body):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Version(Body):
    version: str


class Deleted(Body):
    id: str
    object: str
    deleted: bool


class ModelObject(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelObject]


class Tokenized(Body):
    tokens: list[int]
    count: int
    max_model_len: int | None
    token_strs: list[str | None] | None = None


class Detokenized(Body):
    prompt: str


class TokenizerInfo(Body):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    model_max_length: int


class Embedding(Body):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a string with encoding_format "base64" (little-endian float32)


class EmbeddingUsage(Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Body):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Health(Body):
    status: Literal["ok", "unavailable"]


class BatchCreateRequest(schema.RequestModel):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's; `model`: the base model (optional while one served model takes adapters)."""

    lora_name: str
    lora_path: str  # a PEFT folder the engines can read
    model: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    model: str | None = None


class FileUpload(BaseModel):
    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


# (path, method, summary, request body model, 200 body model, authenticated)
_ENDPOINTS: list[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None, bool]] = [
    (
        "/v1/completions",
        "post",
        "Text completion (SSE with stream)",
        schema.CompletionRequest,
        Completion,
        True,
    ),
    (
        "/v1/chat/completions",
        "post",
        "Chat completion (SSE with stream)",
        schema.ChatCompletionRequest,
        ChatCompletion,
        True,
    ),
    (
        "/v1/responses",
        "post",
        "Create a response (SSE with stream)",
        schema.ResponsesRequest,
        ResponseObject,
        True,
    ),
    ("/v1/responses/{response_id}", "get", "Retrieve a stored response", None, ResponseObject, True),
    ("/v1/responses/{response_id}", "delete", "Delete a stored response", None, Deleted, True),
    (
        "/v1/responses/{response_id}/input_items",
        "get",
        "A stored response's input items",
        None,
        ItemList,
        True,
    ),
    ("/v1/embeddings", "post", "Embeddings of texts or token ids", EmbeddingRequest, EmbeddingList, True),
    ("/v1/models", "get", "Models live engines serve", None, ModelList, True),
    ("/v1/models/{model_id}", "get", "One served model", None, ModelObject, True),
    ("/tokenize", "post", "Tokenize a prompt or messages", schema.TokenizeRequest, Tokenized, True),
    ("/detokenize", "post", "Text of token ids", schema.DetokenizeRequest, Detokenized, True),
    ("/tokenizer_info", "get", "The tokenizer's special tokens and chat template", None, TokenizerInfo, True),
    (
        "/v1/load_lora_adapter",
        "post",
        "Serve a LoRA adapter on every replica of its base model (LLMSERVE['ALLOW_RUNTIME_LORA_UPDATING'])",
        LoadLoRAAdapterRequest,
        None,
        True,
    ),
    (
        "/v1/unload_lora_adapter",
        "post",
        "Stop serving a LoRA adapter (running requests finish)",
        UnloadLoRAAdapterRequest,
        None,
        True,
    ),
    ("/health", "get", "Whether the bus answers, with each model's replicas", None, Health, False),
    ("/ping", "get", "The same as /health (vLLM's name for SageMaker)", None, Health, False),
    ("/version", "get", "The server's version", None, Version, False),
    ("/metrics", "get", "Prometheus metrics", None, None, False),
    ("/v1/files", "post", "Upload a batch input file", FileUpload, Body, True),
    ("/v1/files", "get", "List the key's files", None, ItemList, True),
    ("/v1/files/{file_id}", "get", "A file's metadata", None, Body, True),
    ("/v1/files/{file_id}", "delete", "Delete a file", None, Deleted, True),
    ("/v1/files/{file_id}/content", "get", "A file's content", None, None, True),
    ("/v1/batches", "post", "Create a batch", BatchCreateRequest, Body, True),
    ("/v1/batches", "get", "List batches", None, Body, True),
    ("/v1/batches/{batch_id}", "get", "Retrieve a batch", None, Body, True),
    ("/v1/batches/{batch_id}/cancel", "post", "Cancel a batch", None, Body, True),
]
# Before OpenAPI 3.2, the schema of an event stream describes one event. Ours carry JSON in `data`
# (chat and completions end with the literal `[DONE]`); the Responses API also names each `event`.
_SERVER_SENT_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}

_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or unknown API key",
    "404": "Unknown model or object",
    "405": "Method not allowed",
    "411": "Upload without Content-Length",
    "413": "Body too large",
    "415": "Body not JSON",
    "429": "Rate limited or engine overloaded",
    "500": "Server failure",
    "503": "No engine serves the model",
}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": schema}


_PAGE = [
    _query("limit", {"type": "integer", "minimum": 1}),
    _query("after", {"type": "string"}),
    _query("order", {"enum": ["asc", "desc"]}),
]
_QUERIES = {
    ("/tokenizer_info", "get"): [_query("model", {"type": "string"})],
    ("/v1/files", "get"): [*_PAGE, _query("purpose", {"type": "string"})],
    ("/v1/responses/{response_id}/input_items", "get"): _PAGE,
    ("/v1/batches", "get"): _PAGE[:2],
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


@cache
def document() -> dict[str, Any]:
    models = {m for _, _, _, request, reply, _ in _ENDPOINTS for m in (request, reply) if m is not None}
    modes = [(m, "validation") for m in sorted(models | {ErrorResponse}, key=lambda m: m.__name__)]
    _, definitions = models_json_schema(modes, ref_template="#/components/schemas/{model}")
    error = {"application/json": {"schema": _ref(ErrorResponse)}}
    paths: dict[str, dict[str, Any]] = {}
    for path, method, summary, request, reply, authenticated in _ENDPOINTS:
        operation: dict[str, Any] = {"summary": summary, "operationId": f"{method}{path}", "responses": {}}
        names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if names:
            operation["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names
            ]
        if (path, method) in _QUERIES:
            operation.setdefault("parameters", []).extend(_QUERIES[path, method])
        if request is not None:
            media = "multipart/form-data" if request is FileUpload else "application/json"
            operation["requestBody"] = {"required": True, "content": {media: {"schema": _ref(request)}}}
        ok: dict[str, Any] = {"description": "OK"}
        if reply is not None:
            ok["content"] = {"application/json": {"schema": _ref(reply)}}
            if request is not None and "stream" in request.model_fields:
                ok["content"]["text/event-stream"] = {"schema": _SERVER_SENT_EVENT}
        else:
            ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        operation["responses"]["200"] = ok
        for status, description in _ERROR_STATUSES.items():
            operation["responses"][status] = {"description": description, "content": error}
        if authenticated:
            operation["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llmserve",
            "version": "1",
            "description": "OpenAI-compatible API of llmserve (and vLLM's tokenizer endpoints).",
        },
        "paths": paths,
        "components": {
            "schemas": definitions["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
