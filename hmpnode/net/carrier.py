"""A raw TCP stream as the peer transport's carrier (docs/protocol.md 28.2, 34.4).

A punched connection carries the v2 units directly: no HTTP, no WebSocket. `StreamCarrier`
gives it the small face of aiohttp's WebSocket that `link.Link` and `link.Opening` use
(`send_bytes`, `receive`, `close`), so the handshake, admission and the session run on
it unchanged (`Connections.handshake_on`). Reads are bounded: at most `chunk` bytes each,
and the units they hold are cut by the transport, which bounds a unit and a frame."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["StreamCarrier", "Message", "CHUNK"]

#: the most one read takes (the largest unit is 65 537 bytes)
CHUNK = 65_536


@dataclass(frozen=True, slots=True)
class Message:
    """What `receive` returns: the fields of aiohttp.WSMessage that the links read."""

    type: aiohttp.WSMsgType
    data: Any = None
    extra: Any = None


class StreamCarrier:
    """One TCP stream, as the links see a WebSocket: each read is a binary message."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, chunk: int = CHUNK) -> None:
        self.reader, self.writer, self.chunk = reader, writer, chunk
        self.closed = False
        sock = writer.get_extra_info("socket")
        if sock is not None:  # a dead peer is noticed without traffic (the WebSocket pings for that)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    async def over(cls, sock: socket.socket, **kw: Any) -> StreamCarrier:
        """A carrier over a connected socket (it takes the socket over)."""
        reader, writer = await asyncio.open_connection(sock=sock, limit=2 * CHUNK)
        return cls(reader, writer, **kw)

    @property
    def peer(self) -> tuple[str, int] | None:
        addr = self.writer.get_extra_info("peername")
        return None if addr is None else (addr[0], addr[1])

    async def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("carrier closed")
        self.writer.write(data)
        await self.writer.drain()

    async def receive(self) -> Message:
        if self.closed:
            return Message(aiohttp.WSMsgType.CLOSED)
        try:
            data = await self.reader.read(self.chunk)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.closed = True
            return Message(aiohttp.WSMsgType.CLOSED)
        return Message(aiohttp.WSMsgType.BINARY, data)

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        """Close the stream (a WebSocket close code has no place on it and is dropped)."""
        if self.closed and self.writer.is_closing():
            return False
        self.closed = True
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)
        return True
