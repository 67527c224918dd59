"""A small asyncio HTTP/1.1 client for load: one chat completion per connection, streamed (SSE) or not, with
what a load test needs to judge it (status, ``Retry-After``, text, finish reason, in-band error, ``[DONE]``,
time to first token). A thousand of them run in one process without a connection pool in the way; used by
tests/faults and benchmarks/serving.py. Only for servers on this machine."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    status: int | None = None  # None: no HTTP answer (refused, or cut before the headers)
    retry_after: str | None = None
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None  # the JSON error body, or an in-band SSE error event
    done: bool = False  # saw the end: ``[DONE]`` (stream) or the whole JSON body
    cut: bool = False  # the connection closed before the answer ended
    timed_out: bool = False
    ttft: float | None = None
    elapsed: float = 0.0

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason is not None and self.error is None

    @property
    def clean_error(self) -> bool:
        """Failed in a way a client can act on: an HTTP error with a JSON body, an in-band error event that
        ends with ``[DONE]``, or a closed connection — never a hang."""
        if self.timed_out:
            return False
        if self.status is not None and self.status != 200:
            return self.error is not None
        return (self.error is not None and self.done) or self.cut


async def chat(
    port: int,
    api_key: str,
    model: str,
    content: str = "Say something about the sea.",
    *,
    stream: bool = True,
    timeout: float = 120.0,
    first_token: asyncio.Event | None = None,
    **params: Any,
) -> Outcome:
    """One ``POST /v1/chat/completions`` to 127.0.0.1:`port`; `params` are body fields (max_tokens, ...)."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **params}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    outcome, start = Outcome(), time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            await _read(reader, outcome, stream, start, first_token)
    except TimeoutError:
        outcome.timed_out = True
    except (OSError, asyncio.IncompleteReadError, ValueError):
        outcome.cut = True
    finally:
        outcome.elapsed = time.perf_counter() - start
        if writer is not None:
            writer.close()
    return outcome


async def _read(
    reader: asyncio.StreamReader,
    outcome: Outcome,
    stream: bool,
    start: float,
    first_token: asyncio.Event | None,
) -> None:
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    outcome.status = int(status_line.split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    outcome.retry_after = headers.get("retry-after")
    chunks = _chunked(reader) if headers.get("transfer-encoding") == "chunked" else _plain(reader)
    if outcome.status != 200 or not stream:
        data = b"".join([chunk async for chunk in chunks])
        payload = json.loads(data) if data else {}
        outcome.error = payload.get("error")
        if outcome.status == 200:
            outcome.text = payload["choices"][0]["message"]["content"]
            outcome.finish_reason = payload["choices"][0]["finish_reason"]
            outcome.done = True
        return
    pending = b""
    async for chunk in chunks:
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                outcome.done = True
                return
            message = json.loads(data)
            if "error" in message:
                outcome.error = message["error"]
                continue
            for choice in message.get("choices", ()):
                text = choice.get("delta", {}).get("content") or ""
                if text and outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - start
                    if first_token is not None:
                        first_token.set()
                outcome.text += text
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    outcome.cut = True  # the body ended without [DONE]


async def _chunked(reader: asyncio.StreamReader):
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


async def _plain(reader: asyncio.StreamReader):
    while chunk := await reader.read(65536):
        yield chunk
