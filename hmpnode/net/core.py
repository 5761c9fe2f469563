"""MeshCore: the node-wide decisions of the mesh, sans-IO (docs/architecture.md).

`session.PeerSession` decides everything about one connection; this module decides
what spans connections: whether a container a peer hands over is taken (scope, relay
quotas), what a relay holds and offers, one request per container across connections
(the ledger), who is pushed or announced a stored container (the forward plan), the
outbox's routing and back-off and what wakes it, and the deadlines of every session.

It never awaits, reads a clock, touches a socket, a thread or the store. Each
decision that needs the world is a generator of *effects* (`Effect` subclasses: read
or write the store through the port, ingest, run CPU work, send what a session
queued, dial, the time); a driver carries each out and sends the result back in
(`hmpnode.net.drive.run`). The node's driver is `hmpnode.net.mesh.Mesh` (SQLite,
sockets, verify threads); the simulator's is `hmpnode.sim` (a dict store, simulated
links, virtual time). The same generator code runs in both.

The store port (`StorePort`) is the narrow interface the core reads and writes
through; `hmpnode.store.port.SqlitePort` is the node's, `hmpnode.sim.store.MemoryPort`
the simulator's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import orjson

from hmpnode.container.encoding import parse_time
from hmpnode.container.payload import recipients_of
from hmpnode.logs import LogLimiter
from hmpnode.container.evaluations import evaluations_block
from hmpnode.net import ledger
from hmpnode.net import mce as M
from hmpnode.net import session as SE
from hmpnode.net import syncset as SY
from hmpnode.net.relay import append_relay
from hmpnode.net.relayquota import RelayLimits, RelayUsage, admit, hold_until_us
from hmpnode.net.scope import FORWARDING_ROLES, Channel, host_key, parse_ip
from hmpnode.store import StorageFull
from hmpnode.store.records import StoredContainer, to_us

__all__ = ["MeshCore", "Effect", "Read", "Write", "Ingest", "Offload", "Flush", "Reach", "FindPeer", "Clock",
           "Pause", "Sets", "Spawn", "CutOff", "Unhandled", "StorePort", "retry_at", "OUTBOX_BATCH", "WAKE_ALL_SECONDS", "FORWARD_BATCH", "MAILMEN"]

log = logging.getLogger("hmpnode.mesh")
limited = LogLimiter(log, 60.0)

#: new rows the forward loop reads at a time
FORWARD_BATCH = 2000
#: entries one pass of the outbox delivers (the rest in the passes that follow at once)
OUTBOX_BATCH = 1000
#: a peer with a relay role wakes the whole outbox: at most once per this many seconds
#: (anyone may claim the role and reconnect; each wake rewrites what waits)
WAKE_ALL_SECONDS = 1.0
#: the ways to a recipient of directed mail, in the order they are tried: the recipient
#: connected, a connected mailman of it, the recipient dialled, a relay (a mailman of it,
#: dialled if need be, else any connected relay)
PATHS = ("connected", "mailman", "dialled", "relay")
#: relays a node names as its mailmen (and keeps connected, best ranked first)
MAILMEN = 3


# -- effects: what a decision asks its driver to do, the result is sent back in ----------


class Effect:
    """One thing a core generator needs from the world."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Read(Effect):
    """`fn(port)` on a consistent view of the store; its result."""

    fn: Callable[[StorePort], Any]


@dataclass(frozen=True, slots=True)
class Write(Effect):
    """`fn(port)` in one durable transaction; its result."""

    fn: Callable[[StorePort], Any]


@dataclass(frozen=True, slots=True)
class Ingest(Effect):
    """Verify and store containers a peer handed over (its CPU charged to `link`); one
    result per item (`status`, `did`, `seq`, `reason`, `detail`). Raises StorageFull."""

    items: list[dict[str, Any]]
    source: str
    budget: int
    link: Any


@dataclass(frozen=True, slots=True)
class Offload(Effect):
    """Pure CPU work (`fn()`), charged to `link`'s verification budget; its result."""

    fn: Callable[[], Any]
    link: Any


@dataclass(frozen=True, slots=True)
class Flush(Effect):
    """Send what `link`'s session queued."""

    link: Any


@dataclass(frozen=True, slots=True)
class Reach(Effect):
    """A link with this DID: the connected one, else a dial (its budget and back-off are
    the driver's); None when there is none. `mail`: our agent has mail for it (the
    driver keeps trying to reach it for a while even when the mail goes another way)."""

    did: str
    mail: bool = False


@dataclass(frozen=True, slots=True)
class FindPeer(Effect):
    """The DHT's peer record of this DID (its `mailman`), or None."""

    did: str


@dataclass(frozen=True, slots=True)
class Clock(Effect):
    """The time: (wall `datetime`, monotonic seconds)."""


@dataclass(frozen=True, slots=True)
class Unhandled(Effect):
    """A session event the core leaves to its driver (refusals to log, clock samples,
    signed blocks, index queries, delta modified/removed)."""

    link: Any
    event: Any


@dataclass(frozen=True, slots=True)
class CutOff(Effect):
    """The peer crossed its strike threshold: ban it and close the link (admission's)."""

    link: Any


