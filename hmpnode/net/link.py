"""One authenticated peer connection: its WebSocket and AEAD transport around the
sans-IO session (hmpnode.net.session.PeerSession), which holds the protocol state.

Below the driver (`mesh`) and the node-wide jobs, which all pass links around."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hmpnode.net.mce import ERROR_REASONS
from hmpnode.net.peerauth import PeerInfo
from hmpnode.net.scope import Channel
from hmpnode.net.session import PeerSession, refusal_of
from hmpnode.net.transport import NoiseHandshake, Transport, TransportError, UnitReader

__all__ = ["Link", "Opening", "close_quietly", "CLOSE_REFUSED"]

#: WebSocket close code of a refusal before the handshake completed (reason: our code)
CLOSE_REFUSED = 4403


@dataclass(eq=False)
class Link:
    """One connection (the module docstring)."""

    ws: Any
    info: PeerInfo
    session: PeerSession
    started: float
    #: address and subnet keys of its slot (hmpnode.net.slots)
    address: str = ""
    subnet: str | None = None
    pinned: bool = False
    #: the session's AEAD records (hmpnode.net.transport.Transport)
    transport: Any = None
    #: frames that arrived with the handshake's last message, not yet handled
    backlog: list[bytes] = field(default_factory=list)
    #: what reconciliation found moves one transfer at a time
    transfer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: the circuit relay's DID when the connection runs through a circuit (docs/protocol.md 34.3)
    via: str | None = None
    closed: bool = False

    @property
    def did(self) -> str:
        return self.info.did

    @property
    def roles(self) -> tuple[str, ...]:
        return self.info.announce.roles

    @property
    def ip(self) -> str:
        return self.session.ip

    @property
    def channel(self) -> Channel:
        return self.session.channel

    @property
    def initiator(self) -> bool:
        return self.session.initiator

    @property
    def lazy(self) -> bool:
        return self.session.lazy

    async def flush(self, *, closing: bool = False) -> bool:
        """Send the frames the session queued, each as its record(s) in one binary
        WebSocket message (encrypted under the lock: the record counters follow the
        order on the wire); `closing`: also after the link was marked closed."""
        async with self.send_lock:
            if self.closed and not closing:
                return False  # what is queued stays for the closing flush (an error frame, 21.5)
            frames = self.session.data_to_send()
            try:
                for data in frames:
                    await self.ws.send_bytes(self.transport.encrypt(data))
                return True
            except (ConnectionError, RuntimeError, aiohttp.ClientError, TransportError):
                self.closed = True
                return False


    async def frames(self, failed: Callable[[str, bool], None]):
        """The link's frames: the decrypted records of its binary WebSocket messages
        (split anyhow). Ends with the connection, or at the first record that fails:
        tampered, replayed, reordered, injected, truncated (docs/protocol.md 21.6), told to
        `failed(reason, cut)`. Such a failure earns no strike (a man in the middle can
        cause it; `cut` only when the session says so); a frame over the limit inside the
        channel does."""
        while self.backlog and not self.closed:
            yield self.backlog.pop(0)
        while not self.closed:
            msg = await self.ws.receive()
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.ERROR):
                if msg.type == aiohttp.WSMsgType.ERROR and "size" in str(msg.data).lower():
                    failed("frame_too_large", False)  # unauthenticated: no strike
                return
            if msg.type != aiohttp.WSMsgType.BINARY:
                failed("text_message", False)
                return
            try:
                frames = self.transport.feed(msg.data)
            except TransportError as exc:
                failed(exc.reason, self.session.record_failed(exc.reason, time.monotonic()))  # a Refused: cut off
                return
            for frame in frames:
                yield frame


class Opening:
    """A WebSocket in its v2 handshake (hmpnode.net.transport, docs/protocol.md 21.2): the
    Noise messages within `deadline` (monotonic), then the records sent with the last one."""

    def __init__(self, ws, hs: NoiseHandshake, deadline: float, counters: Counter[str]) -> None:
        self.ws, self.hs, self.deadline, self.counters = ws, hs, deadline, counters
        self._reader, self._units = UnitReader(), collections.deque()

    def refused(self, reason: str) -> None:
        """The peer refused us (e.g. handshake_refused_clock_skew: it finds our clock off)."""
        self.counters["handshake_refused"] += 1
        self.counters[f"handshake_refused_{reason if reason in ERROR_REASONS else 'other'}"] += 1

    async def receive(self) -> bytes | None:
        """The next binary message within the handshake's time; None when the peer
        closed (counted: refused with a reason, or failed)."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError
        msg = await asyncio.wait_for(self.ws.receive(), remaining)
        if msg.type == aiohttp.WSMsgType.BINARY:
            return msg.data
        if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == CLOSE_REFUSED:
            self.refused(str(msg.extra or ""))
        else:
            self.counters["handshake_failed"] += 1
        return None

    async def exchange(self) -> tuple[Transport, list[bytes]] | None:
        """Run the handshake's messages: the transport and the frames that came with the
        last message, or None when the peer closed. TransportError when it failed."""
        hs, units = self.hs, self._units
        while not hs.complete:
            if hs.my_turn():
                await self.ws.send_bytes(hs.write_message())
                continue
            while not units:
                data = await self.receive()
                if data is None:
                    return None
                units.extend(self._reader.feed(data))
            hs.read_message(units.popleft())
        transport = hs.transport()
        # records sent right after the last handshake message, in the same WebSocket message
        return transport, transport.feed(b"".join(units) + self._reader.rest())

    async def verdict(self, transport: Transport, backlog: list[bytes]) -> bool:
        """The initiator waits for the responder's verdict: the empty frame (admitted: True),
        or an error frame (refused, counted: False)."""
        while not backlog:
            data = await self.receive()
            if data is None:
                return False
            backlog.extend(transport.feed(data))
        reason = refusal_of(backlog.pop(0))
        if reason is not None:
            self.refused(reason)
            return False
        return True


async def close_quietly(ws) -> None:
    with contextlib.suppress(Exception):
        await ws.close()
