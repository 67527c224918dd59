"""The chat WebSocket against the launcher's real daphne workers, fed what no browser sends: oversized
messages and a seeded fuzzing pass over the protocol (bad JSON, wrong types, invalid UTF-8, binary and
control frames, reserved bits, unknown opcodes, fragments). Each either gets an ``error`` message on a socket
that still answers, or a close frame with a code: never a connection dropped without one."""

from __future__ import annotations

import asyncio
import json
import random
import struct

import pytest

from tests.chat.wsclient import PING, TEXT, ChatSocket

from .stack import MODEL, LauncherStack

pytestmark = pytest.mark.timeout(300)

MAX_BODY_BYTES = 2 * 2**20  # the app's default limit; daphne's own is twice that


async def _open(stack: LauncherStack) -> ChatSocket:
    base = f"http://127.0.0.1:{stack.port}"
    ws = await ChatSocket.open(
        base.replace("http", "ws") + "/ws/chat/",
        origin=base,
        protocols=["llmserve.chat", f"llmserve.key.{stack.api_key}"],
    )
    assert (await ws.receive())["type"] == "ready"
    return ws


async def _ending(
    ws: ChatSocket, timeout: float = 20, case: str = "", until: str | None = None
) -> tuple[list[dict], bool]:
    """The messages until the server goes quiet, closes, or sends one of type `until`, and whether it closed
    with a close frame. A connection that ends without one fails the test."""
    messages = []
    try:
        while True:
            message = await ws.receive(timeout)
            if message is None:
                return messages, True
            messages.append(message)
            if message["type"] == until:
                return messages, False
    except TimeoutError:
        return messages, False
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise AssertionError(
            f"{case}: the connection was dropped without a close frame after {messages}"
        ) from exc


def _chat(content: str) -> dict:
    return {"type": "chat", "id": 1, "model": MODEL, "messages": [{"role": "user", "content": content}]}


def test_an_oversized_message_gets_an_error_then_a_close_code(launched: LauncherStack) -> None:
    async def scenario() -> None:
        ws = await _open(launched)
        ws.send(_chat("x" * (MAX_BODY_BYTES + 1000)))
        messages, closed = await _ending(ws, timeout=5)
        assert [m["code"] for m in messages] == ["request_too_large"], messages
        assert closed and ws.close_code == 4413

        # Beyond what daphne reads at all: refused on the frame's header by the transport, with its code.
        ws = await _open(launched)
        ws.writer.write(
            struct.pack("!BBQ", 0x80 | TEXT, 0x80 | 127, 3 * MAX_BODY_BYTES) + bytes(4) + b"x" * 999
        )
        messages, closed = await _ending(ws, timeout=5)
        assert messages == [] and closed and ws.close_code == 1009

    asyncio.run(scenario())


def _cases(rng: random.Random) -> list[tuple[str, int, bytes, int]]:
    """(name, opcode, payload, first byte's FIN/RSV bits) of each fuzzing case."""
    text = [
        b"",
        b"null",
        b"[]",
        b"42",
        b'"chat"',
        b"{",
        b'{"type": 5}',
        b'{"type": "chat"}',
        b'{"type": "chat", "messages": "hi", "model": 3}',
        b'{"type": "chat", "model": "' + MODEL.encode() + b'", "messages": [{"role": "tool"}]}',
        b'{"type": "chat", "model": "x", "messages": [], "params": []}',
        b'{"type": "chat", "model": "x", "messages": [], "params": {"max_tokens": -1, "n": 5}}',
        b'{"type": "chat", "id": {"deep": [1, 2]}, "model": "' + MODEL.encode() + b'", "messages": [{}]}',
        b'{"type": "stop"}',
        b'{"type": "models", "extra": true}',
        b"[" * 5000 + b"]" * 5000,
        b'{"a": ' * 3000 + b"1" + b"}" * 3000,
        b'{"type": "chat", "messages": [{"role": "user", "content": "\\ud800"}], "model": "m"}',
        json.dumps(_chat("\u0000\u202e\U0001f600 " * 50)).encode(),
    ]
    cases = [(f"text {payload[:40]!r}", TEXT, payload, 0x80) for payload in text]
    cases += [
        ("invalid utf-8", TEXT, b'{"type": "\xff\xfe"}', 0x80),
        ("binary", 0x2, b"\x00\x01\x02", 0x80),
        ("reserved bit", TEXT, b"{}", 0x80 | 0x40),
        ("unknown opcode", 0x3, b"x", 0x80),
        ("unknown control opcode", 0xB, b"x", 0x80),
        ("continuation without start", 0x0, b"x", 0x80),
        ("fragment never finished", TEXT, b'{"type": ', 0x00),
        ("ping", PING, b"hello", 0x80),
        ("oversized ping", PING, b"x" * 200, 0x80),
    ]
    cases += [
        (f"random bytes {i}", TEXT if i % 2 else 0x2, rng.randbytes(rng.randint(1, 300)), 0x80)
        for i in range(10)
    ]
    return cases


def test_websocket_fuzzing_never_drops_a_socket_without_a_close_code(launched: LauncherStack) -> None:
    cases = _cases(random.Random(63))

    async def one(name: str, opcode: int, payload: bytes, bits: int) -> str:
        ws = await _open(launched)
        ws._frame(opcode, payload, bits)
        messages, closed = await _ending(ws, timeout=0.5, case=name)
        if closed:
            assert ws.close_code is not None and ws.close_code != 1006, (name, ws.close_code)
            return f"closed {ws.close_code}"
        kinds = {m["type"] for m in messages}
        assert kinds <= {"error", "models", "start", "delta", "end"}, (name, messages)
        ws.send({"type": "models"})  # still answering (or, mid-fragment, closing with a code)
        after, closed = await _ending(ws, timeout=10, case=name, until="models")
        if closed:
            assert ws.close_code is not None and ws.close_code != 1006, (name, ws.close_code)
            return f"closed {ws.close_code} on the next frame"
        assert any(m["type"] == "models" for m in after), (name, after)
        ws.close()
        return "error message" if any(m["type"] == "error" for m in messages) else "answered"

    async def run_all() -> dict[str, str]:
        return {case[0]: await one(*case) for case in cases}

    outcomes = asyncio.run(run_all())
    print("\n" + "\n".join(f"{name}: {outcome}" for name, outcome in outcomes.items()))
