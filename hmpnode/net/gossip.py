"""Gossip: offer every container this node stores to the peers allowed to have it.

Node-wide, not per connection (the sessions only judge and batch): the forward
loop follows the store by sequence number, and for each new container
`session.plan_forward` picks who gets it pushed (Plumtree eager, `fanout` peers)
and who gets it announced in a `container_delta` (lazy: they ask if they lack
it). The agent's directed containers are not gossiped: `outbox` delivers them.
What changes about a held container later (evaluations, referenced-by, expiry,
revocation) goes out in `container_delta` modified/removed (hmpnode.net.delta).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from hmpnode.net import delta
from hmpnode.net import mce as M
from hmpnode.net import provide
from hmpnode.net import session as SE
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.mesh import Mesh

__all__ = ["forward_loop", "forward", "announce"]

log = logging.getLogger("hmpnode.mesh")

#: new rows the forward loop reads at a time
FORWARD_BATCH = 2000


async def forward_loop(mesh: Mesh) -> None:
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
                await provide.queue_provider_records(mesh, marks)
            except Exception:
                log.exception("forwarding failed")
            if len(marks) < FORWARD_BATCH:
                await asyncio.shield(tick)
            continue
        marks = await mesh.node.db.read(lambda conn: ms.stored_after(conn, after, FORWARD_BATCH))
        if marks:
            cursor = marks[-1].seq
            try:
                await provide.queue_provider_records(mesh, marks)
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


async def forward(mesh: Mesh, rows: list[db.StoredContainer]) -> None:
    now = mesh.node.now()
    now_us = db.to_us(now)
    push: dict[str, list[db.StoredContainer]] = {}
    offer: dict[str, dict[str, Any]] = {}
    sessions = [s.session for s in mesh.sessions.values() if not s.closed]
    for row in rows:
        if row.expired(now_us):
            continue
        head = row.hmp_container["head"]
        if row.source == "agent" and head.get("broadcast") is not True:
            continue  # the agent's directed containers are the outbox's to deliver (once per connection)
        origin = row.source[5:] if row.source.startswith("peer:") else None
        eager, lazy = SE.plan_forward(head, row.did, sessions, origin=origin, now=now,
                                      fanout=mesh.settings.fanout, rng=mesh._rng)
        for s in eager:
            push.setdefault(s.did, []).append(row)
        if lazy:
            entry = M.index_entry(row.hmp_container)  # one entry, announced to every lazy peer
            for s in lazy:
                offer.setdefault(s.did, {})[row.did] = entry
    for did, items in push.items():
        link = mesh.sessions.get(did)
        if link is not None:
            await mesh.push(link, items)
    if offer:
        mesh._spawn(announce(mesh, offer, mesh.settings.announce_delay_ms / 1000))


async def announce(mesh: Mesh, offer: dict[str, dict[str, Any]], delay: float) -> None:
    """Announce to the lazy peers after `delay` (Plumtree's lazy push): the pushes travel
    the eager tree first, so a peer asks only when the tree did not bring it (a request
    for an announced container grafts the link) and an announcement that would race the
    push grafts nothing; a peer that told us meanwhile that it has it is not told."""
    if delay > 0:
        await asyncio.sleep(delay)
    now = mesh.node.now()
    for did, added in offer.items():
        link = mesh.sessions.get(did)
        if link is not None and link.session.announce(added, now):
            await link.flush()

