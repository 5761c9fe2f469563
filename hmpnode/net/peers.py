"""The peers table and the dialing that keeps this node connected.

Node-wide: what announces (LAN, DHT, handshakes) say of other nodes is kept in
a bounded table (`remember`; memory and the store's `peers`, `dialing.peers_to_drop`
says what goes), and the connect loop dials from it until `target_peers`
connections and `min_outbound` of our own are up (`reach`: known addresses the
dial rule allows, else a DHT lookup, within the node-wide dial budget and a
per-peer back-off). The decisions are `dialing`'s; this module carries them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson

from hmpnode.net import dialing as D
from hmpnode.net.scope import FORWARDING_ROLES
from hmpnode.net.announce import AnnounceCheck, parse_addr
from hmpnode.net.transport import PROTOCOLS
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.mesh import Link, Mesh

__all__ = ["remember", "drop_peers", "prune", "on_lan_peer", "reach", "connect_loop"]


async def remember(mesh: Mesh, check: AnnounceCheck, announce: dict[str, Any] | None, source: str,
                    origin: D.Origin, contact: bool = False) -> None:
    """Keep what an announce says of a peer, with only the addresses the dial
    rule allows for `origin` (where it was learnt); the table stays within
    `peers_max` (dialing.peers_to_drop)."""
    if check.did is None or check.did == mesh.identity.did:
        return
    now_us = mesh.node.now_us()
    announced_us = db.to_us(check.timestamp) if check.timestamp else 0
    old = mesh.peers.get(check.did)
    if old is not None and old.announced_us > announced_us:
        return
    raw = list(check.addresses)
    # refusals are counted when an announce says something new, not on every repeat
    addresses = mesh._vet(raw, origin, count=raw != mesh._raw_addresses.get(check.did))
    if not set(PROTOCOLS).intersection(check.protocols):  # its peer port speaks nothing we do
        if raw != mesh._raw_addresses.get(check.did) and any(a.startswith("tcp://") for a in addresses):
            mesh.node.refuse("dial", "no_common_protocol")
        addresses = [a for a in addresses if not a.startswith("tcp://")]
    if old is not None and addresses != old.addresses:
        mesh.dials.reset(check.did)  # new addresses: old failures say nothing about them
    row = ms.PeerRow(check.did, orjson.dumps(announce) if announce else None, addresses, list(check.roles),
                     list(check.mailman), announced_us, old.source if old else source, now_us,
                     now_us if contact else None)
    if old is not None and old.last_contact_us and not contact:
        row.last_contact_us = old.last_contact_us
    dropped: list[str] = []
    cap = mesh.settings.dialing.peers_max
    if old is None and len(mesh.peers) >= cap:
        # a few at once, so that a flood of new DIDs does not sort the table for each one
        dropped = drop_peers(mesh, cap - max(1, cap // 64), keep={check.did})
        if len(mesh.peers) >= cap:
            mesh.node.refuse("dial", "peers_full")  # every row is a connected or configured peer
            return
    mesh.peers[check.did] = row
    mesh._raw_addresses[check.did] = raw
    mesh._origins[check.did] = origin
    if contact:
        mesh.dials.succeeded(check.did)
    # A peer re-announces every few seconds: the store is written when what it
    # says changed, on contact, or once a minute (last seen), not every time.
    same = old is not None and (old.addresses, old.roles, old.mailman) == (row.addresses, row.roles, row.mailman)
    if same and not contact and not dropped and now_us - mesh._persisted.get(check.did, 0) < 60_000_000:
        return
    mesh._persisted[check.did] = now_us

    def write(conn):
        ms.delete_peers(conn, dropped)
        ms.upsert_peer(conn, row)

    await mesh.node.db.write(write)
    if not same and addresses:
        mesh._wake_connect.set()


def drop_peers(mesh: Mesh, cap: int, keep: Iterable[str] = ()) -> list[str]:
    """Take expired and surplus peers out of the in-memory table (dialing.peers_to_drop);
    the DIDs dropped, for the caller to delete from the store."""
    s = mesh.settings
    protected = {*mesh.sessions, *mesh._dialing, *s.mailman, *keep}
    facts = (D.PeerFacts(r.did, r.last_seen_us, r.last_contact_us) for r in mesh.peers.values())
    expired, evicted = D.peers_to_drop(
        facts, cap=cap, now_us=mesh.node.now_us(), max_unanswered_age_us=int(s.dialing.unanswered_max_age * 1e6),
        give_up_after=s.dialing.give_up_after, failures=mesh.dials.failures, keep=protected)
    for did in expired + evicted:
        mesh.peers.pop(did, None)
        mesh._persisted.pop(did, None)
        mesh._raw_addresses.pop(did, None)
        mesh._origins.pop(did, None)
    if expired:
        mesh.counters["peers_expired"] += len(expired)
    if evicted:
        mesh.counters["peers_evicted"] += len(evicted)
    return expired + evicted


async def prune(mesh: Mesh) -> None:
    dropped = drop_peers(mesh, mesh.settings.dialing.peers_max)
    if dropped:
        await mesh.node.db.write(lambda conn: ms.delete_peers(conn, dropped))


def on_lan_peer(mesh: Mesh, accepted, source_ip: str, interface) -> None:
    check: AnnounceCheck = accepted.check
    origin = D.lan_origin(source_ip, [interface] if interface is not None else mesh._interfaces())
    mesh.counters["lan_announces"] += 1
    mesh._spawn(remember(mesh, check, accepted.container, "lan", origin))
    if mesh.dht is not None and check.did not in mesh.peers:  # a new neighbour: a way into the DHT
        allowed, _ = D.vet(check.addresses, origin, mesh.dial_policy, schemes=("udp",))
        if allowed:
            _, host, port = parse_addr(allowed[0])
            mesh._spawn(mesh.dht.add_bootstrap([(host, port)]))


async def reach(mesh: Mesh, did: str) -> Link | None:
    """A link with `did`: dial a known address, else look it up in the DHT.

    Only addresses the dial rule allows (`dialing.check`, judged again for the
    peers table); each attempt takes a token of the node-wide dial budget, and a
    failed round backs this peer off exponentially."""
    if did == mesh.identity.did:
        return None
    mono = time.monotonic()
    if did in mesh._dialing or not mesh.dials.due(did, mono) or mesh.bans.banned(did, mono):
        return mesh.sessions.get(did)
    mesh._dialing.add(did)
    try:
        row = mesh.peers.get(did)
        # judged again by where they were learnt; rows read from the store, by the table rule
        origin = (mesh._origins.get(did) or D.table_origin(mesh._interfaces())) if row else None
        addresses = [a for a in mesh._vet(row.addresses if row else [], origin, count=False)
                     if a.startswith("tcp://")] if origin else []
        if not addresses and mesh.dht is not None and mesh.node.registry.revoked_at(did) is None:
            record = await mesh.dht.find_peer(did)
            if record is not None:
                # a DHT peer record names no protocol: its addresses are tried, the handshake decides
                check = AnnounceCheck(True, did=did, addresses=tuple(record.addresses), roles=tuple(record.roles),
                                      mailman=tuple(record.mailman), timestamp=record.timestamp,
                                      protocols=PROTOCOLS)
                origin = D.dht_origin(mesh._dht_local())
                await remember(mesh, check, None, "dht", origin)
                addresses = [a for a in mesh._vet(record.addresses, origin, count=False) if a.startswith("tcp://")]
                mesh.counters["dht_found"] += 1
        if not addresses or origin is None:
            mesh.dials.defer(did, time.monotonic() + mesh.settings.dialing.backoff_base)
            return None
        for addr in addresses:
            if not mesh.dials.take(time.monotonic()):
                mesh.counters["dial_rate_limited"] += 1
                mesh.node.refuse("dial", "rate_limited")
                return None  # not this peer's failure: tried again when the budget refills
            link = await mesh.dial(addr, expect_did=did, origin=origin)
            if link is not None and link.did == did:
                mesh.dials.succeeded(did)
                return link
        failures = mesh.dials.failed(did, time.monotonic())
        mesh.counters["dial_failed_rounds"] += 1
        if failures >= mesh.settings.dialing.give_up_after and row is not None and not row.last_contact_us:
            mesh._wake_prune = True  # never answered: forgotten at the next maintenance
        return None
    finally:
        mesh._dialing.discard(did)


async def connect_loop(mesh: Mesh) -> None:
    """Keep `target_peers` connections to known peers, and at least `min_outbound`
    of its own whatever its inbound ones (peers that dialled it cannot cut it off);
    pinned peers are kept connected on top."""
    s = mesh.settings
    while True:
        mesh._wake_connect.clear()
        pinned = [d for d in mesh._pinned if d not in mesh.sessions and d != mesh.identity.did]
        # our mailmen: the best ranked relays we know (MeshCore.relays_to_dial), kept like pinned peers
        mono = time.monotonic()
        known_relays = [d for d, row in mesh.peers.items() if FORWARDING_ROLES.intersection(row.roles)
                        and any(a.startswith("tcp://") for a in row.addresses) and not mesh.bans.banned(d, mono)]
        pinned += [d for d in mesh.core.relays_to_dial(known_relays, lambda d: mesh.dials.due(d, mono))
                   if d not in pinned and d not in mesh._dialing]
        if pinned:  # reach keeps its own back-off per DID
            await asyncio.gather(*(reach(mesh, d) for d in pinned), return_exceptions=True)
        live = [x for x in mesh.sessions.values() if not x.closed]
        outbound = sum(1 for x in live if x.initiator)
        want = D.connections_wanted(target=s.dialing.target_peers, min_outbound=s.dialing.min_outbound,
                                    live=len(live), outbound=outbound)
        if want > 0:
            mono = time.monotonic()
            candidates = [d for d, row in mesh.peers.items()
                          if d not in mesh.sessions and d not in mesh._dialing
                          and mesh.dials.due(d, mono) and not mesh.bans.banned(d, mono)
                          and any(a.startswith("tcp://") for a in row.addresses)]
            mesh._rng.shuffle(candidates)
            # no more rounds than the dial budget has tokens for (each round takes at least one)
            want = min(want, int(mesh.dials.available(mono)))
            if candidates and want > 0:
                await asyncio.gather(*(reach(mesh, d) for d in candidates[:want]), return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(mesh._wake_connect.wait(), 1.0)
