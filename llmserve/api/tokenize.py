"""vLLM's tokenizer endpoints, answered by the model's own engine: ``POST /tokenize``, ``POST /detokenize``
and ``GET /tokenizer_info`` (what lm-eval's remote tokenizer reads). Without ``model`` they use the only
served model, as vLLM (which serves one) does."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from inference_engine.errors import ModelNotFoundError
from llmserve import bus, conf
from llmserve.api import errors, schema
from llmserve.api.decorators import api_view
from llmserve.api.models import served_models
from llmserve.auth import Principal
from llmserve.models import ModelConfig


async def _model(name: str | None) -> str:
    if name is not None:
        return name
    served = list(await served_models())
    if len(served) != 1:
        raise errors.BadRequest(
            f"`model` is required: {len(served)} models are served, not one.",
            param="model",
            code="missing_required_parameter",
        )
    return served[0]


async def _not_served(model: str) -> errors.APIError:
    configured = await ModelConfig.objects.filter(name=model, enabled=True).aexists()
    return errors.model_not_served(model, configured)


@api_view(("POST",), json_body=True)
async def tokenize(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    data = schema.validate(schema.TokenizeRequest, body)
    if (data.prompt is None) == (data.messages is None):
        raise errors.BadRequest("Send exactly one of `prompt` (a string) and `messages`.", param="prompt")
    if data.prompt is not None and len(data.prompt) > conf.get("MAX_PROMPT_CHARS"):
        raise errors.BadRequest("The prompt is too long.", param="prompt", code="prompt_too_long")
    messages = [m.as_engine_message() for m in data.messages] if data.messages else None
    model = await _model(data.model)
    try:
        result = await bus.async_client().tokenize(
            model,
            data.prompt,
            messages=messages,
            add_special_tokens=data.add_special_tokens,
            return_token_strs=data.return_token_strs,
        )
    except ModelNotFoundError:
        raise await _not_served(model) from None
    answer: dict[str, Any] = {
        "tokens": result.token_ids,
        "count": len(result.token_ids),
        "max_model_len": result.max_model_len,
    }
    if data.return_token_strs:
        answer["token_strs"] = result.token_strs
    return JsonResponse(answer)


@api_view(("POST",), json_body=True)
async def detokenize(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    data = schema.validate(schema.DetokenizeRequest, body)
    model = await _model(data.model)
    try:
        text = await bus.async_client().detokenize(model, data.tokens)
    except ModelNotFoundError:
        raise await _not_served(model) from None
    return JsonResponse({"prompt": text})


@api_view(("GET",))
async def tokenizer_info(request: HttpRequest, principal: Principal) -> HttpResponse:
    model = await _model(request.GET.get("model") or None)
    try:
        info = await bus.async_client().tokenizer_info(model)
    except ModelNotFoundError:
        raise await _not_served(model) from None
    return JsonResponse(info)
