"""``POST /v1/embeddings``, as OpenAI defines it, served by an engine started with ``--runner pooling``.

Each input (a string or a list of token ids) is one `Embed` request on the bus, queued and prioritised as a
generation is; the engine answers each with its vector as base64 float32, which is what OpenAI's base64
format is, so ``encoding_format="base64"`` passes it through and ``"float"`` unpacks it. The first refusal
(an input too long, ``dimensions`` on a model without Matryoshka support, a generating model) ends the request
with its error and aborts the inputs still running.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Annotated, Any, Literal

from django.http import HttpRequest, HttpResponse, JsonResponse
from pydantic import Field

from inference_engine.bus import protocol as P
from inference_engine.bus.client import AsyncEngineClient
from inference_engine.errors import ModelNotFoundError
from inference_engine.pooling import PoolingParams
from llmserve import bus, conf, lookups
from llmserve.api import errors, schema
from llmserve.api.decorators import api_view
from llmserve.auth import Principal

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(schema.RequestModel):
    model: Annotated[str, Field(min_length=1)]
    input: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int = 0


@api_view(("POST",), json_body=True)
async def embeddings(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    return JsonResponse(await create(body, principal.min_priority))


async def create(body: dict[str, Any], min_priority: int | None = None) -> dict[str, Any]:
    """The answer's body to an embeddings request body (also for a Batch API line); raises `errors.APIError`
    or the engine's refusal. `min_priority`: the most urgent `priority` the caller may ask for (None:
    LLMSERVE['MIN_PRIORITY'])."""
    data = schema.validate(EmbeddingRequest, body)
    inputs = _inputs(data.input)
    floor = conf.get("MIN_PRIORITY") if min_priority is None else min_priority
    if data.priority < floor:
        raise errors.BadRequest(f"`priority` must be at least {floor} here.", param="priority")
    if data.truncate_prompt_tokens == 0:
        raise errors.BadRequest(
            "`truncate_prompt_tokens` must be -1 or positive.", param="truncate_prompt_tokens"
        )
    config = await lookups.model_config(data.model)
    if config is not None and not config.enabled:
        raise errors.ModelNotFound(f"The model `{data.model}` is disabled.", param="model")
    params = PoolingParams(data.dimensions, data.truncate_prompt_tokens)
    try:
        results = await _embed_all(bus.async_client(), data.model, inputs, params, data.priority)
    except ModelNotFoundError:
        raise errors.model_not_served(data.model, configured=config is not None) from None
    items = [
        {"object": "embedding", "index": i, "embedding": _encoded(r.embedding, data.encoding_format)}
        for i, r in enumerate(results)
    ]
    tokens = sum(r.count for r in results)
    return {
        "object": "list",
        "data": items,
        "model": data.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _inputs(value: str | list) -> list[str | list[int]]:
    """Every input as a string or a list of token ids."""
    inputs = [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)
    if len(inputs) > MAX_INPUTS:
        raise errors.BadRequest(f"`input` may hold at most {MAX_INPUTS} items.", param="input")
    for one in inputs:
        if isinstance(one, str) and not one:
            raise errors.BadRequest("`input` holds an empty string.", param="input")
        if isinstance(one, str) and len(one) > conf.get("MAX_PROMPT_CHARS"):
            raise errors.BadRequest("An input is too long.", param="input", code="prompt_too_long")
    return inputs


async def _embed_all(
    client: AsyncEngineClient,
    model: str,
    inputs: list[str | list[int]],
    params: PoolingParams,
    priority: int,
) -> list[P.Result]:
    """Each input's answer, in order. The first error is raised once the unanswered requests are aborted
    (cancelling an `embed` aborts its request; also when the view is cancelled: its client went away)."""
    tasks = [asyncio.ensure_future(client.embed(model, one, params, priority=priority)) for one in inputs]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in tasks if t in done and t.exception() is not None), None)
        if failed is not None:
            raise failed
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


def _encoded(embedding: str, encoding_format: str) -> str | list[float]:
    """The bus's base64 float32 as the answer wants it."""
    if encoding_format == "base64":
        return embedding
    raw = base64.b64decode(embedding)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
