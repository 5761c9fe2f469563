"""One authenticated peer connection: its WebSocket and AEAD transport around the
sans-IO session (hmpnode.net.session.PeerSession), which holds the protocol state.

Below the driver (`mesh`) and the node-wide jobs, which all pass links around."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hmpnode.net.peerauth import PeerInfo
from hmpnode.net.scope import Channel
from hmpnode.net.session import PeerSession
from hmpnode.net.transport import TransportError

__all__ = ["Link", "close_quietly"]


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
            frames = self.session.data_to_send()
            if self.closed and not closing:
                return False
            try:
                for data in frames:
                    await self.ws.send_bytes(self.transport.encrypt(data))
                return True
            except (ConnectionError, RuntimeError, aiohttp.ClientError, TransportError):
                self.closed = True
                return False


async def close_quietly(ws) -> None:
    with contextlib.suppress(Exception):
        await ws.close()
