"""The asyncio form of the offline API, in the shape of vLLM's `AsyncLLM` (alias `AsyncLLMEngine`).

    engine = AsyncLLM(model=...)  # or AsyncLLM.from_llm(llm) to share an LLM's engine and batch
    async for output in engine.generate(prompt, SamplingParams(...), request_id):
        ...  # cumulative RequestOutputs; the last has finished=True
    vector = (await engine.embed(text)).outputs.embedding  # or vLLM's `encode` stream

Streams from any number of tasks (and `LLM` calls from threads) join the engine loop's one continuous
batch. A stream whose task is cancelled, or that is closed early, aborts its request before the next step.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing

from inference_engine.config import EngineConfig
from inference_engine.engine_loop import EngineLoop, Request
from inference_engine.llm import LLM, PromptType, prompt_of
from inference_engine.llm_engine import LLMEngine
from inference_engine.outputs import EmbeddingRequestOutput, RequestOutput
from inference_engine.pooling import PoolingParams
from inference_engine.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine_loop = EngineLoop.build(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> AsyncLLM:
        engine = cls.__new__(cls)
        engine.engine_loop = EngineLoop.build(engine_args)
        return engine

    @classmethod
    def from_llm(cls, llm: LLM) -> AsyncLLM:
        """An asyncio front on `llm`'s engine: its streams and `llm`'s calls share one batch."""
        engine = cls.__new__(cls)
        engine.engine_loop = llm.engine_loop
        return engine

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine_loop.engine

    def get_tokenizer(self):
        return self.engine_loop.engine.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs. An invalid request raises here (the engine's error, e.g.
        InvalidRequestError); `abort(request_id)` ends the stream with a finish_reason "abort" output."""
        request = Request(request_id, prompt_of(prompt), sampling_params, priority)
        async with aclosing(self._stream(request)) as stream:  # closed with this one: aborts at once
            async for item in stream:
                yield item

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """vLLM's pooling stream: one output, finished, its vector in `outputs.embedding` (an aborted
        request's has none). The prompt shares the batch with the engine's generations."""
        request = Request(request_id, prompt_of(prompt), pooling_params, priority)
        async with aclosing(self._stream(request)) as stream:
            async for item in stream:
                yield item

    async def embed(
        self, prompt: PromptType, pooling_params: PoolingParams | None = None, request_id: str | None = None
    ) -> EmbeddingRequestOutput:
        """One prompt's embedding, as `LLM.embed` gives it; `request_id` defaults to a new one."""
        params = pooling_params or PoolingParams()
        async with aclosing(self.encode(prompt, params, request_id or f"embed-{uuid.uuid4().hex}")) as stream:
            return [item async for item in stream][-1]

    async def _stream(self, request: Request) -> AsyncGenerator:
        """`request`'s outputs until its final one; it is aborted if the stream ends otherwise."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException] = asyncio.Queue()
        request_id = request.request_id

        def sink(item: RequestOutput | EmbeddingRequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        try:
            await asyncio.wrap_future(self.engine_loop.add([request], sink))
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        except BaseException:  # cancelled, closed early, or failed: the request must not outlive its stream
            self.engine_loop.abort([request_id], sink)
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Ends requests (their streams end with a finish_reason "abort" output) and frees their KV blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await asyncio.wrap_future(self.engine_loop.abort(ids))

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.wrap_future(self.engine_loop.call(self.engine_loop.engine.reset_prefix_cache))


AsyncLLMEngine = AsyncLLM
