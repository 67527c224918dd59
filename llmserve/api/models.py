"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models live engines serve, in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from inference_engine.bus.protocol import ModelInfo
from llmserve import bus
from llmserve.api import errors
from llmserve.api.decorators import api_view
from llmserve.auth import Principal
from llmserve.models import ModelConfig


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


async def served_models() -> dict[str, ModelInfo]:
    live = {m.name: m for m in await bus.async_client().list_models()}
    disabled = {
        name
        async for name in ModelConfig.objects.filter(name__in=list(live), enabled=False).values_list(
            "name", flat=True
        )
    }
    return {name: info for name, info in live.items() if name not in disabled}


@api_view(("GET",))
async def model_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    served = await served_models()
    return JsonResponse({"object": "list", "data": [_model_object(m) for m in served.values()]})


@api_view(("GET",))
async def model_detail(request: HttpRequest, principal: Principal, model_id: str) -> HttpResponse:
    served = await served_models()
    if model_id in served:
        return JsonResponse(_model_object(served[model_id]))
    configured = await ModelConfig.objects.filter(name=model_id, enabled=True).aexists()
    raise errors.model_not_served(model_id, configured)
