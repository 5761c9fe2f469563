"""`container_delta` `modified` and `removed` (spec 5.2.4, 5.6; docs/protocol.md 32).

What changes about a container after it was announced is said in a delta, not by
sending it again:

- `modified`: a held container gained evaluations or referenced-by links (from the
  agent, or from a peer). The peers that may hold it (the gossip rule, 23.1; never
  the peer the change came from) get an entry with its index head and the hashes of
  its current blocks (`evaluations_hash`, `referenced-by_hash`). A peer that holds
  it and whose own hash differs asks for that block (`request_evaluations` /
  `request_referenced-by` of a `container_request`, 22.2); one that lacks the
  container takes the entry as an offer of it (and asks for it, with evaluations).
- `removed`: a held container whose ttl passed, or that its sender's key revocation
  makes invalid (signed after the revocation instant, profile section 4: it came in
  before the revocation did), is no longer served. The peers that have it (the
  connection's ledger) are told, and for a revocation also the peers that may
  receive it, with `removed_reasons` naming why and the revoking announcement's
  DID, which a peer that lacks the revocation can fetch and check.

A received `removed` never deletes anything on the peer's word. What this node can
check itself (the ttl of a container it holds, a revocation it holds) is applied:
relay holdings of it are dropped, and it is not served nor forwarded (both follow
from the data: `revoked`, scope's expiry rule). What it cannot check is counted
(`delta_removed_unverified`) and the peer is not offered that container again;
when the peer names a revocation we lack, we ask it for that announcement. A DID we
do not hold is not waited for from that peer any more.

Sans-IO core: `hmpnode.net.deltaplan` (`DeltaQueue`: coalescing, node-wide rate, bounded;
`modified_entry`, `plan_modified`, the removals as read and sent; the block hashes are
`index.block_hashes`), and here `judge_removal`, `revoked`; the functions taking a mesh
are the adapter (store reads, sessions).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from hmpnode.container.backlinks import links_from_related
from hmpnode.net.deltaplan import (EXPIRED, REASONS, REVOKED, DeltaLimits, DeltaQueue, Removal, modified_entry,
                                   plan_modified, read_removals, removal_wire)
from hmpnode.net.core import revoked
from hmpnode.net.index import block_hashes
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.host import Host
    from hmpnode.net.link import Link
    from hmpnode.net.session import Modified, Removed

__all__ = ["DeltaLimits", "Removal", "DeltaQueue", "modified_entry", "plan_modified", "read_removals",
           "removal_wire", "pointed_at", "judge_removal", "revoked", "REASONS", "EXPIRED", "REVOKED"]

log = logging.getLogger("hmpnode.mesh")


# -- decisions on what the store holds ---------------------------------------------------------------------------


def pointed_at(rows: Iterable[db.StoredContainer], now_us: int) -> dict[str, str | None]:
    """The containers these new (unexpired) ones point at (`related`), each with the peer
    the pointing ones all came from (None: more than one, or the agent)."""
    pointing: dict[str, str | None] = {}
    for row in rows:
        related = row.hmp_container.get("related")
        if not related or row.expired(now_us):
            continue
        origin = row.source[5:] if row.source.startswith("peer:") else None
        for _, target in links_from_related(row.did, related):
            pointing[target] = origin if pointing.get(target, origin) == origin else None
    return pointing


def judge_removal(facts: ms.Facts | None, now_us: int, revoked_at: datetime | None) -> str:
    """A peer says it removed a container: `not_held`, or what we can check ourselves
    (`expired`, `revoked`: applied), or `unverified` (recorded only)."""
    if facts is None:
        return "not_held"
    if facts.ttl_us is not None and facts.ttl_us <= now_us:
        return EXPIRED
    if revoked(facts.ts_us, revoked_at):
        return REVOKED
    return "unverified"


# -- the adapter: store reads and sessions ----------------------------------------------------


def changed(mesh: Host, did: str, origin: str | None = None) -> None:
    """`did` gained blocks: announce it in the next flush (a no-op without peers; what
    the full queue drops is counted by the loop, `delta_dropped`)."""
    if mesh.sessions:
        mesh.delta.changed(did, origin)


async def after_stored(mesh: Host, rows: Sequence[db.StoredContainer]) -> None:
    """New containers that point at held ones (`related`) change those containers'
    referenced-by: each target becomes `modified` (not to the peer the new one came from)."""
    pointing = pointed_at(rows, mesh.node.now_us())
    if not pointing:
        return
    targets = list(pointing)
    held = await mesh.node.db.read(lambda conn: db.held_of(conn, targets))
    for target in targets:
        if target in held:
            changed(mesh, target, pointing[target])


async def revocations(mesh: Host, revoked_now: Sequence[tuple[str, datetime]]) -> None:
    """Senders whose key was just revoked: the containers of theirs we hold that were
    signed after the revocation are removed (relay holdings dropped, announced)."""
    own = mesh.identity.did
    limit = mesh.delta.limits.max_pending
    for sender, at in revoked_now:
        at_us = db.to_us(at)

        def work(conn, sender=sender, at_us=at_us):
            dids, proof = ms.revoked_held(conn, sender, at_us, limit)
            return dids, proof, ms.relay_drop(conn, dids, own) if dids else 0

        dids, proof, dropped = await mesh.node.db.write(work)
        mesh.counters["delta_revoked_held"] += len(dids)
        mesh.counters["relay_dropped_revoked"] += dropped
        for did in dids:
            mesh.delta.gone(did, Removal(REVOKED, proof))


async def sweep_expired(mesh: Host, after_us: int) -> int:
    """Queue the containers whose ttl passed since `after_us` as removed; the new mark."""
    now_us = mesh.node.now_us()
    room = mesh.delta.limits.max_pending - len(mesh.delta)
    if room <= 0 or now_us <= after_us:
        return after_us
    rows = await mesh.node.db.read(lambda conn: ms.expiring(conn, after_us, now_us, room))
    for did, _ in rows:
        mesh.delta.gone(did, Removal(EXPIRED))
    # a full page: go on from its last ttl next time (rows of that same ttl come again: no harm)
    return rows[-1][1] - 1 if len(rows) >= room else now_us


async def flush(mesh: Host) -> int:
    """Send what the queue lets go now, one `container_delta` per peer; entries sent."""
    q = mesh.delta
    links = [link for link in mesh.sessions.values() if not link.closed]
    if not links or not len(q):
        return 0
    modified, removed = q.take(time.monotonic())
    if not modified and not removed:
        return 0
    mods = list(modified)

    def read(conn):
        rows = {r.did: r for r in (db.get_by_did(conn, d) for d in [*mods, *removed]) if r is not None}
        hashes = {d: block_hashes(db.evaluations_of(conn, d), db.backlinks_of(conn, d)) for d in mods if d in rows}
        return rows, hashes

    rows, hashes = await mesh.node.db.read(read)
    now, now_us = mesh.node.now(), mesh.node.now_us()
    per: dict[str, tuple[dict[str, Any], dict[str, Removal]]] = {link.did: ({}, {}) for link in links}
    for did, skip in modified.items():
        row = rows.get(did)
        if row is None or row.expired(now_us) or did not in hashes:
            continue
        entry = modified_entry(row.hmp_container, hashes[did])
        head = row.hmp_container["head"]
        for link in links:
            # a peer that lacks it takes the entry as an offer: only what it declared it wants (33.3)
            if link.did not in skip and mesh.core.eligible(link, row, now) \
                    and (did in link.session.known or link.session.wants(head, did)):
                per[link.did][0][did] = entry
    for did, removal in removed.items():
        row = rows.get(did)
        for link in links:
            if did in link.session.known or (removal.reason == REVOKED and row is not None
                                              and link.session.may_receive(row.hmp_container["head"], now)):
                per[link.did][1][did] = removal
    sent = 0
    for link in links:
        mod, rem = per[link.did]
        if (mod or rem) and not link.closed:
            sent += link.session.send_changes(mod, *removal_wire(rem), now)
            await link.flush()
    mesh.counters["delta_modified_sent"] += sum(len(m) for m, _ in per.values())
    mesh.counters["delta_removed_sent"] += sum(len(r) for _, r in per.values())
    return sent


async def delta_loop(mesh: Host) -> None:
    """Every `flush_seconds`: find what expired, then flush the queue."""
    mark = mesh.node.now_us()
    while True:
        await asyncio.sleep(mesh.delta.limits.flush_seconds)
        try:
            mark = await sweep_expired(mesh, mark)
            await flush(mesh)
        except Exception:  # one bad flush must not end the announcements
            log.exception("container_delta flush failed")
        mesh.counters["delta_dropped"] += mesh.delta.dropped
        mesh.delta.dropped = 0
        mesh.counters["delta_coalesced"] = mesh.delta.coalesced


async def on_modified(mesh: Host, link: Link, event: Modified) -> None:
    """A peer's `modified` entries: ask for the blocks whose hash differs from ours, take
    the entries of containers we lack as an offer of them."""
    dids = list(event.entries)

    def read(conn):
        held = db.held_of(conn, dids)
        return {d: block_hashes(db.evaluations_of(conn, d), db.backlinks_of(conn, d)) if d in held else None
                for d in dids}

    offered, ask_rb, ask_ev = plan_modified(event.entries, await mesh.node.db.read(read))
    mesh.counters["delta_modified_received"] += len(dids)
    await mesh.drive(link, link.session.offered_by_delta(offered, time.monotonic()))
    link.session.ask_blocks(ask_rb, ask_ev, mesh.node.now())


async def on_removed(mesh: Host, link: Link, event: Removed) -> None:
    """A peer's `removed` DIDs: apply what we can check, record the rest (module docstring)."""
    dids = event.dids
    facts = await mesh.node.db.read(lambda conn: ms.facts_of(conn, dids))
    now_us, registry = mesh.node.now_us(), mesh.node.registry
    verdicts = {d: judge_removal(facts.get(d), now_us, registry.revoked_at(facts[d].sender) if d in facts else None)
                for d in dids}
    applied = [d for d, v in verdicts.items() if v in REASONS]
    if applied and mesh.core.relaying:
        own = mesh.identity.did
        mesh.counters["relay_dropped_removed"] += await mesh.node.db.write(lambda conn: ms.relay_drop(conn, applied,
                                                                                                     own))
    proofs = []
    for did, verdict in verdicts.items():
        mesh.counters[f"delta_removed_{verdict}"] += 1
        if verdict == "unverified":
            why = event.reasons.get(did)
            if why is not None and why.reason == REVOKED and why.proof:
                proofs.append(why.proof)  # the revocation we lack: fetched, then checked like any container
    await mesh.drive(link, link.session.peer_removed(dids, verdicts, proofs, time.monotonic()))
