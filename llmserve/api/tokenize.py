"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extensions), answered by the model's own engine."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from inference_engine.errors import ModelNotFoundError
from llmserve import bus, conf
from llmserve.api import errors, schema
from llmserve.api.decorators import api_view
from llmserve.auth import Principal
from llmserve.models import ModelConfig


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.BadRequest("`model` is required and must be a non-empty string.", param="model")
    return model


async def _not_served(model: str) -> errors.APIError:
    configured = await ModelConfig.objects.filter(name=model, enabled=True).aexists()
    return errors.model_not_served(model, configured)


@api_view(("POST",), json_body=True)
async def tokenize(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    model = _model(body)
    if set(body) - {"model", "prompt", "messages"} or ("prompt" in body) == ("messages" in body):
        raise errors.BadRequest("Send `model` and exactly one of `prompt` (a string) and `messages`.")
    prompt = messages = None
    if "messages" in body:
        messages = schema.parse("chat", {"model": model, "messages": body["messages"]}).messages
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise errors.BadRequest("`prompt` must be a string.", param="prompt", code="invalid_type")
        if len(prompt) > conf.get("MAX_PROMPT_CHARS"):
            raise errors.BadRequest("The prompt is too long.", param="prompt", code="prompt_too_long")
    try:
        result = await bus.async_client().tokenize(model, prompt, messages=messages)
    except ModelNotFoundError:
        raise await _not_served(model) from None
    return JsonResponse(
        {"tokens": result.token_ids, "count": len(result.token_ids), "max_model_len": result.max_model_len}
    )


@api_view(("POST",), json_body=True)
async def detokenize(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    model = _model(body)
    tokens = body.get("tokens")
    if not schema.is_token_ids(tokens, allow_empty=True):
        raise errors.BadRequest(
            "`tokens` must be an array of token ids.", param="tokens", code="invalid_type"
        )
    try:
        text = await bus.async_client().detokenize(model, tokens)
    except ModelNotFoundError:
        raise await _not_served(model) from None
    return JsonResponse({"prompt": text})
