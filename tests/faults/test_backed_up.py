"""A client that stops reading a long streamed answer while keeping its socket open (so the web worker's send
buffer fills and the rest of the answer waits on the server's side), then vanishes (its socket reset): the
engine stops generating the answer and frees its KV blocks within a few seconds, over SSE and over the chat
WebSocket. The clients are blocking sockets with a small receive buffer, so nothing on their side reads
ahead; the test checks that the server's send queue for the connection really backed up before the client
goes."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from inference_engine.bus.client import EngineClient

from .stack import MODEL, LauncherStack

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 460  # the stack's context is 512 tokens
FREED_WITHIN = 5.0


def _engine(bus: EngineClient) -> dict:
    """The serving replica's heartbeat."""
    (model,) = [m for m in bus.list_models() if m.name == MODEL]
    return model.replicas[0].data


def _idle(bus: EngineClient, timeout: float = 120) -> dict:
    """The heartbeat of an engine with nothing in flight (an earlier test's answers may still be ending)."""
    deadline = time.monotonic() + timeout
    while True:
        data = _engine(bus)
        if data["inflight"] == 0 and data["time"] > time.time() - 3:
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.2)


def _send_queue(server_port: int, client_port: int) -> int:
    """Bytes the server's side of the connection from `client_port` has not got acknowledged yet."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)
            if local == server_port and remote == client_port:
                return int(fields[4].split(":")[0], 16)
    return 0


def _connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the smallest the kernel allows, set before
    # connecting so the window offered stays as small
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    return sock


def _read_until(sock: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    while marker not in got:
        chunk = sock.recv(4096)
        assert chunk, f"closed before {marker!r}: {got[-2000:]!r}"
        got += chunk
    return got


def _sse_client(stack: LauncherStack) -> socket.socket:
    """A streamed chat completion with large chunks (20 top logprobs a token), read up to its first token."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    sock = _connect(stack.port)
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
            f"Authorization: Bearer {stack.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    got = _read_until(sock, b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200"), got
    _read_until(sock, b'"top_logprobs"', got)
    return sock


def _ws_client(stack: LauncherStack) -> socket.socket:
    """A chat answer on the WebSocket, read up to its first ``delta`` message."""
    sock = _connect(stack.port)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET /ws/chat/ HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Protocol: llmserve.chat, llmserve.key.{stack.api_key}\r\n\r\n"
        ).encode()
    )
    got = _read_until(sock, b"\r\n\r\n")
    assert b" 101 " in got.split(b"\r\n")[0], got
    got = _read_until(sock, b'"ready"', got)
    message = {
        "type": "chat",
        "id": 1,
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    payload, mask = json.dumps(message).encode(), os.urandom(4)
    header = struct.pack("!BBH", 0x81, 0x80 | 126, len(payload))  # a masked text frame
    sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    _read_until(sock, b'"delta"', got)
    return sock


@pytest.mark.parametrize("client", [_sse_client, _ws_client], ids=["sse", "websocket"])
def test_a_backed_up_client_that_vanishes_is_aborted(
    launched: LauncherStack, client: Callable[[LauncherStack], socket.socket]
) -> None:
    bus = EngineClient(launched.redis_url)
    try:
        before = _idle(bus)
        sock = client(launched)
        client_port = sock.getsockname()[1]
        # The client reads no more: the server's send queue grows past what the client's window could take
        # (the rest of the answer waits on the server's side).
        window = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        deadline, backed_up = time.monotonic() + 60, 0
        while backed_up < 2 * window:
            assert time.monotonic() < deadline, f"the server's send queue never backed up: {backed_up} bytes"
            time.sleep(0.2)
            backed_up = _send_queue(launched.port, client_port)
        seen = time.time()
        while (running := _engine(bus))["time"] < seen:  # a heartbeat from after the backup
            time.sleep(0.1)
        assert running["inflight"] == 1, (backed_up, running["stats"], before["stats"])  # still generating
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # gone without a goodbye: a reset
        gone = time.monotonic()
        while (after := _engine(bus))["inflight"] or after["time"] < time.time() - 1:
            assert time.monotonic() - gone < FREED_WITHIN + 10, after
            time.sleep(0.1)
        freed = time.monotonic() - gone
    finally:
        bus.close()
    tokens = before["stats"]["generation_tokens_total"]
    generated = after["stats"]["generation_tokens_total"] - tokens
    free, total = before["stats"]["num_free_blocks"], before["stats"]["num_blocks"]
    print(
        f"\n{client.__name__}: {backed_up} bytes backed up on the server "
        f"({running['stats']['generation_tokens_total'] - tokens} tokens in); the engine idle {freed:.1f}s "
        f"after the reset, {generated} of {MAX_TOKENS} tokens generated, free blocks {free} -> "
        f"{after['stats']['num_free_blocks']} of {total}"
    )
    assert freed < FREED_WITHIN
    assert generated < MAX_TOKENS  # aborted, not generated to the end for nobody
    assert after["stats"]["num_free_blocks"] == free == total
