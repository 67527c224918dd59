"""An item of a bulk job -> the engine request it stands for, and a finished request -> what is stored.

Template jobs send the filled template as one user message (chat), as the prompt (completion), or as the text
to embed (embed), with the job's parameters. Batch API items are whole /v1/chat/completions or
/v1/completions bodies, validated by the same `llmserve.api.schema.parse` as the REST API, or
/v1/embeddings bodies, run by the same `llmserve.api.embeddings.create`, so a batch line and the same REST
call are one request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference_engine.bus.client import GenerationResult
from inference_engine.errors import EngineError
from inference_engine.sampling_params import SamplingParams
from inference_engine.structured_outputs.grammars import check
from llmserve.api import errors, schema
from llmserve.api.embeddings import EmbeddingRequest
from llmserve.api.responses import ResponseBuilder
from llmserve.bulk.models import BulkJob

ENDPOINT_KINDS: dict[str, str] = {
    "/v1/chat/completions": BulkJob.Kind.CHAT,
    "/v1/completions": BulkJob.Kind.COMPLETION,
    "/v1/embeddings": BulkJob.Kind.EMBED,
}
EMBED_PARAMS = ("dimensions", "truncate_prompt_tokens")  # an embed job's parameters


class ItemError(Exception):
    """An item that can never succeed; recorded on the item as an OpenAI-style error."""

    def __init__(self, error: errors.APIError) -> None:
        super().__init__(error.message)
        self.error = error

    def as_json(self) -> dict[str, Any]:
        return {"status_code": self.error.status, **self.error.body()["error"]}


def engine_item_error(exc: EngineError) -> ItemError:
    return ItemError(errors.from_engine_error(exc))


@dataclass
class ItemRequest:
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    api: schema.GenerationRequest | None = None  # Batch API items: shapes the stored response body
    tools: list[dict[str, Any]] | None = None

    def stored(self, result: GenerationResult) -> dict[str, Any]:
        """The item fields to store for a finished generation."""
        usage = result.usage
        fields: dict[str, Any] = {
            "output": result.outputs[0].text if result.outputs else "",
            "prompt_tokens": usage.prompt_tokens if usage else result.prompt_tokens,
            "completion_tokens": usage.completion_tokens if usage else 0,
        }
        if self.api is not None:
            prompt_text = self.api.prompt if self.api.echo and isinstance(self.api.prompt, str) else ""
            fields["response"] = ResponseBuilder(self.api, prompt_text).full(result)
        return fields


@dataclass
class EmbedRequest:
    """An item that embeds: a /v1/embeddings request body. A template job's item stores its vector (base64
    float32) as its output; a Batch API item stores the whole answer as its response."""

    body: dict[str, Any]
    batch: bool

    def stored(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The item fields to store for the embeddings answer ``answer``."""
        fields: dict[str, Any] = {
            "output": "" if self.batch else answer["data"][0]["embedding"],
            "prompt_tokens": answer["usage"]["prompt_tokens"],
            "completion_tokens": 0,
        }
        if self.batch:
            fields["response"] = answer
        return fields


def check_job_params(kind: str, params: dict[str, Any]) -> None:
    """Refuse a template job's invalid parameters up front (not once per item)."""
    if kind != BulkJob.Kind.EMBED:
        job_params(params)
        return
    unknown = sorted(set(params) - set(EMBED_PARAMS))
    if unknown:
        raise errors.BadRequest(
            f"An embed job's parameters are {' and '.join(EMBED_PARAMS)}, not {', '.join(unknown)}.",
            param="params",
        )
    try:
        schema.validate(EmbeddingRequest, {"model": "-", "input": "-", **params})
    except errors.APIError as exc:
        raise errors.BadRequest(f"Invalid parameters: {exc.message}", param="params") from None


def job_params(params: dict[str, Any]) -> SamplingParams:
    """A template job's sampling parameters, refused up front when invalid (not once per item); a
    ``structured_outputs`` constraint (e.g. a JSON schema to extract into) is checked by llguidance too."""
    try:
        params = SamplingParams.from_dict(params or {})
        if params.structured_outputs is not None:
            check(params.structured_outputs)
        return params
    except EngineError as exc:
        raise errors.BadRequest(f"Invalid sampling parameters: {exc}", param="params") from None


def build(job: BulkJob, params: SamplingParams | None, item_input: Any) -> ItemRequest | EmbedRequest:
    """The request of one item; raises `ItemError` for an item that cannot be sent."""
    if not job.template:
        return _from_body(job, item_input)
    if not isinstance(item_input, dict):
        raise ItemError(errors.BadRequest("A template job's item must be an object of template fields."))
    try:
        text = job.template.format_map(item_input)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ItemError(
            errors.BadRequest(f"The template cannot be filled from this item: {exc!r}.")
        ) from None
    if job.kind == BulkJob.Kind.EMBED:
        body = {"model": job.model, "input": text, "encoding_format": "base64", **job.params}
        return EmbedRequest(body, batch=False)
    params = params or job_params(job.params)
    if job.kind == BulkJob.Kind.CHAT:
        return ItemRequest(None, [{"role": "user", "content": text}], params)
    return ItemRequest(text, None, params)


def _from_body(job: BulkJob, body: Any) -> ItemRequest | EmbedRequest:
    if not isinstance(body, dict):
        raise ItemError(errors.BadRequest("The request body must be a JSON object."))
    if job.kind == BulkJob.Kind.EMBED:
        _check_model(job, body.get("model"))
        return EmbedRequest(body, batch=True)
    try:
        request = schema.parse(job.kind, body)
    except errors.APIError as exc:
        raise ItemError(exc) from None
    if request.stream:
        raise ItemError(errors.BadRequest("Streaming is not available in a batch.", param="stream"))
    _check_model(job, request.model)
    return ItemRequest(request.prompt, request.messages, request.params, request, request.tools)


def _check_model(job: BulkJob, model: Any) -> None:
    if model != job.model:
        raise ItemError(
            errors.BadRequest(f"Every request of a batch must use model `{job.model}`.", param="model")
        )
