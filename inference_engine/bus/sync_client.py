"""The synchronous bus client (Celery tasks, management commands, scripts): see `bus.client`."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import redis
from redis.retry import Retry

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


class GenerationStream(StreamState):
    """A submitted, acknowledged generation. Iterate it for `RequestDelta`s; use it as a context manager (or
    call `abort()`) to make sure an abandoned request is aborted in the engine."""

    client: EngineClient

    def _next(self, timeout: float) -> P.Message:
        waiter = Waiter(timeout, self.model)
        while not self._buffer:
            block = waiter.block_s(self.client.settings.poll_interval)
            found, _ = self.client._run(
                self.client._core.read({self.request_id: self._last_id}, int(block * 1000))
            )
            self._take(found.get(self.request_id, []))
            if not found:
                self.client._run(self._check_waiting())
        return self._buffer.popleft()

    def _wait_ack(self) -> None:
        try:
            while self._acc.prompt_tokens is None and not self._acc.finished:
                self._acc.feed(self._next(self.client.settings.ack_timeout))
        except BaseException:
            if not self._acc.finished:
                self.abort()
            raise

    def __iter__(self) -> Iterator[P.RequestDelta]:
        try:
            while not self._acc.finished:
                delta = self._acc.feed(self._next(self.client.settings.stream_timeout))
                if delta is not None:
                    yield delta
        finally:
            if not self._acc.finished:
                self.abort()

    def result(self) -> GenerationResult:
        """Consume the rest of the stream and return the whole generation."""
        for _ in self:
            pass
        return self._acc.result()

    def abort(self) -> None:
        if not self._acc.finished:
            self._acc.finished = True
            self.client.abort(self.model, self.request_id)

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class EngineClient(ClientBase):
    """Synchronous bus client (Celery tasks, management commands, scripts). Thread-safe: redis-py pools."""

    redis: redis.Redis

    def __init__(
        self, redis_url: str | None = None, *, settings: ClientSettings | None = None, **overrides: Any
    ) -> None:
        super().__init__(redis_url, settings, overrides, redis, Retry)
        # The streams still running, for the thread that keeps the owner key alive while there are any: a
        # thread, since a caller may hold a stream unread for a while (a Celery task storing results).
        self._streams: weakref.WeakSet[GenerationStream] = weakref.WeakSet()
        self._closed = threading.Event()
        self._beater: threading.Thread | None = None
        self._beater_lock = threading.Lock()

    def close(self) -> None:
        self._closed.set()
        self.redis.close()
        self.redis.connection_pool.disconnect()

    def _owned(self, stream: GenerationStream) -> None:
        self._streams.add(stream)
        with self._beater_lock:
            if self._beater is None or not self._beater.is_alive():
                self._beater = threading.Thread(target=self._beat, name="llmserve-owner", daemon=True)
                self._beater.start()

    def _beat(self) -> None:
        while not self._closed.wait(self.settings.owner_beat):
            if not any(not stream.finished for stream in list(self._streams)):
                continue
            try:
                self._run(self._core.beat())
            except EngineError as exc:  # Redis is gone: the streams' own reads report it
                log.debug("owner beat failed: %s", exc)

    def _run(self, op: Op[T]) -> T:
        """Runs one operation of the core: each round trip as one command or one pipeline."""
        try:
            commands = next(op)
            while True:
                if len(commands) == 1:
                    name, args, kwargs = commands[0]
                    results = [getattr(self.redis, name)(*args, **kwargs)]
                else:
                    with self.redis.pipeline(transaction=False) as pipe:
                        for name, args, kwargs in commands:
                            getattr(pipe, name)(*args, **kwargs)
                        results = pipe.execute()
                commands = op.send(results)
        except StopIteration as done:
            return done.value
        except redis.RedisError as exc:
            raise bus_error(exc) from exc

    def generate(
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
    ) -> GenerationStream:
        """Submit a generation and wait for the engine's acknowledgement: typed errors come before any delta.

        `prompt` is text or token ids; `messages` (chat) is rendered with the engine's chat template, with
        `tools` (OpenAI's function tools) where given, and `chat_options` (`Tokenizer.apply_chat_template`'s
        add_generation_prompt, continue_final_message, chat_template_kwargs). `priority`: lower runs earlier
        (interactive 0, bulk jobs e.g. 10). `lora_name`: one of the LoRA adapters that `model`'s engines serve
        by name (`serve --lora-modules`); an engine serving no such adapter refuses with ModelNotFoundError.
        """
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
        self._run(self._core.submit(model, message))
        stream = GenerationStream(self, model, message.id)
        self._owned(stream)
        stream._wait_ack()
        return stream

    def embed(
        self,
        model: str,
        prompt: str | list[int],
        params: PoolingParams | dict | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> P.Result:
        """The embedding of one prompt (text or token ids) by an engine that pools: the answer's `embedding`
        (base64 of little-endian float32) and `count` (the prompt's tokens). Refusals raise the typed errors
        of `inference_engine.errors`; leaving early (an exception while waiting) aborts the request."""
        message = embed_message(prompt, params, request_id, priority, self._core.owner_id)
        self._run(self._core.submit(model, message))
        stream = GenerationStream(self, model, message.id)
        self._owned(stream)
        try:
            reply = stream._next(self.settings.ack_timeout)
        except BaseException:
            self.abort(model, message.id)
            raise
        return answer(reply)

    def tokenize(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        add_special_tokens: bool = True,
        return_token_strs: bool = False,
    ) -> Tokenized:
        message = tokenize_message(prompt, messages, add_special_tokens, return_token_strs)
        return tokenized(self._call(model, message))

    def tokenizer_info(self, model: str) -> dict[str, Any]:
        """The model's tokenizer facts (special tokens, chat template, context length)."""
        return self._call(model, P.TokenizerInfo(uuid.uuid4().hex)).info

    def detokenize(self, model: str, token_ids: list[int]) -> str:
        return self._call(model, P.Detokenize(uuid.uuid4().hex, list(token_ids))).text

    def abort(self, model: str, request_id: str) -> None:
        """Abort a request wherever it is (queued or running); idempotent, unknown ids are harmless."""
        self._run(self._core.abort(model, request_id))

    def request_known(self, request_id: str, started: bool) -> bool:
        return self._run(self._core.request_known(request_id, started))

    def live_replicas(self, model: str) -> list[str]:
        return self._run(self._core.live_replicas(model))

    def list_models(self) -> list[P.ModelInfo]:
        """Served models with at least one live replica, and their heartbeats."""
        return self._run(self._core.list_models())

    def load_model(
        self,
        name: str,
        model: str | None = None,
        *,
        engine_args: dict | None = None,
        supervisor: str = "default",
        timeout: float | None = None,
    ) -> None:
        """Ask a supervisor to start an engine serving `model` (path; None = bundled default) as `name`.
        With `timeout`, wait until a replica of it is live."""
        self._run(self._core.control(supervisor, P.Load(name, model, engine_args or {})))
        if timeout is not None:
            self._wait_for(lambda: bool(self.live_replicas(name)), timeout, f"model {name!r} to load")

    def unload_model(self, name: str, *, supervisor: str = "default", timeout: float | None = None) -> None:
        self._run(self._core.control(supervisor, P.Unload(name)))
        if timeout is not None:
            self._wait_for(lambda: not self.live_replicas(name), timeout, f"model {name!r} to unload")

    def load_lora_adapter(self, model: str, lora_name: str, lora_path: str, timeout: float = 60.0) -> int:
        """Serve the PEFT adapter in folder `lora_path` (a path the engines can read) as `lora_name` on every
        replica of `model` (vLLM's /v1/load_lora_adapter); returns how many replicas loaded it. Replicas that
        start later load it too. Raises InvalidRequestError for an adapter they cannot serve."""
        message = P.LoadLoRA(uuid.uuid4().hex, lora_name, lora_path)
        return self._run(self._core.update_lora(model, message, timeout))

    def unload_lora_adapter(self, model: str, lora_name: str, timeout: float = 60.0) -> int:
        """Stop serving `lora_name` on every replica of `model`: new requests for it get ModelNotFoundError,
        running ones finish. Raises ModelNotFoundError when no replica serves it."""
        message = P.UnloadLoRA(uuid.uuid4().hex, lora_name)
        return self._run(self._core.update_lora(model, message, timeout))

    def _wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"timed out after {timeout:g}s waiting for {what}.")
            time.sleep(0.1)

    def _call(self, model: str, message: P.Tokenize | P.Detokenize | P.TokenizerInfo) -> P.Result:
        """A one-answer request (tokenize / detokenize) on the model's utility stream."""
        self._run(self._core.submit(model, message))
        return answer(GenerationStream(self, model, message.id)._next(self.settings.ack_timeout))
