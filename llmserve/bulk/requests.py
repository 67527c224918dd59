"""An item of a bulk job -> the engine request it stands for, and a finished generation -> what is stored.

Template jobs send the filled template as one user message (chat) or as the prompt (completion), with the
job's sampling parameters. Batch API items are whole /v1/chat/completions or /v1/completions bodies, validated
by the same `llmserve.api.schema.parse` as the REST API, so a batch line and the same REST call are one
request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference_engine.bus.client import GenerationResult
from inference_engine.errors import EngineError
from inference_engine.sampling_params import SamplingParams
from inference_engine.structured_outputs.grammars import check
from llmserve.api import errors, schema
from llmserve.api.responses import ResponseBuilder
from llmserve.bulk.models import BulkJob

ENDPOINT_KINDS: dict[str, schema.Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


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


def build(job: BulkJob, params: SamplingParams | None, item_input: Any) -> ItemRequest:
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
    params = params or job_params(job.params)
    if job.kind == BulkJob.Kind.CHAT:
        return ItemRequest(None, [{"role": "user", "content": text}], params)
    return ItemRequest(text, None, params)


def _from_body(job: BulkJob, body: Any) -> ItemRequest:
    if not isinstance(body, dict):
        raise ItemError(errors.BadRequest("The request body must be a JSON object."))
    try:
        request = schema.parse(job.kind, body)
    except errors.APIError as exc:
        raise ItemError(exc) from None
    if request.stream:
        raise ItemError(errors.BadRequest("Streaming is not available in a batch.", param="stream"))
    if request.model != job.model:
        raise ItemError(
            errors.BadRequest(f"Every request of a batch must use model `{job.model}`.", param="model")
        )
    return ItemRequest(request.prompt, request.messages, request.params, request, request.tools)
