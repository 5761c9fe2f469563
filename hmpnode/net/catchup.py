"""Catch-up: the node-wide reconciliation snapshot every session reconciles against.

One per node, not per connection: building the sets reads every held broadcast
(O(n)), so all sessions share one `syncset.SyncState`, brought up to date when a
reconciliation starts (what was stored since goes into a small overlay; the
base is rebuilt only when `refresh` says so). The sessions (`session.PeerSession`)
run the reconciliations; `syncset` says what is in the sets.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from hmpnode.net import syncset as SY

__all__ = ["Snapshots", "refresh"]


def refresh(state: SY.SyncState | None, *, now_us: int, last_seq: int, min_age_us: float) -> str:
    """What the shared snapshot needs now: "keep" it, "extend" it with what was stored
    since (cheap), or "build" it anew (O(n)): when there is none, or when it is older
    than `min_age_us` and an item nears its ttl or the overlay grew past MAX_OVERLAY."""
    if state is None:
        return "build"
    old = now_us - state.built_us >= min_age_us
    if old and (now_us >= state.stale_at_us or len(state.overlay) > SY.MAX_OVERLAY):
        return "build"
    return "keep" if state.last_seq == last_seq else "extend"


class Snapshots:
    """The node's reconciliation sets (`current`), read through the core's store port by
    `world` (hmpnode.net.drive.World); `last_seq` says what the store holds up to,
    `now_us` the wall time."""

    def __init__(self, world: Any, last_seq: Callable[[], int], now_us: Callable[[], int], settings: Any,
                 counters: Counter[str]):
        self.world = world
        self.last_seq = last_seq
        self.now_us = now_us
        self.settings = settings
        self.counters = counters
        self._state: SY.SyncState | None = None
        self._lock = asyncio.Lock()

    async def current(self) -> SY.SyncState:
        """The node-wide sets: one snapshot of the unscoped broadcasts for every link,
        brought up to date when a reconciliation starts: what was stored since goes into a
        small overlay (cheap); the base is rebuilt (O(n)) only when an item nears its ttl or
        the overlay grew past MAX_OVERLAY, and not more often than `sync_snapshot_seconds`."""
        async with self._lock:
            state = self._state
            now_us = self.now_us()
            margin = SY.MARGIN_US
            action = refresh(state, now_us=now_us, last_seq=self.last_seq(),
                             min_age_us=self.settings.mesh.sync_snapshot_seconds * 1e6)
            if action == "keep":
                return state
            if action == "extend":
                after = state.last_seq

                def extend(port):
                    last, rows = port.sync_rows(now_us + margin, after)
                    return SY.extend_state(state, rows, now_us=now_us, margin_us=margin, last_seq=last)

                self._state = state = await self.world.read(extend)
                self.counters["sync_snapshot_extended"] += 1
                return state

            def build(port):
                last, rows = port.sync_rows(now_us + margin, 0)
                return SY.build_state(rows, now_us=now_us, margin_us=margin, last_seq=last)

            self._state = state = await self.world.read(build)
            self.counters["sync_snapshots"] += 1
            return state
