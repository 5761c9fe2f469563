"""The peers table and the dialing that keeps this node connected.

Node-wide: what announces (LAN, DHT, handshakes) say of other nodes is kept in
a bounded table (`remember`; memory and the store's `peers`, `dialing.peers_to_drop`
says what goes), and the connect loop dials from it until `target_peers`
connections and `min_outbound` of our own are up (`reach`: known addresses the
dial rule allows, else a DHT lookup, within the node-wide dial budget and a
per-peer back-off); the static peers (`addresses.StaticPeers`: the operator's, also
added and removed at run time) are kept connected on top. The decisions are
`dialing`'s; `Peers` owns the state around the table (who is being dialled, where
addresses were learnt, the dial budget) and carries them out; the driver only opens
the sockets (`Host.dial`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from hmpnode.net import dialing as D
from hmpnode.net.addresses import StaticError, StaticPeer, StaticPeers, parse_static
from hmpnode.net.scope import FORWARDING_ROLES
from hmpnode.net.announce import AnnounceCheck, parse_addr
from hmpnode.net.transport import PROTOCOLS
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.admission import Admission
    from hmpnode.net.host import Host
    from hmpnode.net.link import Link

__all__ = ["Peers", "STATIC_FILE"]

log = logging.getLogger("hmpnode.mesh")
#: how long, and for how many peers at most, the connect loop keeps trying to reach a peer
#: our agent had mail for (`Peers.reach_for_mail`)
WANTED_SECONDS = 600.0
WANTED_MAX = 256
#: the static peers added at run time (a JSON list of specs), in the data dir
STATIC_FILE = "static-peers.json"


class Peers:
    """The peers table's owner: the rows are the core's (`MeshCore.peers`), the rest here."""

    def __init__(self, host: Host, rng: random.Random, admission: Admission) -> None:
        self.host, self.rng, self.admission = host, rng, admission
        self.bans, self.pinned = admission.bans, admission.pinned
        self.table = host.peers
        self.policy = host.settings.dialing.policy
        #: the node-wide dial budget and each peer's back-off
        self.dials = host.settings.dialing.budget(random.Random(rng.getrandbits(64)))
        #: peers being dialled now
        self.dialing: set[str] = set()
        #: peers our agent has mail for that we could not reach yet -> until when (mono) the
        #: connect loop keeps trying (their back-off applies): mail that went on through a
        #: mailman meanwhile must not leave the two agents without a session for good
        self.wanted: collections.OrderedDict[str, float] = collections.OrderedDict()
        #: peer DID -> when its row was last written
        self.persisted: dict[str, int] = {}
        #: peer DID -> the addresses its current announce lists (before the dial rule)
        self.raw_addresses: dict[str, list[str]] = {}
        #: peer DID -> where its stored addresses were learnt (they are judged by it again when dialled)
        self.origins: dict[str, D.Origin] = {}
        #: set when a connection ended or new addresses came: the connect loop looks again
        self.wake = asyncio.Event()
        #: a peer that never answered gave up on: prune at the next maintenance
        self.prune_due = False
        #: the DHT socket is bound to loopback: every DHT record came from this host
        self.dht_local = False
        self._ifaces: tuple[float, list[Any]] = (-1e9, [])
        a = host.settings.addresses
        #: the static peers (peer.static and those added at run time, saved in `static_file`)
        self.static = StaticPeers(a.static, a.static_max)
        self.static_file: Path = host.node.data_dir / STATIC_FILE
        self._static_lock = asyncio.Lock()
        self._load_static()

    def interfaces(self) -> list[Any]:
        """The host's interfaces, read at most once a second (the dial rule judges
        addresses against their subnets)."""
        at, cached = self._ifaces
        mono = time.monotonic()
        if mono - at > 1.0:
            from hmpnode.net.interfaces import interfaces

            try:
                cached = interfaces()
            except OSError:
                cached = []
            self._ifaces = (mono, cached)
        return cached

    def vet(self, addresses: Iterable[Any], origin: D.Origin, *, count: bool = True) -> list[str]:
        """The addresses the dial rule allows for this origin; each refused one is
        counted (refused{area="dial"}) when `count`."""
        allowed, refused = D.vet(addresses, origin, self.policy)
        if count:
            for reason in refused:
                self.host.node.refuse("dial", reason)
                self.host.counters[f"dial_refused_{reason}"] += 1
        return allowed

    async def remember(self, check: AnnounceCheck, announce: dict[str, Any] | None, source: str,
                        origin: D.Origin, contact: bool = False) -> None:
        """Keep what an announce says of a peer, with only the addresses the dial
        rule allows for `origin` (where it was learnt); the table stays within
        `peers_max` (dialing.peers_to_drop)."""
        if check.did is None or check.did == self.host.identity.did:
            return
        now_us = self.host.node.now_us()
        announced_us = db.to_us(check.timestamp) if check.timestamp else 0
        old = self.table.get(check.did)
        if old is not None and old.announced_us > announced_us:
            return
        raw = list(check.addresses)
        # refusals are counted when an announce says something new, not on every repeat
        addresses = self.vet(raw, origin, count=raw != self.raw_addresses.get(check.did))
        if not set(PROTOCOLS).intersection(check.protocols):  # its peer port speaks nothing we do
            if raw != self.raw_addresses.get(check.did) and D.peer_addresses(addresses):
                self.host.node.refuse("dial", "no_common_protocol")
            addresses = [a for a in addresses if a not in D.peer_addresses(addresses)]
        if old is not None and addresses != old.addresses:
            self.dials.reset(check.did)  # new addresses: old failures say nothing about them
        row = ms.PeerRow(check.did, orjson.dumps(announce) if announce else None, addresses, list(check.roles),
                         list(check.mailman), announced_us, old.source if old else source, now_us,
                         now_us if contact else None)
        if old is not None and old.last_contact_us and not contact:
            row.last_contact_us = old.last_contact_us
        dropped: list[str] = []
        cap = self.host.settings.dialing.peers_max
        if old is None and len(self.table) >= cap:
            # a few at once, so that a flood of new DIDs does not sort the table for each one
            dropped = self.drop(cap - max(1, cap // 64), keep={check.did})
            if len(self.table) >= cap:
                self.host.node.refuse("dial", "peers_full")  # every row is a connected or configured peer
                return
        self.table[check.did] = row
        self.raw_addresses[check.did] = raw
        self.origins[check.did] = origin
        if contact:
            self.dials.succeeded(check.did)
        # A peer re-announces every few seconds: the store is written when what it
        # says changed, on contact, or once a minute (last seen), not every time.
        same = old is not None and (old.addresses, old.roles, old.mailman) == (row.addresses, row.roles, row.mailman)
        if same and not contact and not dropped and now_us - self.persisted.get(check.did, 0) < 60_000_000:
            return
        self.persisted[check.did] = now_us

        def write(conn):
            ms.delete_peers(conn, dropped)
            ms.upsert_peer(conn, row)

        await self.host.node.db.write(write)
        if not same and addresses:
            self.wake.set()

    def drop(self, cap: int, keep: Iterable[str] = ()) -> list[str]:
        """Take expired and surplus peers out of the in-memory table (dialing.peers_to_drop);
        the DIDs dropped, for the caller to delete from the store."""
        s = self.host.settings
        protected = {*self.host.sessions, *self.dialing, *s.mailman, *self.admission.static, *keep}
        facts = (D.PeerFacts(r.did, r.last_seen_us, r.last_contact_us) for r in self.table.values())
        expired, evicted = D.peers_to_drop(
            facts, cap=cap, now_us=self.host.node.now_us(), max_unanswered_age_us=int(s.dialing.unanswered_max_age * 1e6),
            give_up_after=s.dialing.give_up_after, failures=self.dials.failures, keep=protected)
        for did in expired + evicted:
            self.table.pop(did, None)
            self.persisted.pop(did, None)
            self.raw_addresses.pop(did, None)
            self.origins.pop(did, None)
        if expired:
            self.host.counters["peers_expired"] += len(expired)
        if evicted:
            self.host.counters["peers_evicted"] += len(evicted)
        return expired + evicted

    async def prune(self) -> None:
        dropped = self.drop(self.host.settings.dialing.peers_max)
        if dropped:
            await self.host.node.db.write(lambda conn: ms.delete_peers(conn, dropped))

    def on_lan_peer(self, accepted, source_ip: str, interface) -> None:
        check: AnnounceCheck = accepted.check
        origin = D.lan_origin(source_ip, [interface] if interface is not None else self.interfaces())
        self.host.counters["lan_announces"] += 1
        self.host.spawn(self.remember(check, accepted.container, "lan", origin))
        if self.host.dht is not None and check.did not in self.table:  # a new neighbour: a way into the DHT
            allowed, _ = D.vet(check.addresses, origin, self.policy, schemes=("udp",))
            if allowed:
                _, host, port = parse_addr(allowed[0])
                self.host.spawn(self.host.dht.add_bootstrap([(host, port)]))

    async def reach_for_mail(self, did: str) -> Link | None:
        """`reach`, for a peer our agent has mail for: when it fails, the connect loop keeps
        trying for WANTED_SECONDS (at most WANTED_MAX peers, the oldest give way)."""
        link = await self.reach(did)
        if link is None and did not in self.host.sessions:
            self.wanted.pop(did, None)
            self.wanted[did] = time.monotonic() + WANTED_SECONDS
            while len(self.wanted) > WANTED_MAX:
                self.wanted.popitem(last=False)
        return link

    async def reach(self, did: str) -> Link | None:
        """A link with `did`: dial a known address, else look it up in the DHT.

        Only addresses the dial rule allows (`dialing.check`, judged again for the
        peers table); each attempt takes a token of the node-wide dial budget, and a
        failed round backs this peer off exponentially."""
        if did == self.host.identity.did:
            return None
        mono = time.monotonic()
        if did in self.dialing or not self.dials.due(did, mono) or self.bans.banned(did, mono):
            return self.host.sessions.get(did)
        self.dialing.add(did)
        try:
            row = self.table.get(did)
            # judged again by where they were learnt; rows read from the store, by the table rule
            origin = (self.origins.get(did) or D.table_origin(self.interfaces())) if row else None
            addresses = D.peer_addresses(self.vet(row.addresses if row else [], origin, count=False)) if origin else []
            # none known, or the known ones failed last round: its DHT record may name newer ones
            # (a node behind a NAT announces a relay:// address once it holds a reservation)
            stale = not addresses or self.dials.failures(did) > 0
            if stale and self.host.dht is not None and self.host.node.registry.revoked_at(did) is None:
                record = await self.host.dht.find_peer(did)
                if record is not None:
                    # a DHT peer record names no protocol: its addresses are tried, the handshake decides
                    check = AnnounceCheck(True, did=did, addresses=tuple(record.addresses), roles=tuple(record.roles),
                                          mailman=tuple(record.mailman), timestamp=record.timestamp,
                                          protocols=PROTOCOLS)
                    origin = D.dht_origin(self.dht_local)
                    await self.remember(check, None, "dht", origin)
                    addresses = D.peer_addresses(self.vet(record.addresses, origin, count=False))
                    self.host.counters["dht_found"] += 1
            if not addresses or origin is None:
                if did in self.wanted:  # tried again by the connect loop: backed off like a failed dial
                    self.dials.failed(did, time.monotonic())
                else:
                    self.dials.defer(did, time.monotonic() + self.host.settings.dialing.backoff_base)
                return None
            for addr in addresses:
                if not self.dials.take(time.monotonic()):
                    self.host.counters["dial_rate_limited"] += 1
                    self.host.node.refuse("dial", "rate_limited")
                    return None  # not this peer's failure: tried again when the budget refills
                link = await self.host.dial(addr, expect_did=did, origin=origin)
                if link is not None and link.did == did:
                    self.dials.succeeded(did)
                    self.wanted.pop(did, None)
                    return link
            failures = self.dials.failed(did, time.monotonic())
            self.host.counters["dial_failed_rounds"] += 1
            if failures >= self.host.settings.dialing.give_up_after and row is not None and not row.last_contact_us:
                self.prune_due = True  # never answered: forgotten at the next maintenance
            return None
        finally:
            self.dialing.discard(did)

    async def connect_loop(self) -> None:
        """Keep `target_peers` connections to known peers, and at least `min_outbound`
        of its own whatever its inbound ones (peers that dialled it cannot cut it off);
        pinned and static peers are kept connected on top."""
        s = self.host.settings
        while True:
            self.wake.clear()
            pinned = [d for d in self.pinned if d not in self.host.sessions and d != self.host.identity.did]
            # our mailmen: the best ranked relays we know (MeshCore.relays_to_dial), kept like pinned peers
            mono = time.monotonic()
            known_relays = [d for d, row in self.table.items() if FORWARDING_ROLES.intersection(row.roles)
                            and D.peer_addresses(row.addresses) and not self.bans.banned(d, mono)]
            pinned += [d for d in self.host.core.relays_to_dial(known_relays, lambda d: self.dials.due(d, mono))
                       if d not in pinned and d not in self.dialing]
            for did in [d for d, until in self.wanted.items() if until <= mono or d in self.host.sessions]:
                del self.wanted[did]
            pinned += [d for d in self.wanted if d not in pinned and d not in self.dialing and self.dials.due(d, mono)]
            reaches = [self.reach(d) for d in pinned]  # reach keeps its own back-off per DID
            reaches += [self.reach_static(spec) for spec in list(self.static.entries)]
            if reaches:
                await asyncio.gather(*reaches, return_exceptions=True)
            live = [x for x in self.host.sessions.values() if not x.closed]
            outbound = sum(1 for x in live if x.initiator)
            want = D.connections_wanted(target=s.dialing.target_peers, min_outbound=s.dialing.min_outbound,
                                        live=len(live), outbound=outbound)
            if want > 0:
                mono = time.monotonic()
                candidates = [d for d, row in self.table.items()
                              if d not in self.host.sessions and d not in self.dialing
                              and self.dials.due(d, mono) and not self.bans.banned(d, mono)
                              and D.peer_addresses(row.addresses)]
                self.rng.shuffle(candidates)
                # no more rounds than the dial budget has tokens for (each round takes at least one)
                want = min(want, int(self.dials.available(mono)))
                if candidates and want > 0:
                    await asyncio.gather(*(self.reach(d) for d in candidates[:want]), return_exceptions=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 1.0)

    # -- static peers (hmpnode.net.addresses) ---------------------------------------------------

    def _load_static(self) -> None:
        """The static peers added at run time, from the data dir. A file that cannot be read,
        or an entry of it that is bad or over peer.static_max, is logged and skipped (never
        a node that cannot start)."""
        try:
            specs = orjson.loads(self.static_file.read_bytes())
        except FileNotFoundError:
            specs = []
        except (OSError, orjson.JSONDecodeError) as exc:
            log.error("%s: %s; static peers added at run time skipped", self.static_file, exc)
            specs = []
        for spec in specs if isinstance(specs, list) else [specs]:
            try:
                self.static.add(parse_static(spec))
            except StaticError as exc:
                log.error("%s: %s; skipped", self.static_file, exc)
        self._static_changed()

    async def _save_static(self) -> None:
        from hmpnode.fsutil import write_private_file

        await asyncio.to_thread(write_private_file, self.static_file, orjson.dumps(self.static.runtime()), replace=True)

    async def add_static(self, spec: object) -> tuple[StaticPeer, bool]:
        """Add a static peer at run time (saved: it outlives a restart) and dial it now;
        (the peer, False when it was there already). StaticError for a bad spec or a full
        list; OSError when it cannot be saved (nothing changed then)."""
        peer = parse_static(spec)
        async with self._static_lock:
            added = self.static.add(peer)
            if added:
                try:
                    await self._save_static()
                except OSError:
                    del self.static.entries[peer.spec]
                    raise
        self._static_changed()
        self.wake.set()
        return peer, added

    async def remove_static(self, key: str) -> list[StaticPeer]:
        """Take out the static peers `key` names (a spec, or their DID): no longer dialled nor
        given a pinned slot (a connection to it stays, as an ordinary peer's). StaticError
        when none or a configured one; OSError when it cannot be saved (nothing changed)."""
        async with self._static_lock:
            entries, seen = dict(self.static.entries), dict(self.static.seen)
            removed = self.static.remove(key)
            try:
                await self._save_static()
            except OSError:
                self.static.entries, self.static.seen = entries, seen
                raise
        for peer in removed:
            self.dials.reset(_static_key(peer.spec))
        self._static_changed()
        return removed

    def _static_changed(self) -> None:
        """The static peers' DIDs changed: admission gives them a slot like pinned peers,
        connections already open included."""
        dids = self.static.dids()
        self.admission.static.clear()
        self.admission.static.update(dids)
        for link in self.host.sessions.values():
            link.pinned = self.admission.is_pinned(link.did, link.ip)

    def static_view(self) -> list[dict[str, Any]]:
        """The static peers as the API shows them."""
        out = []
        for spec, peer in self.static.entries.items():
            did = self.static.did_of(spec)
            link = self.host.sessions.get(did) if did else None
            out.append({"spec": spec, "addr": peer.addr, "did": peer.did, "seen_did": self.static.seen.get(spec),
                        "configured": spec in self.static.configured,
                        "connected": link is not None and not link.closed,
                        "failures": self.dials.failures(_static_key(spec))})
        return out

    async def reach_static(self, spec: str) -> None:
        """Dial a static peer that is not connected, within the node-wide dial budget and
        its own back-off. Its address is the operator's (dialing.OPERATOR: any range, host
        names); a DID given must be the one the handshake proves, else the connection is
        closed (refused{area="peer",reason="wrong_did"}) and the peer backed off."""
        peer = self.static.entries.get(spec)
        if peer is None:
            return
        key, mono = _static_key(spec), time.monotonic()
        did = self.static.did_of(spec)
        if key in self.dialing or not self.dials.due(key, mono) or did == self.host.identity.did:
            return
        if did is not None and (did in self.host.sessions or self.bans.banned(did, mono)):
            return
        if not self.dials.take(mono):
            self.host.counters["dial_rate_limited"] += 1
            self.host.node.refuse("dial", "rate_limited")
            return
        self.dialing.add(key)
        try:
            self.host.counters["static_dials"] += 1
            link = await self.host.dial(peer.addr, expect_did=peer.did, origin=D.OPERATOR, require_did=True)
            if link is None:
                self.dials.failed(key, time.monotonic())
                self.host.counters["static_dial_failed"] += 1
                return
            self.dials.succeeded(key)
            if peer.spec in self.static.entries and self.static.seen.get(spec) != link.did:
                self.static.seen[spec] = link.did
                self._static_changed()
        finally:
            self.dialing.discard(key)


def _static_key(spec: str) -> str:
    """A static peer's key in the dial budget's back-off (beside the DIDs there)."""
    return "static " + spec
