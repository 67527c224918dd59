"""A minimal asyncio WebSocket client (RFC 6455: handshake, masked text frames, close, ping) for the tests
against a real daphne. No library fits: autobahn's asyncio flavour clashes with the Twisted one daphne loads,
and the `websockets` package is not a dependency of the project."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from typing import Any
from urllib.parse import urlsplit

TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA


class HandshakeRefused(Exception):
    pass


class ChatSocket:
    """``await ChatSocket.open(url, ...)``, then `send` / `receive`; `drop()` cuts the TCP connection with no
    close frame."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, subprotocol: str | None
    ) -> None:
        self.reader, self.writer, self.subprotocol = reader, writer, subprotocol
        self.close_code: int | None = None  # the code of the server's close frame, once it sent one

    @classmethod
    async def open(
        cls, url: str, *, origin: str, protocols: list[str], cookie: str | None = None
    ) -> ChatSocket:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                f"Origin: {origin}\r\nSec-WebSocket-Protocol: {', '.join(protocols)}\r\n"
                + (f"Cookie: {cookie}\r\n" if cookie else "")
                + "\r\n"
            ).encode()
        )
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
        status, *lines = head.strip().split("\r\n")
        if " 101 " not in status:
            writer.close()
            raise HandshakeRefused(status)
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        return cls(reader, writer, headers.get("sec-websocket-protocol"))

    def _frame(self, opcode: int, payload: bytes, first_bits: int = 0x80) -> None:
        """One masked frame; `first_bits`: FIN and RSV bits of the first byte (fuzzing sets others)."""
        mask = os.urandom(4)
        size = len(payload)
        if size < 126:
            header = struct.pack("!BB", first_bits | opcode, 0x80 | size)
        elif size < 2**16:
            header = struct.pack("!BBH", first_bits | opcode, 0x80 | 126, size)
        else:
            header = struct.pack("!BBQ", first_bits | opcode, 0x80 | 127, size)
        self.writer.write(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send(self, message: dict[str, Any]) -> None:
        self._frame(TEXT, json.dumps(message).encode())

    async def receive(self, timeout: float = 30) -> dict[str, Any] | None:
        """The next JSON message; None once the server closed the connection."""
        return await asyncio.wait_for(self._receive(), timeout)

    async def _receive(self) -> dict[str, Any] | None:
        while True:
            first, second = await self.reader.readexactly(2)
            size = second & 0x7F
            if size == 126:
                (size,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif size == 127:
                (size,) = struct.unpack("!Q", await self.reader.readexactly(8))
            payload = await self.reader.readexactly(size)
            opcode = first & 0x0F
            if opcode == TEXT:
                return json.loads(payload)
            if opcode == CLOSE:
                self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                return None
            if opcode == PING:
                self._frame(PONG, payload)

    def close(self) -> None:
        self._frame(CLOSE, struct.pack("!H", 1000))
        self.writer.close()

    def drop(self) -> None:
        self.writer.transport.abort()
