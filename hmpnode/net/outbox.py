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


async def outbox_loop(mesh: Mesh) -> None:
    """Deliver the agent's directed containers: recipient, its relays, or retry later."""
    while True:
        now_us = mesh.node.now_us()
        # recipients that just connected get what waits for them now, not at its next retry
        # (which backs off to peer retry_max while they are away)
        arrived, mesh.outbox_arrived = mesh.outbox_arrived, set()

        def read(conn, now_us=now_us, arrived=arrived):
            due = ms.outbox_due(conn, now_us, 1000)
            for recipient in sorted(arrived):
                due += ms.outbox_for(conn, recipient, 1000)
            return list(dict.fromkeys(due))

        due = await mesh.node.db.read(read)
        if due:
            by_recipient: dict[str, list[tuple[str, int, int]]] = {}
            for did, recipient, seq, tries in due:
                by_recipient.setdefault(recipient, []).append((did, seq, tries))
            outcomes = await asyncio.gather(*(deliver(mesh, r, entries) for r, entries in by_recipient.items()),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    log.error("outbox delivery failed", exc_info=outcome)
        mesh._wake_outbox.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(mesh._wake_outbox.wait(), 0.5 if due else 1.0)


async def deliver(mesh: Mesh, recipient: str, entries: list[tuple[str, int, int]]) -> None:
    s = mesh.settings
    now = mesh.node.now()
    now_us = db.to_us(now)
    rows = await mesh.node.db.read(lambda conn: db.get_by_seq(conn, [seq for _, seq, _ in entries]))
    # revoked (signed after its sender's revocation): never delivered, like an expired one (protocol.md 32)
    ended = {r.did for r in rows if r.expired(now_us) or delta.is_revoked(mesh, r)}
    expired = [(r.did, recipient) for r in rows if r.did in ended]
    live = [r for r in rows if r.did not in ended]
    gone = {did for did, _, _ in entries} - {r.did for r in rows}
    if expired or gone:
        mesh.counters["outbox_expired"] += len(expired) + len(gone)
        await mesh.node.db.write(lambda conn: ms.outbox_done(conn, expired + [(d, recipient) for d in gone]))
    if not live:
        return
    wait_ack = now_us + int(s.ack_timeout * 1e6)
    link = mesh.sessions.get(recipient) or await peers.reach(mesh, recipient)
    if link is not None:
        # what this connection carried already is not sent on it again (an ack can only be
        # lost with the connection; a new connection starts with nothing known)
        eligible = [r for r in live if mesh._eligible(link, r, now)]
        await mesh.node.db.write(lambda conn: ms.outbox_retry(conn, [(wait_ack, r.did, recipient) for r in eligible]))
        await mesh.push(link, eligible)
        mesh.counters["outbox_direct"] += len(eligible)
        live = [r for r in live if r not in eligible]
        if not live:
            return
    relay = await relay_for(mesh, recipient)
    if relay is not None:
        eligible = [r for r in live if relay.session.may_receive(r.hmp_container["head"], now, as_relay=True)]
        await mesh.node.db.write(lambda conn: ms.outbox_retry(conn, [(wait_ack, r.did, recipient) for r in eligible]))
        await mesh.push(relay, eligible, relay_for=recipient)
        mesh.counters["outbox_via_relay"] += len(eligible)
        live = [r for r in live if r not in eligible]
    if live:
        tries = {did: t for did, _, t in entries}
        retry = []
        for r in live:
            at = retry_at(now_us, tries.get(r.did, 0), base=s.retry_base, cap=s.retry_max, rng=mesh._rng)
            retry.append((at, r.did, recipient))
        mesh.counters["outbox_deferred"] += len(retry)
        await mesh.node.db.write(lambda conn: ms.outbox_retry(conn, retry))


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
