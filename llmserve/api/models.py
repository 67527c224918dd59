"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models live engines serve, in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from inference_engine.bus.protocol import ModelInfo
from llmserve import bus
from llmserve.api import errors
from llmserve.api.decorators import api_view
from llmserve.auth import Principal
from llmserve.models import LoRAAdapter, ModelConfig


def _model_object(info: ModelInfo) -> dict[str, Any]:
    started = min(r.data.get("started_at", 0) for r in info.replicas)
    return {
        "id": info.name,
        "object": "model",
        "created": int(started),
        "owned_by": "llmserve",
        "root": info.name,
        "parent": None,
        "max_model_len": info.max_model_len,
    }


def _adapter_objects(info: ModelInfo) -> list[dict[str, Any]]:
    """The LoRA adapters `info`'s engines serve, each a model whose `parent` is `info` (vLLM's listing)."""
    return [{**_model_object(info), "id": name, "root": name, "parent": info.name} for name in info.adapters]


async def served_models() -> dict[str, ModelInfo]:
    live = {m.name: m for m in await bus.async_client().list_models()}
    disabled = {
        name
        async for name in ModelConfig.objects.filter(name__in=list(live), enabled=False).values_list(
            "name", flat=True
        )
    }
    return {name: info for name, info in live.items() if name not in disabled}


async def model_objects() -> list[dict[str, Any]]:
    """Each served model in OpenAI's shape, followed by its LoRA adapters, less the adapters disabled in the
    admin (an engine may still serve one: it is refused all the same)."""
    served = await served_models()
    adapters = [a["id"] for m in served.values() for a in _adapter_objects(m)]
    disabled = set()
    if adapters:
        disabled = {
            name
            async for name in LoRAAdapter.objects.filter(name__in=adapters, enabled=False).values_list(
                "name", flat=True
            )
        }
    return [
        obj
        for m in served.values()
        for obj in (_model_object(m), *_adapter_objects(m))
        if obj["id"] not in disabled
    ]


@api_view(("GET",))
async def model_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    data = [m for m in await model_objects() if principal.may_use(m["id"])]
    return JsonResponse({"object": "list", "data": data})


@api_view(("GET",))
async def model_detail(request: HttpRequest, principal: Principal, model_id: str) -> HttpResponse:
    principal.check_model(model_id)
    found = next((m for m in await model_objects() if m["id"] == model_id), None)
    if found is not None:
        return JsonResponse(found)
    configured = await ModelConfig.objects.filter(name=model_id, enabled=True).aexists()
    raise errors.model_not_served(model_id, configured)