@dataclass(frozen=True, slots=True)
class Sets(Effect):
    """The node-wide reconciliation sets, up to date (hmpnode.net.syncset.SyncState)."""


@dataclass(frozen=True, slots=True)
class Spawn(Effect):
    """Run these steps on their own, not waiting for them (one link's transfer)."""

    steps: Any


@dataclass(frozen=True, slots=True)
class Pause(Effect):
    """Let other work run for this long (0: just yield) before going on."""

    seconds: float = 0.0


# -- what the core works with ---------------------------------------------------------------


class StorePort(Protocol):
    """The store as the core sees it (every method runs inside one read or write)."""

    def settled(self, dids: Sequence[str]) -> set[str]: ...  # held, or forgotten by the agent
    def rows_by_did(self, dids: Sequence[str]) -> list[StoredContainer]: ...
    def rows_by_seq(self, seqs: Sequence[int]) -> list[StoredContainer]: ...
    def containers_after(self, after: int, limit: int) -> list[StoredContainer]: ...
    def sync_rows(self, after_ttl_us: int, after_seq: int) -> tuple[int, list]: ...  # (last seq, SyncRows)
    def evaluations_of(self, dids: Sequence[str]) -> dict[str, list]: ...  # only those with some
    def backlinks_of(self, dids: Sequence[str]) -> dict[str, list]: ...  # every one asked
    def relay_usage(self, recipients: Iterable[str], sender: str, address: str | None) -> RelayUsage: ...
    def relay_hold(self, entries: list[tuple]) -> None: ...
    def relay_held_for(self, recipient: str, after: int, limit: int) -> list[StoredContainer]: ...
    def relay_release(self, recipient: str, dids: Sequence[str], own: str) -> int: ...
    def relay_expire(self, now_us: int, soon_us: int, own: str) -> tuple[dict[str, int], dict[str, int], int]: ...
    def relay_chains(self, seqs: Sequence[int]) -> dict[int, list]: ...
    def save_relay_chains(self, chains: list[tuple[int, list]]) -> None: ...
    def outbox_add(self, rows: list[tuple[str, str, int, int]]) -> None: ...
    def outbox_due(self, now_us: int, limit: int) -> list[tuple[str, str, int, int, int]]: ...
    def outbox_wake(self, now_us: int, recipients: Iterable[str] | None) -> int: ...
    def outbox_done(self, pairs: Iterable[tuple[str, str]]) -> None: ...
    def outbox_retry(self, rows: Iterable[tuple[int, str, str]]) -> None: ...
    def outbox_sent(self, sent: Iterable[tuple[int, int, str, str]], waiting: Iterable[tuple[int, str, str]]) -> None: ...


def retry_at(now_us: int, tries: int, *, base: float, cap: float, rng: random.Random) -> int:
    """When an undelivered entry is tried again: `base` seconds doubled per earlier
    try, at most `cap`, times a random 0.5..1.5 (so that retries to many recipients
    spread out instead of coming back in one burst)."""
    delay = min(cap, base * 2 ** min(tries, 20))
    return now_us + int(delay * (0.5 + rng.random()) * 1e6)


def revoked(ts_us: int, revoked_at: datetime | None) -> bool:
    """Signed after its sender's revocation instant: the verifier refuses it now (4.6)."""
    return revoked_at is not None and ts_us > to_us(revoked_at)


def address_key(link: Any) -> str | None:
    """What relay quotas per address count a peer under: its IPv4 address or IPv6 /64;
    None on loopback (every node of this host shares the address)."""
    session = link.session
    if session.channel is Channel.LOOPBACK:
        return None
    addr = parse_ip(session.ip)
    return session.ip if addr is None else host_key(addr)


Steps = Generator[Effect, Any, Any]


