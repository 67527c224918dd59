"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}``, which reach every replica of the base model over the bus.

Served only with ``LLMSERVE["ALLOW_RUNTIME_LORA_UPDATING"]`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
and only to callers with an API key not limited to some models: they change what every client of the
deployment is served. ``lora_path`` is a folder the engines can read. The base model is the optional
``model`` field, else the only served model whose engines take adapters (load) or the one serving the
adapter (unload). Answers are vLLM's: 200 with a plain-text line; an adapter the engines cannot serve is a
400 naming the problem (the engines keep serving); unloading an unknown name is a 404. After an unload,
running requests with the adapter finish and new ones get a 404 ``model_not_found``.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse

from inference_engine.bus.protocol import ModelInfo
from llmserve import bus, conf
from llmserve.api import errors
from llmserve.api.decorators import api_view
from llmserve.api.models import served_models
from llmserve.auth import Principal


@api_view(("POST",), json_body=True)
async def load_lora_adapter(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    _check_allowed(principal)
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    served = await served_models()
    if name in served:
        raise errors.BadRequest(f"`{name}` is the name of a served model.", param="lora_name")
    model = _base_model(body, served, _takes_adapters, "takes LoRA adapters (--enable-lora)")
    await bus.async_client().load_lora_adapter(model, name, path, timeout=conf.get("ACK_TIMEOUT"))
    return HttpResponse(f"Success: LoRA adapter '{name}' added successfully.", content_type="text/plain")


@api_view(("POST",), json_body=True)
async def unload_lora_adapter(
    request: HttpRequest, body: dict[str, Any], principal: Principal
) -> HttpResponse:
    _check_allowed(principal)
    name = _text(body, "lora_name")
    served = await served_models()
    if body.get("model") is None and not any(name in info.adapters for info in served.values()):
        raise errors.NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    model = _base_model(body, served, lambda info: name in info.adapters, f"serves the adapter `{name}`")
    await bus.async_client().unload_lora_adapter(model, name, timeout=conf.get("ACK_TIMEOUT"))
    return HttpResponse(f"Success: LoRA adapter '{name}' removed successfully.", content_type="text/plain")


def _check_allowed(principal: Principal) -> None:
    if not conf.get("ALLOW_RUNTIME_LORA_UPDATING"):
        raise errors.NotFound(
            "Runtime LoRA updating is off: set LLMSERVE['ALLOW_RUNTIME_LORA_UPDATING'] = True to serve it."
        )
    if principal.key is None or principal.key.allowed_models:
        raise errors.Unauthorized(
            "Loading and unloading LoRA adapters needs an API key that is not limited to some models."
        )


def _text(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise errors.BadRequest(f"`{field}` must be a non-empty string.", param=field)
    return value


def _takes_adapters(info: ModelInfo) -> bool:
    return any(r.data.get("config", {}).get("enable_lora") for r in info.replicas)


def _base_model(body: dict[str, Any], served: dict[str, ModelInfo], fits: Any, what: str) -> str:
    """The `model` field, else the only served model that `fits`."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str) or model not in served:
            raise errors.ModelNotFound(f"The model `{model}` does not exist.", param="model")
        return model
    candidates = [name for name, info in served.items() if fits(info)]
    if len(candidates) != 1:
        raise errors.BadRequest(
            f"`model` is required: {len(candidates)} served models {what}, not one.",
            param="model",
            code="missing_required_parameter",
        )
    return candidates[0]
