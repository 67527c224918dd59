"""Chat and completion requests through the bus: submit, then answer as JSON or as an SSE stream.

`submit()` returns only after the engine accepted every engine request of the API request (one per prompt),
so every refusal (bad parameter, prompt too long, overloaded, unknown model) is still a clean JSON error.
After that, a stream can only fail in-band: an ``error`` event, then ``[DONE]``. When the client goes away,
Django cancels the view (or closes the streaming generator); both paths abort the engine requests, which
frees their KV blocks within one step. The Responses API submits through the same `submit()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from inference_engine.bus.client import AsyncGenerationStream
from inference_engine.bus.protocol import RequestDelta
from inference_engine.errors import EngineError, ModelNotFoundError
from llmserve import bus, lookups, metrics
from llmserve.api import errors
from llmserve.api.responses import Echo, ResponseBuilder, bus_ids
from llmserve.api.schema import GenerationRequest
from llmserve.models import LoRAAdapter

log = logging.getLogger("llmserve.api")


@dataclass
class Submitted:
    """The accepted engine requests of one API request, in prompt order, each with its metrics timer."""

    request: GenerationRequest
    streams: list[AsyncGenerationStream]
    timers: list[metrics.RequestTimer]
    engine_model: str  # the served model whose engines run it (an adapter's base model)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(prompt number, delta) as they arrive from all the streams; observed into the metrics. Leaving
        early (or failing) aborts every unfinished stream."""
        async for prompt, delta in _merged(self.streams):
            self.timers[prompt].delta(delta)
            yield prompt, delta

    async def abort(self) -> None:
        for stream, timer in zip(self.streams, self.timers, strict=True):
            if not stream.finished:
                timer.aborted()
                await asyncio.shield(stream.abort())


async def submit(request: GenerationRequest) -> Submitted:
    """Every engine request of `request`, accepted; raises `errors.APIError` (a disabled or unserved model)
    or the engine's refusal, with nothing left running. A `model` that no engine serves but some engine
    serves as a LoRA adapter (`serve --lora-modules`) runs on that engine's base model with the adapter."""
    received = time.monotonic()
    config = await lookups.model_config(request.model)
    if config is not None and not config.enabled:
        raise errors.ModelNotFound(f"The model `{request.model}` is disabled.", param="model")
    client = bus.async_client()
    prompts = request.prompts if request.prompts is not None else [None]
    ids = bus_ids(request, len(prompts))

    async def attempt(model: str, lora_name: str | None) -> list[AsyncGenerationStream | BaseException]:
        async def one(prompt: str | list[int] | None, request_id: str | None) -> AsyncGenerationStream:
            return await client.generate(
                model,
                prompt,
                request.params,
                messages=request.messages,
                tools=request.tools,
                chat_options=request.chat_options,
                priority=request.priority,
                request_id=request_id,
                lora_name=lora_name,
            )

        return await asyncio.gather(
            *(one(p, i) for p, i in zip(prompts, ids, strict=True)), return_exceptions=True
        )

    timers = [metrics.RequestTimer(request.model, received) for _ in prompts]
    engine_model = request.model
    attempts = await attempt(request.model, None)
    if config is None and all(isinstance(a, ModelNotFoundError) for a in attempts):
        base = await _adapter_base(request.model)
        if base is not None:
            engine_model = base
            attempts = await attempt(base, request.model)
    streams = [a for a in attempts if isinstance(a, AsyncGenerationStream)]
    failed = next((a for a in attempts if isinstance(a, BaseException)), None)
    if failed is not None:
        await asyncio.gather(*(asyncio.shield(s.abort()) for s in streams))
        if isinstance(failed, ModelNotFoundError):
            raise errors.model_not_served(request.model, configured=config is not None) from None
        raise failed
    for timer, stream in zip(timers, streams, strict=True):
        timer.accepted(stream.prompt_tokens or 0)
    return Submitted(request, streams, timers, engine_model)


async def _adapter_base(name: str) -> str | None:
    """The served model, not disabled, one of whose engines serves the adapter `name`, if any; None too for
    an adapter disabled in the admin, which an engine may still serve."""
    for info in await bus.async_client().list_models():
        if name in info.adapters:
            config = await lookups.model_config(info.name)
            if (config is not None and not config.enabled) or await _adapter_disabled(name):
                return None
            return info.name
    return None


@lookups.released
def _adapter_disabled(name: str) -> bool:
    return LoRAAdapter.objects.filter(name=name, enabled=False).exists()


async def _merged(streams: list[AsyncGenerationStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | Exception | None]] = asyncio.Queue()

    async def pump(prompt: int, stream: AsyncGenerationStream) -> None:
        try:
            async for delta in stream:
                await queue.put((prompt, delta))
            await queue.put((prompt, None))
        except Exception as exc:
            await queue.put((prompt, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            prompt, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield prompt, item
    finally:
        for task in tasks:
            task.cancel()  # a stream's iteration aborts its engine request when cancelled
        await asyncio.gather(*tasks, return_exceptions=True)


async def response_builder(submitted: Submitted) -> ResponseBuilder:
    """The builder of the answer's JSON body or stream chunks, given the model's parsers (from the ack)."""
    first = submitted.streams[0]
    return ResponseBuilder(
        submitted.request, await _echoes(submitted), first.tool_parser, first.reasoning_parser
    )


async def respond(request: GenerationRequest) -> HttpResponse:
    submitted = await submit(request)
    try:
        builder = await response_builder(submitted)
    except BaseException:
        await submitted.abort()
        raise
    if request.stream:
        response = StreamingHttpResponse(_events(submitted, builder), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # proxies must not buffer the stream
        return response
    try:
        async for _ in submitted.deltas():
            pass
    finally:
        await submitted.abort()  # a cancelled view (client gone) leaves nothing running
    return JsonResponse(builder.full([await s.result() for s in submitted.streams]))


async def _echoes(submitted: Submitted) -> list[Echo]:
    """The prompts an ``echo`` completion shows; the first token's text where logprobs are asked for."""
    request = submitted.request
    if not request.echo:
        return []
    client = bus.async_client()
    echoes = []
    for prompt in request.prompts or []:
        ids = prompt if isinstance(prompt, list) else None
        model = submitted.engine_model
        text = prompt if isinstance(prompt, str) else await client.detokenize(model, prompt)
        first = ""
        if request.logprobs:
            ids = ids or (await client.tokenize(model, text)).token_ids
            first = await client.detokenize(model, ids[:1])
        echoes.append(Echo(text, first))
    return echoes


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


async def _events(submitted: Submitted, builder: ResponseBuilder) -> AsyncIterator[bytes]:
    usages: dict[int, Any] = {}
    try:
        for chunk in builder.first_chunks():
            yield sse(chunk)
        async for prompt, delta in submitted.deltas():
            chunk = builder.delta_chunk(delta, prompt)
            if chunk is not None:
                yield sse(chunk)
            if delta.finished:
                usages[prompt] = delta.usage
        if builder.request.include_usage:
            yield sse(builder.usage_chunk([usages.get(i) for i in range(len(submitted.streams))]))
    except EngineError as exc:
        yield sse(errors.from_engine_error(exc).body())
    finally:
        await submitted.abort()  # the client went away (generator closed or task cancelled)
    yield sse("[DONE]")
