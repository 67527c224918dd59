"""The asyncio bus client (Django async views, Channels consumers): see `bus.client`.

It reads the output streams of all its requests through one `XREAD` (`_OutputReader`), so requests queued
behind a busy engine wait on an asyncio queue, not on a Redis connection each: a thousand waiting clients cost
one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry

from inference_engine.bus import protocol as P
from inference_engine.bus.client_core import (
    ClientBase,
    ClientSettings,
    GenerationResult,
    Op,
    StreamState,
    T,
    Tokenized,
    Waiter,
    answer,
    bus_error,
    embed_message,
    generate_message,
    tokenize_message,
    tokenized,
)
from inference_engine.errors import EngineError, EngineUnavailableError
from inference_engine.pooling import PoolingParams
from inference_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Subscription:
    last_id: str = "0-0"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # entry lists, or the error that ended them


class _OutputReader:
    """Reads the output streams of every request of one async client with one ``XREAD`` at a time and hands
    each request its entries. A new request joins the next read: the read in progress (blocking up to
    `BLOCK_MS`) also watches the client's wake-up stream, and subscribing adds an entry there, so the new
    request's acknowledgement and first token are not held up by a read that does not include it. The task
    ends when no request is left (and starts again with the next): an idle client leaves nothing running."""

    BLOCK_MS = 20

    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client
        self._subscriptions: dict[str, _Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self._reading = False  # a read is in progress (a new subscription is not part of it)
        self._wake_stream, self._woken = client._core.keys.wake(uuid.uuid4().hex), "0-0"
        self._wakers: set[asyncio.Task[None]] = set()
        self._beaten = -float("inf")  # when the owner key was last refreshed (monotonic)

    def subscribe(self, request_id: str) -> asyncio.Queue:
        subscription = self._subscriptions[request_id] = _Subscription()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._reading and len(self._wakers) == 0:  # one wake-up ends the read for every newcomer
            waker = asyncio.get_running_loop().create_task(self._wake())
            self._wakers.add(waker)
            waker.add_done_callback(self._wakers.discard)
        return subscription.queue

    async def _wake(self) -> None:
        with contextlib.suppress(EngineError):  # the read fails the same way and reports it
            await self.client._run(self.client._core.wake(self._wake_stream))

    def unsubscribe(self, request_id: str) -> None:
        self._subscriptions.pop(request_id, None)

    async def _run(self) -> None:
        while self._subscriptions:
            current, self._reading = dict(self._subscriptions), True
            positions = {rid: s.last_id for rid, s in current.items()}
            now = time.monotonic()
            beat = now - self._beaten >= self.client.settings.owner_beat
            try:
                read = self.client._core.read(
                    positions, self.BLOCK_MS, (self._wake_stream, self._woken), beat=beat
                )
                found, self._woken = await self.client._run(read)
                if beat:
                    self._beaten = now
            except EngineError as exc:  # Redis is gone: every waiting request fails cleanly
                for rid, subscription in current.items():
                    subscription.queue.put_nowait(exc)
                    self.unsubscribe(rid)
                continue
            finally:
                self._reading = False
            for rid, entries in found.items():
                subscription = current[rid]
                subscription.last_id = entries[-1][0]
                subscription.queue.put_nowait(entries)

    async def close(self) -> None:
        self._subscriptions.clear()
        for waker in self._wakers:
            waker.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class AsyncGenerationStream(StreamState):
    """Async twin of `GenerationStream` (`sync_client`). `async for` over it; cancelling the consuming task,
    leaving the loop (the generator is closed when collected), `async with` exit, or dropping the stream
    unfinished abort the request."""

    client: AsyncEngineClient

    def __init__(
        self, client: AsyncEngineClient, model: str, request_id: str, *, owns_request: bool = True
    ) -> None:
        super().__init__(client, model, request_id)
        self._queue = client._reader.subscribe(request_id)
        self._loop = asyncio.get_running_loop()
        self._owns_request = owns_request

    def __del__(self) -> None:
        # A generation dropped before its end that nobody aborted: a Django view cancelled (its client gone)
        # after returning a streaming response whose iterator never started, so no `finally` of ours ran.
        # Without this the engine would generate it to the end for nobody.
        if getattr(self, "_owns_request", False) and not self._acc.finished and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.client._abort_dropped, self.model, self.request_id)

    async def _next(self, timeout: float) -> P.Message:
        waiter = Waiter(timeout, self.model)
        try:
            while not self._buffer:
                try:
                    async with asyncio.timeout(waiter.block_s(self.client.settings.poll_interval)):
                        got = await self._queue.get()
                except TimeoutError:
                    await self.client._run(self._check_waiting())
                    continue
                if isinstance(got, BaseException):
                    raise got
                self._take(got)
        except BaseException:
            self._unsubscribe()
            raise
        message = self._buffer.popleft()
        if isinstance(message, P.Final | P.Error | P.Result):
            self._unsubscribe()
        return message

    def _unsubscribe(self) -> None:
        self.client._reader.unsubscribe(self.request_id)

    async def _wait_ack(self) -> None:
        try:
            while self._acc.prompt_tokens is None and not self._acc.finished:
                self._acc.feed(await self._next(self.client.settings.ack_timeout))
        except BaseException:
            if not self._acc.finished:
                await self._abort_shielded()
            raise

    async def __aiter__(self) -> AsyncIterator[P.RequestDelta]:
        try:
            while not self._acc.finished:
                delta = self._acc.feed(await self._next(self.client.settings.stream_timeout))
                if delta is not None:
                    yield delta
        finally:
            if not self._acc.finished:
                await self._abort_shielded()

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._acc.result()

    async def abort(self) -> None:
        self._unsubscribe()
        if not self._acc.finished:
            self._acc.finished = True
            await self.client.abort(self.model, self.request_id)

    async def _abort_shielded(self) -> None:
        # The abort must reach Redis even when we got here because our task was cancelled.
        await asyncio.shield(self.abort())

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._abort_shielded()


class AsyncEngineClient(ClientBase):
    """asyncio bus client (Django async views, Channels consumers). Use one per event loop."""

    redis: aredis.Redis

    def __init__(
        self, redis_url: str | None = None, *, settings: ClientSettings | None = None, **overrides: Any
    ) -> None:
        super().__init__(redis_url, settings, overrides, aredis, AsyncRetry)
        self._reader = _OutputReader(self)
        self._dropped: set[asyncio.Task] = set()  # aborts of dropped streams, until they are sent
        self.draining = False  # see `drain`

    def drain(self) -> None:
        """Refuse new generations (`EngineUnavailableError`): the process is shutting down and lets the
        requests in flight finish (see `inflight`, `fail_inflight`)."""
        self.draining = True

    @property
    def inflight(self) -> int:
        """Requests whose output this client is reading."""
        return len(self._reader._subscriptions)

    def fail_inflight(self, error: EngineError) -> None:
        """End every request in flight with `error` (its reader raises it, and aborts the request)."""
        for subscription in list(self._reader._subscriptions.values()):
            subscription.queue.put_nowait(error)

    def _abort_dropped(self, model: str, request_id: str) -> None:
        self._reader.unsubscribe(request_id)
        task = asyncio.get_running_loop().create_task(self._abort_quietly(model, request_id))
        self._dropped.add(task)
        task.add_done_callback(self._dropped.discard)

    async def _abort_quietly(self, model: str, request_id: str) -> None:
        try:
            await self.abort(model, request_id)
        except EngineError as exc:  # Redis is gone; nothing more can be done from here
            log.warning("could not abort dropped request %s: %s", request_id, exc)

    async def close(self) -> None:
        await self._reader.close()
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    async def _run(self, op: Op[T]) -> T:
        """See `EngineClient._run` (`sync_client`)."""
        try:
            commands = next(op)
            while True:
                if len(commands) == 1:
                    name, args, kwargs = commands[0]
                    results = [await getattr(self.redis, name)(*args, **kwargs)]
                else:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for name, args, kwargs in commands:
                            getattr(pipe, name)(*args, **kwargs)
                        results = await pipe.execute()
                commands = op.send(results)
        except StopIteration as done:
            return done.value
        except redis.RedisError as exc:
            raise bus_error(exc) from exc

    async def generate(
        self,
        model: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | dict | None = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        chat_options: dict | None = None,
        lora_name: str | None = None,
    ) -> AsyncGenerationStream:
        """See `EngineClient.generate` (`sync_client`); `lora_name`: an adapter `model`'s engines serve."""
        if self.draining:
            raise EngineUnavailableError("this server is shutting down; retry the request.")
        message = generate_message(
            prompt,
            params,
            messages,
            request_id,
            priority,
            tools,
            self._core.owner_id,
            chat_options,
            lora_name,
        )
        try:
            await self._run(self._core.submit(model, message))
        except asyncio.CancelledError:  # the request may have reached Redis before the cancellation did
            await asyncio.shield(self._abort_quietly(model, message.id))
            raise
        stream = AsyncGenerationStream(self, model, message.id)
        await stream._wait_ack()
        return stream

    async def embed(
        self,
        model: str,
        prompt: str | list[int],
        params: PoolingParams | dict | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> P.Result:
        """See `EngineClient.embed` (`sync_client`); cancelling the waiting task aborts the request."""
        if self.draining:
            raise EngineUnavailableError("this server is shutting down; retry the request.")
        message = embed_message(prompt, params, request_id, priority, self._core.owner_id)
        try:
            await self._run(self._core.submit(model, message))
        except asyncio.CancelledError:  # the request may have reached Redis before the cancellation did
            await asyncio.shield(self._abort_quietly(model, message.id))
            raise
        stream = AsyncGenerationStream(self, model, message.id, owns_request=False)
        try:
            reply = await stream._next(self.settings.ack_timeout)
        except BaseException:  # cancelled or timed out while the request is queued or running
            await asyncio.shield(self._abort_quietly(model, message.id))
            raise
        return answer(reply)

    async def attach(self, model: str, request_id: str) -> AsyncGenerationStream:
        """The stream of a request submitted earlier, by this client or another (a bulk task that took over
        another's items), read from its first entry; leaving it early aborts the request as for `generate`.
        This client becomes the request's owner (its first one may be dead). Raises `RequestAbortedError` if
        the request was aborted."""
        await self._run(self._core.check_attachable(request_id))
        await self._run(self._core.adopt(request_id))
        return AsyncGenerationStream(self, model, request_id)

    async def tokenize(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        add_special_tokens: bool = True,
        return_token_strs: bool = False,
    ) -> Tokenized:
        message = tokenize_message(prompt, messages, add_special_tokens, return_token_strs)
        return tokenized(await self._call(model, message))

    async def tokenizer_info(self, model: str) -> dict[str, Any]:
        return (await self._call(model, P.TokenizerInfo(uuid.uuid4().hex))).info

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        return (await self._call(model, P.Detokenize(uuid.uuid4().hex, list(token_ids)))).text

    async def abort(self, model: str, request_id: str) -> None:
        await self._run(self._core.abort(model, request_id))

    async def request_known(self, request_id: str, started: bool) -> bool:
        return await self._run(self._core.request_known(request_id, started))

    async def count(self, name: str, ttl: int) -> int:
        """See `Core.count`: one round trip."""
        return await self._run(self._core.count(name, ttl))

    async def hold(self, name: str, member: str, limit: int, ttl: float) -> bool:
        """See `Core.hold`: one round trip."""
        return await self._run(self._core.hold(name, member, limit, ttl))

    async def release(self, name: str, member: str) -> None:
        await self._run(self._core.release(name, member))

    async def live_replicas(self, model: str) -> list[str]:
        return await self._run(self._core.live_replicas(model))

    async def list_models(self) -> list[P.ModelInfo]:
        return await self._run(self._core.list_models())

    async def load_lora_adapter(
        self, model: str, lora_name: str, lora_path: str, timeout: float = 60.0
    ) -> int:
        """See `EngineClient.load_lora_adapter` (`sync_client`)."""
        message = P.LoadLoRA(uuid.uuid4().hex, lora_name, lora_path)
        return await self._run(self._core.update_lora(model, message, timeout))

    async def unload_lora_adapter(self, model: str, lora_name: str, timeout: float = 60.0) -> int:
        """See `EngineClient.unload_lora_adapter` (`sync_client`)."""
        message = P.UnloadLoRA(uuid.uuid4().hex, lora_name)
        return await self._run(self._core.update_lora(model, message, timeout))

    async def _call(self, model: str, message: P.Tokenize | P.Detokenize | P.TokenizerInfo) -> P.Result:
        await self._run(self._core.submit(model, message))
        # an answer, not a generation: dropping it after the answer aborts nothing
        stream = AsyncGenerationStream(self, model, message.id, owns_request=False)
        return answer(await stream._next(self.settings.ack_timeout))