@dataclass
class MeshCore:
    """The node-wide state and decisions of one node's mesh (one per node)."""

    identity: Any
    settings: Any  # hmpnode.net.settings.MeshSettings
    rng: random.Random
    counters: Counter = field(default_factory=Counter)
    #: when a DID's key was revoked (None: not revoked): what was signed later is never served
    revoked_at: Callable[[str], datetime | None] = lambda did: None
    #: counts a refusal (area, reason, n) in the node's metrics
    refuse: Callable[..., None] = lambda area, reason, n=1: None
    #: checks a relay chain (hmpnode.net.relay.verify_relay_chain with the key registry): ok or not
    chain_ok: Callable[[list], bool] = lambda chain: False
    #: a peer handed over a container that gained blocks: `modified` to the others (delta queue)
    on_changed: Callable[[str, str | None], None] = lambda did, origin: None
    #: the referenced-by block this node signs for a DID and its backlinks (None without links)
    referenced_by_block: Callable[[str, list], dict | None] = lambda did, links: None

    def __post_init__(self) -> None:
        s = self.settings
        self.own = self.identity.did
        #: peer DID -> its live link (the driver registers and drops them)
        self.links: dict[str, Any] = {}
        #: peer DID -> what we know of it (hmpnode.store.mesh.PeerRow: mailman, addresses)
        self.peers: dict[str, Any] = {}
        self.ledger = ledger.Ledger(s.mesh.ledger_max_entries, s.mesh.ledger_session_entries)
        #: this node holds containers for others (relay/mailman role)
        self.relaying = bool(FORWARDING_ROLES.intersection(s.roles))
        self.relay_limits: RelayLimits = s.relay
        #: (sending peer, container DID) -> (sender address key, recipients to hold it for,
        #: unknown ones, size charged): admitted by `_accepts`, read by `store_hook`
        self.relay_pending: dict[tuple[str, str], tuple[str, tuple[str, ...], frozenset[str], int]] = {}
        #: peers connected since the outbox last looked: what waits for them goes at once
        self.outbox_arrived: set[str] = set()
        self._woke_all = float("-inf")
        #: link -> reconciliation steps waiting for its transfer (one transfer at a time)
        self._transfers: dict[Any, deque[SE.ReconcileStep]] = {}

    # -- who is connected ------------------------------------------------------------------

    def live(self) -> list[Any]:
        return [link for link in self.links.values() if not link.closed]

    def relays(self) -> list[Any]:
        return [link for link in self.live() if FORWARDING_ROLES.intersection(link.roles)]

    # -- mailmen: the relays that hold for this node --------------------------------------------

    def rank(self, dids: Iterable[str], of: str | None = None) -> list[str]:
        """Relays in a node's own stable order (rendezvous hashing of its DID and theirs; `of`:
        whose, ours by default): the same after a restart, different from node to node (no
        relay gets everyone), and known to anyone who knows the DIDs."""
        own = (of or self.own).encode()
        return sorted(dids, key=lambda d: hashlib.sha256(own + b"|" + d.encode()).digest())

    def mailman(self, configured: Sequence[str] = ()) -> list[str]:
        """What our announce names as `mailman`: the configured relays, then the best
        ranked `MAILMEN` of the connected ones."""
        return list(dict.fromkeys([*configured, *self.rank(link.did for link in self.relays())[:MAILMEN]]))

    def relays_to_dial(self, known: Iterable[str], due: Callable[[str], bool]) -> list[str]:
        """The known relays to dial now so that the best ranked `MAILMEN` that answer are
        connected (on top of `target_peers`, as pinned peers are): mail held for us waits at
        the relays our announce named, and the same order after a restart brings us back to
        them. A relay in its dial back-off is passed over for the next one meanwhile."""
        out, kept = [], 0
        for did in self.rank(d for d in dict.fromkeys(known) if d != self.own):
            if kept >= MAILMEN:
                break
            link = self.links.get(did)
            if link is not None and not link.closed:
                kept += 1
            elif due(did):
                out.append(did)
                kept += 1
        return out

    def is_revoked(self, row: StoredContainer) -> bool:
        """The row was signed after its sender's recorded revocation (not served, not forwarded)."""
        return revoked(row.ts_us, self.revoked_at(row.hmp_container["head"]["sender_did"]))

    def eligible(self, link: Any, row: StoredContainer, now: datetime) -> bool:
        return link.session.may_receive(row.hmp_container["head"], now) and not self.is_revoked(row)

    # -- a peer hands over containers --------------------------------------------------------

    def _accepts(self, link: Any, head: Any, usage: RelayUsage | None, size: int, did: str,
                 now: datetime) -> tuple[bool, str]:
        """May this peer hand us this container? (scope, audience, relay quotas: a container
        a relay admits is noted in `relay_pending` for the store hook to hold)"""
        refusal = link.session.screen(head, now, self.settings.roles)
        if refusal is not None:
            return False, refusal
        recipients = recipients_of(head)
        if usage is None or head.get("broadcast") is True or not recipients:
            return True, "ok"
        others = tuple(r for r in dict.fromkeys(recipients) if r != self.own)
        unknown = frozenset(r for r in others if r not in self.peers)
        address = address_key(link)
        reason = admit(self.relay_limits, usage, sender=link.did, address=address, recipients=list(others),
                       unknown=unknown, size=size)
        if reason is not None:
            self.refuse("relay", reason)
            if self.own not in recipients:
                return False, reason
            others = ()  # for us: taken, but held for nobody else
        self.relay_pending[(link.did, did)] = (address or "", others, unknown, size)
        return True, "ok"

    def containers(self, link: Any, event: SE.ContainersReceived) -> Steps:
        """Screen (scope, relay quotas) and ingest a `containers` frame; the session answers
        with the ack and judges the invalid ones. The Ingested verdict (`offence.cut`: the
        driver cuts the peer off)."""
        items, dids, heads = event.items, event.dids, event.heads
        usage: RelayUsage | None = None
        if self.relaying:
            wanted = {r for h in heads if isinstance(h, dict) and h.get("broadcast") is not True
                      for r in recipients_of(h)}
            address = address_key(link)
            usage = yield Read(lambda port: port.relay_usage(wanted, link.did, address))
        now, mono = yield Clock()
        to_ingest: list[int] = []
        rejected: list[dict[str, Any]] = []
        for i, (item, head, did) in enumerate(zip(items, heads, dids, strict=True)):
            size = len(orjson.dumps(item)) if usage is not None else 0
            ok, reason = self._accepts(link, head, usage, size, did, now) if did else (False, "malformed")
            if ok:
                to_ingest.append(i)
            else:
                rejected.append({"container_did": did or "", "reason": reason, "detail": "not accepted from this peer"})
        outcomes: dict[int, Any] = {}
        if to_ingest:
            try:
                results = yield Ingest([items[i] for i in to_ingest], f"peer:{link.did}",
                                       self.settings.session.max_frame_decompressed_bytes, link)
                outcomes = dict(zip(to_ingest, results, strict=True))
            except StorageFull:  # our disk, not the peer's fault: unacknowledged, offered again later
                self.refuse("store", "storage_full", len(to_ingest))
                rejected += [{"container_did": dids[i] or "", "reason": "storage_full",
                              "detail": "the node's disk is full"} for i in to_ingest]
            finally:
                for i in to_ingest:
                    self.relay_pending.pop((link.did, dids[i]), None)
        now, mono = yield Clock()
        done = link.session.ingested(event, outcomes, rejected, mono, now)
        for result in outcomes.values():  # held already, with new evaluations: `modified` to the others (32)
            if result.status == "duplicate" and (getattr(result, "evaluations", None) or {}).get("active"):
                self.on_changed(result.did, link.did)
        chains = [(seq, items[i]["relay_chain"]) for i, seq in done.stored if items[i].get("relay_chain")]
        chains = [(seq, c) for seq, c in chains if self.chain_ok(c)]
        if chains:
            yield Write(lambda port: port.save_relay_chains(chains))
        yield from self._confirm_to_relays(link, done.for_us, now)
        yield Flush(link)
        if done.refused is not None:  # cut off: the session is closed
            yield CutOff(link)
        return done

    def _confirm_to_relays(self, source: Any, for_me: list[str], now: datetime) -> Steps:
        """Containers for us that other relays offered too: tell them we have them,
        so they stop holding them (their own offer may have come first)."""
        if not for_me:
            return
        for other in self.relays():
            if other is not source:
                other.session.confirm(for_me, now)
                yield Flush(other)

    def store_hook(self, port: StorePort, source: str, done: Iterable[tuple[Any, Any]], now_us: int) -> bool:
        """In the ingest transaction: the agent's directed containers enter the outbox, and
        a relay holds what a peer handed over for others (admitted by `_accepts`). True
        when the outbox got entries (the driver wakes its loop)."""
        holds, outbox = [], []
        for verdict, result in done:
            if result.status != "stored" or not result.seq:
                continue
            head = verdict.container["hmp_container"]["head"]
            recipients = recipients_of(head)
            if recipients:  # most containers name none: no second list for them
                recipients = [r for r in recipients if r != self.own]
            if not recipients:
                continue
            if source == "agent":
                outbox.extend((result.did, r, result.seq, now_us) for r in recipients)
            elif self.relaying and head.get("broadcast") is not True and source.startswith("peer:"):
                sender = source[5:]
                admitted = self.relay_pending.get((sender, result.did))
                if admitted is None:
                    continue
                address, hold_for, unknown, size = admitted
                ttl_us = to_us(parse_time(head["ttl"])) if isinstance(head.get("ttl"), str) else None
                until_us = hold_until_us(now_us, ttl_us, self.settings.relay.max_hold_seconds)
                holds.extend((r, result.seq, result.did, size, sender, address, 0 if r in unknown else 1, until_us)
                             for r in hold_for)
        if holds:
            port.relay_hold(holds)
        if outbox:
            port.outbox_add(outbox)
        return bool(outbox)

    # -- sending containers ----------------------------------------------------------------------

    def push(self, link: Any, rows: Sequence[StoredContainer], *, relay_for: str | None = None,
             asked: bool = False, again: bool = False) -> Steps:
        """Send held containers over one connection (the session picks which: each at
        most once, but `again` when their acknowledgement is overdue); the rows sent. A
        relay appends itself to the relay chain of what it carries for others."""
        by_did = {r.did: r for r in rows}
        rows = [by_did[d] for d in link.session.select_push([r.did for r in rows], relay_for=relay_for, asked=asked,
                                                            again=again)]
        if not rows:
            return []
        chains: dict[int, list] = {}
        if self.relaying:
            need = [r.seq for r in rows if r.source.startswith("peer:")
                    and self.own not in recipients_of(r.hmp_container["head"])]
            if need:
                chains = yield Read(lambda port: port.relay_chains(need))
        now, mono = yield Clock()
        items = []
        for row in rows:
            full: dict[str, Any] = {"hmp_container": row.hmp_container}
            if chains.get(row.seq) is not None:
                full["relay_chain"] = chains[row.seq]
                full = append_relay(full, self.identity, now=now)
            items.append(full)
        link.session.send_containers(items, mono)
        yield Flush(link)
        return rows

    def forward(self, rows: list[StoredContainer]) -> Steps:
        """Offer newly stored containers to the peers allowed to have them: `fanout` of them
        get a push (Plumtree eager), the others an announcement (lazy: they ask if they lack
        it). The agent's directed containers are the outbox's, not gossip's."""
        now, _ = yield Clock()
        now_us = to_us(now)
        push: dict[str, list[StoredContainer]] = {}
        offer: dict[str, dict[str, Any]] = {}
        sessions = [link.session for link in self.live()]
        for row in rows:
            if row.expired(now_us):
                continue
            head = row.hmp_container["head"]
            if row.source == "agent" and head.get("broadcast") is not True:
                continue  # the agent's directed containers are the outbox's to deliver (once per connection)
            origin = row.source[5:] if row.source.startswith("peer:") else None
            eager, lazy = SE.plan_forward(head, row.did, sessions, origin=origin, now=now,
                                          fanout=self.settings.mesh.fanout, rng=self.rng)
            for s in eager:
                push.setdefault(s.did, []).append(row)
            if lazy:
                entry = M.index_entry(row.hmp_container)  # one entry, announced to every lazy peer
                for s in lazy:
                    offer.setdefault(s.did, {})[row.did] = entry
        for did, items in push.items():
            link = self.links.get(did)
            if link is not None and not link.closed:
                yield from self.push(link, items)
        if offer:
            yield Spawn(self.announce(offer, self.settings.mesh.announce_delay_seconds))

    def announce(self, offer: dict[str, dict[str, Any]], delay: float) -> Steps:
        """Announce to the lazy peers after `delay` (Plumtree's lazy push): the pushes travel
        the eager tree first, so a peer asks only when the tree did not bring it (a request
        for an announced container grafts the link) and an announcement that would race the
        push grafts nothing; a peer that told us meanwhile that it has it is not told."""
        if delay > 0:
            yield Pause(delay)
        now, _ = yield Clock()
        for did, added in offer.items():
            link = self.links.get(did)
            if link is not None and not link.closed and link.session.announce(added, now):
                yield Flush(link)

    # -- what a peer's session asks of the node ----------------------------------------------------

    def requested(self, link: Any, event: SE.Requested) -> Steps:
        """A peer's `container_request`: a page of what we hold after its cursor, the
        containers it named and their referenced-by and evaluations (of those it may have)."""
        session = link.session
        now, _ = yield Clock()
        if event.after is not None:
            after, page = event.after, self.settings.session.delta_page
            rows = yield Read(lambda port: port.containers_after(after, page))
            added = {r.did: M.index_entry(r.hmp_container) for r in rows if self.eligible(link, r, now)}
            session.answer_page(added, now, after=after, read=[r.seq for r in rows])
        if event.answer:
            wanted = event.dids
            rows = yield Read(lambda port: port.rows_by_did(wanted))
            rows = [r for r in rows if self.eligible(link, r, now)]
            session.answer_request([(r.did, r.hmp_container["head"]["signature"]) for r in rows], now)
            yield from self.push(link, rows, asked=True)
        asked_rb, asked_ev = event.referenced_by, event.evaluations
        if asked_rb or asked_ev:
            asked = list(dict.fromkeys(asked_rb + asked_ev))
            rows = yield Read(lambda port: port.rows_by_did(asked))
            # nothing about containers the peer may not have
            allowed = {r.did for r in rows if self.eligible(link, r, now)}
            rb = [d for d in asked_rb if d in allowed]
            ev = [d for d in asked_ev if d in allowed]
            links, evaluations = yield Read(lambda port: (port.backlinks_of(rb), port.evaluations_of(ev)))
            if asked_rb:
                blocks = {did: self.referenced_by_block(did, found) for did, found in links.items()}
                session.send_mce("referenced-by_exchange", {d: b for d, b in blocks.items() if b}, now)
            if evaluations:
                session.send_mce("evaluations_exchange", {d: evaluations_block(i) for d, i in evaluations.items()},
                                 now)
        yield Flush(link)

    def offered(self, link: Any, event: SE.Offered) -> Steps:
        """The peer holds these: the session asks for what we lack (one request per
        container across connections: another peer's offer is taken up only if the
        first one did not deliver within a while). An offer of thousands is taken in
        slices with other work between, its requests signed as offloaded work at the
        peer's expense: one index of 4 800 DIDs held the loop ~30 ms."""
        dids = event.dids
        # what the agent forgot is never asked for again
        have = yield Read(lambda port: port.settled(dids))
        session, missing = link.session, []
        for start in range(0, len(dids), SE.OFFER_SLICE):
            if start:
                yield Pause()
            _, mono = yield Clock()
            missing += session.take_offered(dids[start:start + SE.OFFER_SLICE], have, mono)
            self.counters["offer_slices"] += 1
        now, _ = yield Clock()
        work = session.ask(missing, sorted(have), now)
        if work is not None:
            yield from self.session_events(link, [work])
            self.counters["offer_messages_signed_off_loop"] += len(work.messages)
        yield Flush(link)

    def acknowledged(self, link: Any, event: SE.Acknowledged) -> Steps:
        """A peer's `container_ack`: what leaves the outbox, what a relay stops holding
        (and the next page of what it holds for the peer)."""
        own, acked, pairs, relaying = self.own, event.dids, event.pairs, self.relaying

        def write(port: StorePort) -> int:
            port.outbox_done(pairs)
            return port.relay_release(link.did, acked, own) if relaying else 0

        released = yield Write(write)
        if released:
            self.counters["relay_released"] += released
            if link.session.held_after is not None:  # more held for it: the next page
                yield from self.offer_held(link)

    def offer_held(self, link: Any, *, again: bool = False) -> Steps:
        """A relay offers what it holds for the peer (24.2): a `container_delta` of at most
        `delta_page` entries; the next page when the peer's ack released some; `again`:
        from the first page, what was not acknowledged in time (the session's timer)."""
        if not self.relaying:
            return
        after, page = 0 if again else link.session.held_after or 0, self.settings.session.delta_page
        rows = yield Read(lambda port: port.relay_held_for(link.did, after, page))
        now, mono = yield Clock()
        added = {r.did: M.index_entry(r.hmp_container) for r in rows if self.eligible(link, r, now)}
        link.session.offer_held(added, now, mono, read=[r.seq for r in rows], again=again)
        yield Flush(link)

    # -- catch-up by reconciliation (docs/protocol.md 22.4) ------------------------------------

    def set_for(self, state: SY.SyncState, link: Any, name: str, now: datetime) -> SY.Snapshot:
        """The set `name` as this link reconciles it (the scoped one depends on its address and channel)."""
        if name == "global":
            return state.global_set
        key = SY.scope_key(state.scoped_rows, peer_ip=link.session.ip, channel=link.session.channel, now=now)
        return state.scoped(key)

    def start_sync(self, link: Any) -> Steps:
        """The dialer starts one reconciliation per set (both in the same round trip)."""
        state = yield Sets()
        now, mono = yield Clock()
        link.session.start_sync({name: self.set_for(state, link, name, now) for name in SY.SET_NAMES}, mono)
        yield Flush(link)

    def reconcile_start(self, link: Any, event: SE.ReconcileStart) -> Steps:
        state = yield Sets()
        now, mono = yield Clock()
        yield from self.session_events(link, link.session.answer_start(event, self.set_for(state, link, event.name, now),
                                                                       mono))

    def reconcile_step(self, link: Any, step: SE.ReconcileStep) -> Steps:
        """What a step found moves one transfer at a time per link (queued behind the one running)."""
        waiting = self._transfers.get(link)
        if waiting is not None:
            waiting.append(step)
            return
        self._transfers[link] = deque([step])
        yield Spawn(self._transfer(link))

    def _transfer(self, link: Any) -> Steps:
        """Ask for what we lack (`want`), push what the peer lacks (with evaluations), both
        paced to the peer's container budget."""
        try:
            waiting = self._transfers[link]
            while waiting:
                step = waiting.popleft()
                for kind, chunk in step.batches():
                    if not (yield from self._paced(link, len(chunk))):
                        return
                    if kind == "want":
                        link.session.send_want(step.name, chunk)
                        yield Flush(link)
                    else:
                        rows = yield from self._rows_of(link, step.snap, chunk)
                        self.counters["sync_pushed"] += len((yield from self.give(link, rows)))
        finally:
            self._transfers.pop(link, None)

    def want(self, link: Any, event: SE.WantReceived) -> Steps:
        """The initiator asks for containers by id (those its reconciliation found it lacks)."""
        snap = event.snap
        if snap is None:
            state = yield Sets()
            now, _ = yield Clock()
            snap = self.set_for(state, link, event.name, now)
        rows = yield from self._rows_of(link, snap, event.ids)
        self.counters["sync_served"] += len((yield from self.give(link, rows)))

    def _paced(self, link: Any, n: int) -> Steps:
        """Wait until `n` containers fit the session's transfer pace; False if it ended."""
        for _ in range(10_000):  # bounded: each wait refills what was missing
            if link.closed:
                return False
            _, mono = yield Clock()
            delay = link.session.pace_delay(mono, n)
            if not delay:
                return True
            yield Pause(delay)
        return False

    def give(self, link: Any, rows: list[StoredContainer]) -> Steps:
        """Push these containers and their evaluations (as a request with request_evaluations
        would bring them, 22.2); a container this connection carried already is not sent again."""
        rows = yield from self.push(link, rows, asked=True)
        if rows:
            dids = [r.did for r in rows]
            found = yield Read(lambda port: port.evaluations_of(dids))
            if found:
                now, _ = yield Clock()
                link.session.send_mce("evaluations_exchange", {d: evaluations_block(i) for d, i in found.items()}, now)
                yield Flush(link)
        return rows

    def _rows_of(self, link: Any, snap: SY.Snapshot, ids: Iterable[bytes]) -> Steps:
        """The held containers of these ids of `snap` that this peer may receive (never
        anything outside the set: an id we do not list maps to nothing)."""
        seqs = [s for s in (snap.seq_of(i) for i in ids) if s is not None]
        if not seqs:
            return []
        rows = yield Read(lambda port: port.rows_by_seq(seqs))
        now, _ = yield Clock()
        # what the peer declared it wants (33.3): reconciliation finds what it lacks, not what it cares for
        return [r for r in rows if self.eligible(link, r, now) and link.session.wants(r.hmp_container["head"], r.did)]

    # -- one session's events -------------------------------------------------------------------

    def frame(self, link: Any, data: bytes) -> Steps:
        """One frame a peer sent: through its session, then every event it makes."""
        session = link.session
        now, mono = yield Clock()
        try:
            yield from self.session_events(link, session.frame_received(data, mono, now))
        except SE.PEER_FAULTS as exc:  # handling an event met a shape the session's checks let through
            _, mono = yield Clock()
            yield from self.session_events(link, session.fault(exc, mono))

    def session_events(self, link: Any, events: list[SE.SessionEvent]) -> Steps:
        """Carry out a session's events in order: a Work runs (a Pause waits; the rest as
        offloaded CPU work charged to the peer) and its result goes back to the session,
        whose events are carried out first; the core answers the events it owns, the driver
        the others (`Unhandled`). What the session queued meanwhile is sent."""
        session = link.session
        for event in events:
            if isinstance(event, SE.Pause):
                if link.closed:
                    return
                yield Pause(event.seconds)
                result = None
            elif isinstance(event, SE.Work):
                result = yield Offload(event.run, link)
            else:
                steps = self.steps_for(link, event)
                if steps is None:
                    yield Unhandled(link, event)
                else:
                    yield from steps
                yield Flush(link)
                continue
            now, mono = yield Clock()
            yield from self.session_events(link, session.work_done(event, result, mono, now))
            yield Flush(link)

    def steps_for(self, link: Any, event: Any) -> Steps | None:
        """The core's answer to one event of a link's session; None for an event the core
        leaves to its driver (refusals, signed blocks, index queries)."""
        handler = self._handlers.get(type(event))
        return None if handler is None else handler(link, event)

    @functools.cached_property
    def _handlers(self) -> dict[type, Callable[[Any, Any], Steps]]:
        return {
            SE.ContainersReceived: self.containers, SE.Requested: self.requested, SE.Offered: self.offered,
            SE.Acknowledged: self.acknowledged, SE.ReofferHeld: lambda link, event: self.offer_held(link, again=True),
            SE.ReconcileStart: self.reconcile_start, SE.ReconcileStep: self.reconcile_step,
            SE.WantReceived: self.want,
        }

    # -- deadlines -----------------------------------------------------------------------------

    def next_timer(self) -> float | None:
        """The earliest session deadline (monotonic), or None."""
        due = [t for link in self.live() if (t := link.session.next_timer()) is not None]
        return min(due) if due else None

    def due_timers(self, mono: float) -> list[tuple[Any, list[Any]]]:
        """Each session's events whose deadline has come (requests not answered, a relay's
        re-offer), per link: the driver handles them as the session's own events."""
        out = []
        for link in self.live():
            due = link.session.next_timer()
            if due is not None and due <= mono:
                out.append((link, link.session.handle_timer(mono)))
        return out

    def expire_holdings(self) -> Steps:
        """Drop relay holdings past their end. One whose recipient is connected is an error
        (it should have been delivered): said in the log and counted when it goes, and
        offered again (once a minute) while its end is near (two re-offer intervals)."""
        now, _ = yield Clock()
        now_us = to_us(now)
        soon_us = now_us + int(2 * self.settings.session.relay_reoffer_seconds * 1e6)
        own = self.own
        expired, ending, dropped = yield Write(lambda port: port.relay_expire(now_us, soon_us, own))
        if dropped:
            self.counters["relay_expired"] += dropped
        for recipient, count in ending.items():
            link = self.links.get(recipient)
            if link is None or link.closed:
                continue
            gone = expired.get(recipient, 0)
            if gone:
                self.counters["relay_expired_connected"] += gone
                limited.log(logging.ERROR, (recipient, "relay_expired"),
                            "relay: %d held for %s expired undelivered although it is connected", gone, recipient)
            if count > gone and limited.log(
                    logging.ERROR, (recipient, "relay_expiring"),
                    "relay: %d held for %s end within %.0f s undelivered although it is connected; offered again",
                    count - gone, recipient, (soon_us - now_us) / 1e6):
                yield from self.offer_held(link, again=True)

    # -- the outbox ---------------------------------------------------------------------------------

    def served_by(self, arrived: set[str]) -> set[str] | None:
        """The recipients whose waiting mail the peers just connected (`arrived`) are a path
        to: each peer itself and the recipients that name it their mailman; everyone (None)
        when one of them is a relay, since any relay takes directed mail (`relay_for`)."""
        for did in arrived:
            link = self.links.get(did)
            if link is not None and not link.closed and FORWARDING_ROLES.intersection(link.roles):
                return None
        return set(arrived) | {r for r, row in self.peers.items() if not arrived.isdisjoint(row.mailman)}

    def outbox_pass(self) -> Steps:
        """One pass of the outbox: wake what waits for the peers that connected since the
        last pass (at most once a second for everyone, when a relay came), then what is
        due, by recipient (the driver delivers each with `deliver`)."""
        now, mono = yield Clock()
        now_us = to_us(now)
        arrived, self.outbox_arrived = self.outbox_arrived, set()
        wake = self.served_by(arrived) if arrived else set()
        if wake is None:
            if mono - self._woke_all < WAKE_ALL_SECONDS:  # again soon: kept for a pass after the pause
                self.outbox_arrived |= arrived
                wake = set()
            else:
                self._woke_all = mono
        if wake is None or wake:
            woken = yield Write(lambda port: port.outbox_wake(now_us, wake))
            self.counters["outbox_woken"] += woken
        due = yield Read(lambda port: port.outbox_due(now_us, OUTBOX_BATCH))
        by_recipient: dict[str, list[tuple[str, int, int, int]]] = {}
        for did, recipient, seq, tries, pushed_us in due:
            by_recipient.setdefault(recipient, []).append((did, seq, tries, pushed_us))
        return by_recipient, len(due) >= OUTBOX_BATCH

    def outbox_wait(self, had_due: bool) -> float:
        """How long the outbox loop sleeps unless woken."""
        return WAKE_ALL_SECONDS if self.outbox_arrived else 0.5 if had_due else 1.0

    def deliver(self, recipient: str, entries: list[tuple[str, int, int, int]]) -> Steps:
        """Hand what is due for `recipient` (did, seq, tries, pushed_us) to the first path that
        takes it: the recipient if connected, a connected mailman of it, the recipient dialled,
        a mailman dialled, any connected relay; what none takes backs off (`retry_at`). On a
        connection that carried an entry already, it is sent again only once its acknowledgement
        is overdue (ack_timeout after it was handed over); until then it waits for that ack."""
        s = self.settings
        rows = yield Read(lambda port: port.rows_by_seq([seq for _, seq, _, _ in entries]))
        now, _ = yield Clock()
        now_us = to_us(now)
        # revoked (signed after its sender's revocation): never delivered, like an expired one (protocol.md 32)
        ended = {r.did for r in rows if r.expired(now_us) or self.is_revoked(r)}
        expired = [(r.did, recipient) for r in rows if r.did in ended]
        live = [r for r in rows if r.did not in ended]
        gone = {did for did, _, _, _ in entries} - {r.did for r in rows}
        if expired or gone:
            self.counters["outbox_expired"] += len(expired) + len(gone)
            done = expired + [(d, recipient) for d in gone]
            yield Write(lambda port: port.outbox_done(done))
        if not live:
            return
        pushed = {did: p for did, _, _, p in entries}
        for path in PATHS:
            link = yield from self._path(path, recipient)
            if link is None or link.closed:
                continue
            live = yield from self._hand_over(link, recipient, live, pushed)
            if not live:
                return
        now, _ = yield Clock()
        now_us = to_us(now)
        tries = {did: t for did, _, t, _ in entries}
        retry = [(retry_at(now_us, tries.get(r.did, 0), base=s.mesh.retry_base, cap=s.mesh.retry_max, rng=self.rng), r.did,
                  recipient) for r in live]
        self.counters["outbox_deferred"] += len(retry)
        yield Write(lambda port: port.outbox_retry(retry))

    def _path(self, path: str, recipient: str) -> Steps:
        """One way to `recipient` (PATHS, in order; each looked for only when the ones
        before did not take everything): the link, or None."""
        if path == "connected":
            return self.links.get(recipient)
        if path == "mailman":
            return self._connected_mailman(recipient)
        if path == "dialled":
            return None if recipient in self.links else (yield Reach(recipient, mail=True))
        return (yield from self.relay_for(recipient))

    def _connected_mailman(self, recipient: str) -> Any:
        row = self.peers.get(recipient)
        for did in row.mailman if row else ():
            link = self.links.get(did)
            if link is not None and not link.closed:
                return link
        return None

    def relay_for(self, recipient: str) -> Steps:
        """A connection to a relay that holds for `recipient`: one of its announced
        mailmen, else the connected relay the recipient ranks best (`rank`)."""
        row = self.peers.get(recipient)
        mailmen = list(row.mailman) if row else []
        if not mailmen and row is None:
            record = yield FindPeer(recipient)
            mailmen = list(record.mailman) if record else []
        for did in mailmen:
            link = self.links.get(did)
            if link is None or link.closed:
                link = yield Reach(did)
            if link is not None:
                return link
        # none named: the connected relay the recipient itself ranks best, where it is likeliest to look
        relays = {link.did: link for link in self.relays()}
        return relays[self.rank(relays, of=recipient)[0]] if relays else None

    def _hand_over(self, link: Any, recipient: str, live: list[StoredContainer],
                   pushed: dict[str, int]) -> Steps:
        """Push to `link` (the recipient, or a relay for it) what it may receive of `live`; the
        rest. What its acknowledgement is overdue for is sent again even if this connection
        carried it; what it carried more recently waits for that acknowledgement."""
        now, _ = yield Clock()
        now_us = to_us(now)
        ack_us = int(self.settings.mesh.ack_timeout * 1e6)
        via = None if link.did == recipient else recipient
        eligible = [r for r in live if link.session.may_receive(r.hmp_container["head"], now, as_relay=via is not None)]
        if not eligible:
            return live
        overdue = [r for r in eligible if now_us - pushed.get(r.did, 0) >= ack_us]
        sent = yield from self.push(link, overdue, relay_for=via, again=True)
        sent += yield from self.push(link, [r for r in eligible if r not in overdue], relay_for=via)
        carried = {r.did for r in sent}
        waiting = [(pushed[r.did] + ack_us, r.did, recipient) for r in eligible if r.did not in carried]
        sent_rows = [(now_us + ack_us, now_us, r.did, recipient) for r in sent]
        yield Write(lambda port: port.outbox_sent(sent_rows, waiting))
        self.counters["outbox_via_relay" if via else "outbox_direct"] += len(sent)
        return [r for r in live if r not in eligible]
