"""Directed delivery: the agent's outbox, and what this node holds as a relay.

A directed container is for its recipients, not for gossip. The store hook (run
in the ingest transaction) puts the agent's directed containers into the
durable outbox, and, on a relay/mailman node, holds the ones a peer handed over
for others (admitted earlier by the relay quotas, `relayquota`). The outbox loop
delivers what is due: to the recipient (dialled if need be, `peers.reach`), else
to a relay that holds for it, else again later (`retry_at`); an entry leaves the
outbox on the recipient's or the relay's `container_ack`, or when it expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING

from hmpnode.container.encoding import parse_time
from hmpnode.container.payload import recipients_of
from hmpnode.net import delta, peers
from hmpnode.net.relayquota import hold_until_us
from hmpnode.net.scope import FORWARDING_ROLES
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.mesh import Link, Mesh

__all__ = ["store_hook", "outbox_loop", "deliver", "relay_for", "retry_at"]

log = logging.getLogger("hmpnode.mesh")


def retry_at(now_us: int, tries: int, *, base: float, cap: float, rng: random.Random) -> int:
    """When an undelivered entry is tried again: `base` seconds doubled per earlier
    try, at most `cap`, times a random 0.5..1.5 (so that retries to many recipients
    spread out instead of coming back in one burst)."""
    delay = min(cap, base * 2 ** min(tries, 20))
    return now_us + int(delay * (0.5 + rng.random()) * 1e6)


def store_hook(mesh: Mesh, conn, source: str, done) -> None:
    own = mesh.identity.did
    relay = mesh._relays
    now_us = mesh.node.now_us()
    holds, outbox = [], []
    for verdict, result in done:
        if result.status != "stored" or not result.seq:
            continue
        head = verdict.container["hmp_container"]["head"]
        recipients = recipients_of(head)
        if recipients:  # most containers name none: no second list for them
            recipients = [r for r in recipients if r != own]
        if not recipients:
            continue
        if source == "agent":
            outbox.extend((result.did, r, result.seq, now_us) for r in recipients)
        elif relay and head.get("broadcast") is not True and source.startswith("peer:"):
            sender = source[5:]
            admitted = mesh._relay_pending.get((sender, result.did))
            if admitted is None:
                continue
            address, hold_for, unknown, size = admitted
            ttl_us = db.to_us(parse_time(head["ttl"])) if isinstance(head.get("ttl"), str) else None
            until_us = hold_until_us(now_us, ttl_us, mesh.settings.relay_max_hold_seconds)
            holds.extend((r, result.seq, result.did, size, sender, address, 0 if r in unknown else 1, until_us)
                         for r in hold_for)
    if holds:
        ms.relay_hold(conn, holds)
    if outbox:
        ms.outbox_add(conn, outbox)
        loop = mesh._loop
        loop.call_soon_threadsafe(mesh._wake_outbox.set)


#: entries one pass of the outbox loop delivers (the rest in the passes that follow at once)
OUTBOX_BATCH = 1000
#: a peer with a relay role wakes the whole outbox: at most once per this many seconds
#: (anyone may claim the role and reconnect; each wake rewrites what waits)
WAKE_ALL_SECONDS = 1.0


def served_by(mesh: Mesh, arrived: set[str]) -> set[str] | None:
    """The recipients whose waiting mail the peers just connected (`arrived`) are a path
    to: each peer itself and the recipients that name it their mailman; everyone (None)
    when one of them is a relay, since any relay takes directed mail (`relay_for`)."""
    for did in arrived:
        link = mesh.sessions.get(did)
        if link is not None and not link.closed and FORWARDING_ROLES.intersection(link.roles):
            return None
    return set(arrived) | {r for r, row in mesh.peers.items() if not arrived.isdisjoint(row.mailman)}


async def outbox_loop(mesh: Mesh) -> None:
    """Deliver the agent's directed containers: recipient, its relays, or retry later. What
    waits is woken (due at once, not at its retry time) when a path to its recipient connects."""
    woke_all = float("-inf")
    while True:
        # cleared before reading: a wake-up set while this pass delivers is kept for the next
        mesh._wake_outbox.clear()
        now_us = mesh.node.now_us()
        arrived, mesh.outbox_arrived = mesh.outbox_arrived, set()
        wake = served_by(mesh, arrived) if arrived else set()
        if wake is None:
            mono = asyncio.get_running_loop().time()
            if mono - woke_all < WAKE_ALL_SECONDS:  # again soon: kept for a pass after the pause
                mesh.outbox_arrived |= arrived
                wake = set()
            else:
                woke_all = mono
        if wake is None or wake:
            woken = await mesh.node.db.write(lambda conn, wake=wake: ms.outbox_wake(conn, now_us, wake))
            mesh.counters["outbox_woken"] += woken
        due = await mesh.node.db.read(lambda conn: ms.outbox_due(conn, now_us, OUTBOX_BATCH))
        if due:
            by_recipient: dict[str, list[tuple[str, int, int, int]]] = {}
            for did, recipient, seq, tries, pushed_us in due:
                by_recipient.setdefault(recipient, []).append((did, seq, tries, pushed_us))
            outcomes = await asyncio.gather(*(deliver(mesh, r, entries) for r, entries in by_recipient.items()),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    log.error("outbox delivery failed", exc_info=outcome)
        if len(due) >= OUTBOX_BATCH:
            continue  # more are due now
        wait = WAKE_ALL_SECONDS if mesh.outbox_arrived else 0.5 if due else 1.0
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(mesh._wake_outbox.wait(), wait)


async def deliver(mesh: Mesh, recipient: str, entries: list[tuple[str, int, int, int]]) -> None:
    """Hand what is due for `recipient` (did, seq, tries, pushed_us) to the first path that
    takes it: the recipient if connected, a connected mailman of it, the recipient dialled,
    a mailman dialled, any connected relay; what none takes backs off (`retry_at`). On a
    connection that carried an entry already, it is sent again only once its acknowledgement
    is overdue (ack_timeout after it was handed over); until then it waits for that ack."""
    s = mesh.settings
    now = mesh.node.now()
    now_us = db.to_us(now)
    rows = await mesh.node.db.read(lambda conn: db.get_by_seq(conn, [seq for _, seq, _, _ in entries]))
    # revoked (signed after its sender's revocation): never delivered, like an expired one (protocol.md 32)
    ended = {r.did for r in rows if r.expired(now_us) or delta.is_revoked(mesh, r)}
    expired = [(r.did, recipient) for r in rows if r.did in ended]
    live = [r for r in rows if r.did not in ended]
    gone = {did for did, _, _, _ in entries} - {r.did for r in rows}
    if expired or gone:
        mesh.counters["outbox_expired"] += len(expired) + len(gone)
        await mesh.node.db.write(lambda conn: ms.outbox_done(conn, expired + [(d, recipient) for d in gone]))
    if not live:
        return
    pushed = {did: p for did, _, _, p in entries}
    async with contextlib.aclosing(_paths(mesh, recipient)) as paths:
        async for link in paths:
            if link is None or link.closed:
                continue
            live = await _hand_over(mesh, link, recipient, live, pushed, now)
            if not live:
                return
    tries = {did: t for did, _, t, _ in entries}
    retry = [(retry_at(now_us, tries.get(r.did, 0), base=s.retry_base, cap=s.retry_max, rng=mesh._rng), r.did,
              recipient) for r in live]
    mesh.counters["outbox_deferred"] += len(retry)
    await mesh.node.db.write(lambda conn: ms.outbox_retry(conn, retry))


async def _hand_over(mesh: Mesh, link: Link, recipient: str, live: list[db.StoredContainer], pushed: dict[str, int],
                     now) -> list[db.StoredContainer]:
    """Push to `link` (the recipient, or a relay for it) what it may receive of `live`; the
    rest. What its acknowledgement is overdue for is sent again even if this connection
    carried it; what it carried more recently waits for that acknowledgement."""
    now_us = db.to_us(now)
    ack_us = int(mesh.settings.ack_timeout * 1e6)
    via = None if link.did == recipient else recipient
    eligible = [r for r in live if link.session.may_receive(r.hmp_container["head"], now, as_relay=via is not None)]
    if not eligible:
        return live
    overdue = [r for r in eligible if now_us - pushed.get(r.did, 0) >= ack_us]
    sent = await mesh.push(link, overdue, relay_for=via, again=True)
    sent += await mesh.push(link, [r for r in eligible if r not in overdue], relay_for=via)
    carried = {r.did for r in sent}
    waiting = [(pushed[r.did] + ack_us, r.did, recipient) for r in eligible if r.did not in carried]

    def write(conn):
        ms.outbox_sent(conn, [(now_us + ack_us, now_us, r.did, recipient) for r in sent])
        ms.outbox_wait(conn, waiting)

    await mesh.node.db.write(write)
    mesh.counters["outbox_via_relay" if via else "outbox_direct"] += len(sent)
    return [r for r in live if r not in eligible]


async def _paths(mesh: Mesh, recipient: str):
    """The ways to `recipient`, in order; each is looked for only when the ones before
    did not take everything: the recipient connected, a connected mailman of it, the
    recipient dialled, a mailman dialled or any connected relay (`relay_for`)."""
    yield mesh.sessions.get(recipient)
    yield _connected_mailman(mesh, recipient)
    if recipient not in mesh.sessions:
        yield await peers.reach(mesh, recipient)
    yield await relay_for(mesh, recipient)


def _connected_mailman(mesh: Mesh, recipient: str) -> Link | None:
    row = mesh.peers.get(recipient)
    for did in row.mailman if row else ():
        link = mesh.sessions.get(did)
        if link is not None and not link.closed:
            return link
    return None


async def relay_for(mesh: Mesh, recipient: str) -> Link | None:
    """A connection to a relay that holds for `recipient`: one of its announced
    mailmen, else any connected relay."""
    row = mesh.peers.get(recipient)
    mailmen = list(row.mailman) if row else []
    if not mailmen and mesh.dht is not None and row is None:
        record = await mesh.dht.find_peer(recipient)
        mailmen = list(record.mailman) if record else []
    for did in mailmen:
        link = mesh.sessions.get(did) or await peers.reach(mesh, did)
        if link is not None:
            return link
    relays = [s for s in mesh.sessions.values() if FORWARDING_ROLES.intersection(s.roles) and not s.closed]
    return relays[0] if relays else None
