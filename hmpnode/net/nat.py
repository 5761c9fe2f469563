"""The driver's NAT side: the `nat` frames of peers that speak hmp-nat/1 (docs/protocol.md 34).

Each op (observed addresses and dial-back, circuit reservations, hole punching) registers
its handler here; a frame with an op this node does not know is counted and ignored (a
newer peer may send ops we do not speak), never an offence. The decisions each handler
carries out are sans-IO (`hmpnode.net.reach`, `circuit`, `punch`); this dispatches and
sends."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from hmpnode.net.link import Link
from hmpnode.net.session import NatReceived

__all__ = ["Nat", "Handler"]

log = logging.getLogger("hmpnode.mesh")

#: what handles one op: the link it came on and the whole frame (its members unchecked)
Handler = Callable[[Link, dict[str, Any]], Awaitable[None]]


class Nat:
    """The registry of `nat` frame ops and the dispatch of received frames."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self._handlers: dict[str, Handler] = {}

    def register(self, op: str, handler: Handler) -> None:
        if op in self._handlers:
            raise ValueError(f"nat op {op!r} registered twice")
        self._handlers[op] = handler

    @property
    def ops(self) -> frozenset[str]:
        return frozenset(self._handlers)

    async def on_frame(self, link: Link, event: NatReceived) -> None:
        handler = self._handlers.get(event.op)
        if handler is None:
            self.counters["nat_unknown_op"] += 1
            return
        self.counters[f"nat_received_{event.op}"] += 1
        await handler(link, event.message)
