"""The bus side of a bulk runner: an asyncio loop on a thread of its own, running every in-flight request of
the runner as a task of the async bus client (embeddings through `llmserve.api.embeddings.create`, as the
REST API runs them).

The runner's own thread keeps the database work (claims, batched writes) and talks to this one through
`start`, `finished` and `cancel`, so a slow database write never stalls the reading of output streams and a
thousand requests in flight cost a thousand small tasks, not a thousand threads.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from inference_engine.bus.client import AsyncEngineClient, ClientSettings, GenerationResult
from inference_engine.errors import InvalidRequestError, ModelNotFoundError
from llmserve import bus
from llmserve.api import embeddings, errors
from llmserve.bulk import requests

T = TypeVar("T")
Outcome = GenerationResult | dict[str, Any] | Exception  # a dict: an embeddings answer's body


@dataclass(eq=False)
class Flight:
    """One attempt at one item, from its claim until its result is stored."""

    item_id: int
    index: int
    attempt: int
    request_id: str
    request: requests.ItemRequest | requests.EmbedRequest | None  # None: it could not be made a request


class BusThread:
    """`model` is the served model whose engines run the job; `lora_name` the adapter its requests name (a job
    whose model is a LoRA adapter runs on the adapter's base model)."""

    def __init__(
        self,
        redis_url: str | None,
        settings: ClientSettings,
        model: str,
        priority: int,
        lora_name: str | None = None,
    ) -> None:
        self.model, self.priority, self.lora_name = model, priority, lora_name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="bulk-bus", daemon=True)
        self._thread.start()
        self._tasks: dict[Flight, asyncio.Task] = {}
        self._finished: queue.SimpleQueue[tuple[Flight, Outcome]] = queue.SimpleQueue()
        self._embedded = False  # whether `embeddings.create` made this loop a bus client of its own
        self.client: AsyncEngineClient = self.call(self._client(redis_url, settings))

    def _serve(self) -> None:
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @staticmethod
    async def _client(redis_url: str | None, settings: ClientSettings) -> AsyncEngineClient:
        return AsyncEngineClient(redis_url, settings=settings)  # built on its loop, which its pool belongs to

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coroutine`` on the bus loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self, flight: Flight) -> None:
        self.loop.call_soon_threadsafe(self._start, flight)

    def _start(self, flight: Flight) -> None:
        self._tasks[flight] = self.loop.create_task(self._run(flight))

    async def _run(self, flight: Flight) -> None:
        try:
            if isinstance(flight.request, requests.EmbedRequest):
                outcome: Outcome = await self._embed(flight.request)
            else:
                outcome = await self._generate(flight)
        except asyncio.CancelledError:  # `cancel`: the client has aborted the request in the engine
            outcome = asyncio.CancelledError()
        except Exception as exc:
            outcome = exc
        finally:
            self._tasks.pop(flight, None)
        self._finished.put((flight, outcome))

    async def _embed(self, request: requests.EmbedRequest) -> dict[str, Any]:
        """The embeddings answer, at the job's priority. Embedding requests are short and not attached to
        again: an item whose runner left before its answer was stored is embedded again by the next one."""
        self._embedded = True
        try:
            return await embeddings.create({**request.body, "priority": self.priority}, self.priority)
        except (errors.ModelNotFound, errors.ServiceUnavailable) as exc:
            raise ModelNotFoundError(exc.message) from None  # no engine serves it now: tried again later
        except errors.APIError as exc:
            raise requests.ItemError(exc) from None

    async def _generate(self, flight: Flight) -> GenerationResult:
        request = flight.request
        assert request is not None
        # An attempt whose id the bus already knows was submitted by an earlier runner (one that handed over,
        # or died): its request runs (or has finished) in the engine, so read its output rather than
        # generate the item again. The second check covers an earlier runner submitting in between. An
        # earlier runner that gave up on the request aborted it: `attach` raises, and the item is tried again.
        if await self.client.request_known(flight.request_id, started=False):
            stream = await self.client.attach(self.model, flight.request_id)
        else:
            try:
                stream = await self.client.generate(
                    self.model,
                    request.prompt,
                    request.params,
                    messages=request.messages,
                    tools=request.tools,
                    chat_options=request.api.chat_options if request.api is not None else None,
                    request_id=flight.request_id,
                    priority=self.priority,
                    lora_name=self.lora_name,
                )
            except InvalidRequestError:
                if not await self.client.request_known(flight.request_id, started=False):
                    raise
                stream = await self.client.attach(self.model, flight.request_id)
        async with stream:
            return await stream.result()

    def finished(self, timeout: float) -> list[tuple[Flight, Outcome]]:
        """The flights that ended since the last call, waiting up to ``timeout`` seconds for the first."""
        try:
            done = [self._finished.get(timeout=timeout)] if timeout > 0 else []
        except queue.Empty:
            return []
        while True:
            try:
                done.append(self._finished.get_nowait())
            except queue.Empty:
                return done

    def cancel(self, flights: list[Flight]) -> None:
        """Abort these flights' requests; each comes back from `finished` as a `CancelledError`."""

        def cancel() -> None:
            for flight in flights:
                task = self._tasks.get(flight)
                if task is not None:
                    task.cancel()

        self.loop.call_soon_threadsafe(cancel)

    def close(self) -> None:
        """Stop the loop once the requests still in flight have ended (returns at once). They are not aborted:
        when a runner leaves them behind (it failed, or was declared dead), whichever runner takes the items
        over reads the same requests' output."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)

    async def _shutdown(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))
        await self.client.close()
        if self._embedded:
            await bus.async_client().close()
        self.loop.stop()
