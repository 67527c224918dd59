"""``POST /v1/completions`` and ``POST /v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse

from llmserve.api import generation, schema
from llmserve.api.decorators import api_view
from llmserve.api.validation import validated
from llmserve.auth import Principal


@api_view(("POST",), json_body=True)
async def completions(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    request_ = await validated(
        principal.identity,
        body,
        schema.parse,
        "completion",
        body,
        several_prompts=True,
        min_priority=principal.min_priority,
    )
    return await generation.respond(request_)


@api_view(("POST",), json_body=True)
async def chat_completions(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    request_ = await validated(
        principal.identity, body, schema.parse, "chat", body, min_priority=principal.min_priority
    )
    return await generation.respond(request_)
