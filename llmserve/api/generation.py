"""One generation request through the bus: submit, then answer as JSON or as an SSE stream.

`client.generate()` returns only after the engine accepted the request, so every refusal (bad parameter,
prompt too long, overloaded, unknown model) is still a clean JSON error. After that, a stream can only fail
in-band: an ``error`` event, then ``[DONE]``. When the client goes away, Django cancels the view (or closes
the streaming generator); both paths abort the engine request, which frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from inference_engine.bus.client import AsyncGenerationStream
from inference_engine.bus.protocol import RequestDelta
from inference_engine.errors import EngineError, ModelNotFoundError
from llmserve import bus, metrics
from llmserve.api import errors
from llmserve.api.responses import ResponseBuilder
from llmserve.api.schema import GenerationRequest
from llmserve.models import ModelConfig

log = logging.getLogger("llmserve.api")


async def respond(request: GenerationRequest) -> HttpResponse:
    received = time.monotonic()
    config = await ModelConfig.objects.filter(name=request.model).afirst()
    if config is not None and not config.enabled:
        raise errors.ModelNotFound(f"The model `{request.model}` is disabled.", param="model")
    # The database is done with: hand the connection back before waiting on the engine, or every request
    # waiting in the queue or streaming holds one (each ASGI request has its own thread and connection).
    await sync_to_async(close_old_connections)()
    client = bus.async_client()
    timer = _Timer(request.model, received)
    try:
        stream = await client.generate(
            request.model, request.prompt, request.params, messages=request.messages
        )
    except ModelNotFoundError:
        raise errors.model_not_served(request.model, configured=config is not None) from None
    timer.accepted()
    prompt_text = ""
    if request.echo:
        prompt_text = (
            request.prompt
            if isinstance(request.prompt, str)
            else await client.detokenize(request.model, request.prompt)
        )
    builder = ResponseBuilder(request, prompt_text)
    if request.stream:
        response = StreamingHttpResponse(_events(stream, builder, timer), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # proxies must not buffer the stream
        return response
    async for delta in stream:
        timer.delta(delta)
    result = await stream.result()
    timer.finished(result.usage, [o.finish_reason for o in result.outputs])
    return JsonResponse(builder.full(result))


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _events(
    stream: AsyncGenerationStream, builder: ResponseBuilder, timer: _Timer
) -> AsyncIterator[bytes]:
    try:
        for chunk in builder.first_chunks():
            yield _sse(chunk)
        async for delta in stream:
            timer.delta(delta)
            chunk = builder.delta_chunk(delta.outputs)
            if chunk is not None:
                yield _sse(chunk)
            if delta.finished:
                timer.finished(delta.usage, [d.finish_reason for d in delta.outputs])
                if builder.request.include_usage:
                    yield _sse(builder.usage_chunk(delta.usage))
    except EngineError as exc:
        yield _sse(errors.from_engine_error(exc).body())
    finally:
        if not stream.finished:  # the client went away (generator closed or task cancelled)
            await asyncio.shield(stream.abort())
    yield _sse("[DONE]")


class _Timer:
    """Observes one request's latencies into the metrics as its deltas arrive."""

    def __init__(self, model: str, received: float) -> None:
        self.model, self.received = model, received
        self.submitted = time.monotonic()
        self.last_token: float | None = None

    def accepted(self) -> None:
        metrics.QUEUE_TIME.observe(self.model, time.monotonic() - self.submitted)

    def delta(self, delta: RequestDelta) -> None:
        if not any(d.token_ids for d in delta.outputs):
            return
        now = time.monotonic()
        if self.last_token is None:
            metrics.TIME_TO_FIRST_TOKEN.observe(self.model, now - self.received)
        else:
            metrics.INTER_TOKEN_LATENCY.observe(self.model, now - self.last_token)
        self.last_token = now

    def finished(self, usage: Any, reasons: list[str | None]) -> None:
        metrics.E2E_LATENCY.observe(self.model, time.monotonic() - self.received)
        for reason in reasons:
            metrics.REQUESTS.inc(self.model, label_value=reason or "unknown")
        if usage is not None:
            metrics.PROMPT_TOKENS_SERVED.inc(self.model, usage.prompt_tokens)
            metrics.GENERATION_TOKENS_SERVED.inc(self.model, usage.completion_tokens)
