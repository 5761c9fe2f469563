"""Gossip: offer every container this node stores to the peers allowed to have it.

Node-wide, not per connection (the sessions only judge and batch): the forward
loop follows the store by sequence number and hands each new batch to the core
(`MeshCore.forward`), whose plan picks who gets a container pushed (Plumtree
eager, `fanout` peers) and who gets it announced in a `container_delta` (lazy:
they ask if they lack it). The agent's directed containers are not gossiped: `outbox` delivers them.
What changes about a held container later (evaluations, referenced-by, expiry,
revocation) goes out in `container_delta` modified/removed (hmpnode.net.delta).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from hmpnode.net import delta, drive
from hmpnode.net.core import FORWARD_BATCH
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.host import Host
    from hmpnode.net.provide import Publisher

__all__ = ["forward_loop", "forward"]

log = logging.getLogger("hmpnode.mesh")

async def forward_loop(mesh: Host, publisher: Publisher) -> None:
    """Offer every newly stored container to the peers allowed to have it.
    A first look reads only a few columns; bodies are read only when a peer
    is connected (a node without peers pays next to nothing per container)."""
    cursor = mesh.node.last_seq
    while True:
        tick = mesh.node.changed()
        if tick.done():  # the node stopped (a live node's tick resolves only after a commit)
            return
        after = cursor
        if not mesh.sessions:  # nobody to offer them to: only what gets a DHT provider record matters
            if mesh.dht is None:
                cursor = max(cursor, mesh.node.last_seq)  # every seq up to it is committed
                await asyncio.shield(tick)
                continue
            cursor, marks = await mesh.node.db.read(lambda conn: ms.provided_after(conn, after, FORWARD_BATCH))
            try:
                await publisher.queue_provider_records(marks)
            except Exception:
                log.exception("forwarding failed")
            if len(marks) < FORWARD_BATCH:
                await asyncio.shield(tick)
            continue
        marks = await mesh.node.db.read(lambda conn: ms.stored_after(conn, after, FORWARD_BATCH))
        if marks:
            cursor = marks[-1].seq
            try:
                await publisher.queue_provider_records(marks)
                if mesh.sessions:
                    for i in range(0, len(marks), 500):
                        seqs = [m.seq for m in marks[i:i + 500]]
                        rows = await mesh.node.db.read(lambda conn: db.get_by_seq(conn, seqs))
                        await forward(mesh, rows)
                        await delta.after_stored(mesh, rows)  # referenced-by of what they point at changed
            except Exception:  # one bad batch must not stop gossip
                log.exception("forwarding failed")
        if len(marks) < FORWARD_BATCH:
            await asyncio.shield(tick)


async def forward(mesh: Host, rows: list[db.StoredContainer]) -> None:
    """Push or announce stored containers to the peers allowed to have them (`MeshCore.forward`)."""
    await drive.run(mesh.core.forward(rows), mesh.world)
