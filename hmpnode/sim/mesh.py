"""Simulated nodes and links: the real `MeshCore` + `PeerSession` on virtual time.

Each `SimNode` is one node's mesh: its core (hmpnode.net.core), its sessions
(hmpnode.net.session) with reconciliation, the shared drive loops
(hmpnode.net.drive) and a `MemoryStore`. What the node's asyncio driver does with
sockets, SQLite and threads, `SimWorld` does in memory: a frame a session queued
travels over a `SimNet` link (latency, jitter, bandwidth, in order per direction)
and is read on the other side by the same per-frame steps the node runs.

Modelled as in the node: the sessions' budgets, strikes, deadlines and refusals; the
core's decisions; the slot rules; the dial back-off (`dialing.DialBudget`); with
`Scenario.dht`, each node's own `Dht`. Not modelled (said in docs/simulation.md): the
Noise handshake and AEAD records (a connection opens after 1.5 round trips), CPU budgets
(work runs at once, in virtual no-time), referenced-by and evaluation blocks, the index,
interests, provider records.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from hmpnode.container.verify import Limits, Verifier
from hmpnode.identity.keys import Identity
from hmpnode.net import catchup, drive
from hmpnode.net import core as C
from hmpnode.net import session as SE
from hmpnode.net import dialing
from hmpnode.net.dialing import connections_wanted
from hmpnode.net.scope import FORWARDING_ROLES, Channel
from hmpnode.net.session import PeerSession
from hmpnode.net.slots import Slot, address_keys
from hmpnode.net.slots import admit as admit_slot
from hmpnode.net.slots import score as slot_score
from hmpnode.net.announce import make_address_record
from hmpnode.net.dht import Dht
from hmpnode.sim.dgram import DatagramNetwork
from hmpnode.sim.standin import PlainMce, plain_verify
from hmpnode.sim.store import MemoryStore, Result
from hmpnode.store.records import to_us

__all__ = ["SimNet", "SimNode", "SimLink", "EPOCH"]

#: the ports a simulated node's peer and DHT endpoints have
PEER_PORT, DHT_PORT = 4000, 4001
#: what virtual time 0 is on the wall clock
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)
_CLASS = re.compile(rb'"class":"([a-z_-]+)"')


@dataclass(eq=False)
class SimLink:
    """One side of a simulated connection (what the core sees as a link)."""

    node: SimNode
    session: PeerSession
    peer_roles: tuple[str, ...]
    closed: bool = False
    other: SimLink | None = None
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    #: when the last frame sent this way arrives (frames keep their order)
    busy_until: float = 0.0
    #: one-way latency of this connection (seconds), and when it opened (virtual)
    latency: float = 0.05
    opened_at: float = 0.0
    reader: asyncio.Task | None = None

    @property
    def did(self) -> str:
        return self.session.peer_did

    @property
    def roles(self) -> tuple[str, ...]:
        return self.peer_roles


class SimWorld(drive.World):
    """The core's effects for one simulated node."""

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def clock(self) -> tuple[datetime, float]:
        return self.node.now(), self.node.net.loop.time()

    async def read(self, fn):
        return fn(self.node.store)

    async def write(self, fn):
        return fn(self.node.store)

    async def ingest(self, effect: C.Ingest) -> list[Result]:
        return self.node.ingest(effect.items, effect.source)

    async def offload(self, effect: C.Offload):
        return effect.fn()

    async def flush(self, link: SimLink) -> None:
        self.node.net.send(link)

    async def reach(self, did: str, *, mail: bool = False) -> SimLink | None:
        return await self.node.reach(did)  # the simulated dialer has no mail-driven retries

    async def find_peer(self, did: str):
        dht = self.node.dht
        if dht is not None:  # the node's own DHT on the simulated UDP network (Scenario.dht)
            return await dht.find_peer(did)
        return self.node.net.directory.get(did)  # else: as if the DHT answered at once with the latest record

    async def sets(self):
        return await self.node.snapshots.current()

    def spawn(self, steps) -> None:
        self.node.spawn(drive.run(steps, self))

    async def cut_off(self, link: SimLink) -> None:
        self.node.counters["banned"] += 1
        self.node.net.close(link, "cut_off")

    async def unhandled(self, link: SimLink, event) -> None:
        self.node.unhandled(link, event)


class SimNode:
    """One node: identity and store survive a crash; everything else is made anew."""

    def __init__(self, net: SimNet, index: int, identity: Identity, *, roles: tuple[str, ...] = (),
                 skew: float = 0.0) -> None:
        self.net, self.index, self.identity, self.roles = net, index, identity, roles
        self.did = identity.did
        self.ip = f"10.{index // 256}.{index % 256}.1"  # one /24 each: the slot rules' subnet cap is per /24
        self.skew = skew
        self.store = MemoryStore()
        self.known: list[str] = []  # peers this node may dial (its peers table)
        #: DID -> [(virtual time, source)] of every container this node stored (exactly-once checks)
        self.stored_at: dict[str, float] = {}
        self.received: Counter[str] = Counter()  # DID -> container bodies received from peers
        self.alive = False
        self.counters: Counter[str] = Counter()
        #: running tasks, in start order (a dict: a set would iterate by address, not by seed)
        self.tasks: dict[asyncio.Task, None] = {}
        self.core: C.MeshCore | None = None
        self.dht: Dht | None = None
        self.address_records: list[dict[str, Any]] = []

    # -- life ----------------------------------------------------------------------------

    def now(self) -> datetime:
        return EPOCH + timedelta(seconds=self.net.loop.time() + self.skew)

    def start(self) -> None:
        """Start (or restart after a crash): a new core over the kept store."""
        net = self.net
        settings = net.settings_for(self)
        self.core = C.MeshCore(self.identity, settings, random.Random(net.rng.random()), self.counters,
                               chain_ok=lambda chain: True)
        self.world = SimWorld(self)
        self.snapshots = catchup.Snapshots(self.world, lambda: self.store.last_seq,
                                           lambda: to_us(self.now()), settings, self.counters)
        self.dials = settings.dialing.budget(random.Random(net.rng.random()))
        self.wake = asyncio.Event()
        self.dialing: set[str] = set()
        self.announced: list[str] | None = None
        for did in self.known:
            self.core.peers[did] = net.directory[did]
        self.alive = True
        self.spawn(drive.outbox_loop(self.core, self.world, self.wake))
        self.spawn(self._tick())
        if net.dgram is not None:
            self.spawn(self._start_dht())

    async def _start_dht(self) -> None:
        """The node's DHT (hmpnode.net.dht) on the simulated UDP network: joined through the
        run's bootstrap nodes, our peer record (roles, mailmen) published."""
        net = self.net
        self.dht = Dht(self.identity, host=self.ip, port=DHT_PORT, clock=self.now,
                       rng=random.Random(net.rng.random()).randbytes, endpoint=net.dgram.create_datagram_endpoint)
        await self.dht.start([b for b in net.bootstrap if b[0] != self.ip])
        await self.publish_peer()

    async def publish_peer(self) -> None:
        if self.dht is not None:
            if not self.address_records:  # proof of work at the DHT's difficulty: once per node
                self.address_records = [make_address_record(self.did, f"tcp://{self.ip}:{PEER_PORT}")]
            await self.dht.publish_peer(self.address_records, roles=self.roles, mailman=self.announced or [])

    def stop(self) -> None:
        """Crash or leave: every link closes, every task stops, the store stays."""
        self.alive = False
        dht, self.dht = self.dht, None
        if dht is not None:
            self.net.loop.create_task(dht.stop())
        for link in list(self.core.links.values()):
            self.net.close(link, "node_down")
        for task in list(self.tasks):
            task.cancel()
        self.tasks.clear()

    def spawn(self, coro) -> asyncio.Task:
        task = self.net.loop.create_task(coro)
        self.tasks[task] = None
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.net.failures.append((self.index, repr(task.exception())))

    async def _tick(self) -> None:
        """Once a simulated second, as the node's maintenance and connect loops: session
        deadlines, relay holdings, our mailmen (`MeshCore.relays_to_dial`, and announcing
        the list when it changed), and the dialing that keeps `target_peers` outbound
        connections (`dialing.connections_wanted`)."""
        s = self.net.settings_for(self)
        core = self.core
        while self.alive:
            await asyncio.sleep(1.0 + self.net.rng.random() * 0.01)
            mono = self.net.loop.time()
            for link, events in core.due_timers(mono):
                await self.handle(link, events)
            if core.relaying:
                await drive.run(core.expire_holdings(), self.world)
            mailman = core.mailman()
            if mailman != self.announced:
                self.announced = mailman
                self.net.announce(self, mailman)
                if self.dht is not None:
                    self.spawn(self.publish_peer())
            relays = [d for d in self.known if self.net.is_relay(d)]
            wanted = core.relays_to_dial(relays, lambda d: self.dials.due(d, mono) and d not in self.dialing)
            live = core.live()
            want = connections_wanted(target=s.dialing.target_peers, min_outbound=s.dialing.min_outbound, live=len(live),
                                      outbound=sum(1 for link in live if link.session.initiator))
            if want > 0:
                candidates = [d for d in self.known if d not in core.links and d not in self.dialing
                              and d not in wanted and self.dials.due(d, mono)]
                self.net.rng.shuffle(candidates)
                wanted += candidates[:min(want, int(self.dials.available(mono)))]
            for did in wanted:
                self.spawn(self.reach(did))

    async def reach(self, did: str) -> SimLink | None:
        """As `peers.reach`: the link, or a dial within the node's dial budget and back-off."""
        link = self.core.links.get(did)
        if link is not None and not link.closed:
            return link
        mono = self.net.loop.time()
        if did in self.dialing or not self.dials.due(did, mono):
            return None
        if not self.dials.take(mono):
            self.counters["dial_rate_limited"] += 1
            return None
        self.dialing.add(did)
        try:
            link = await self.net.dial(self, did)
        finally:
            self.dialing.discard(did)
        if link is None:
            self.dials.failed(did, self.net.loop.time())
        else:
            self.dials.succeeded(did)
        return link

    # -- the agent -------------------------------------------------------------------------

    def publish(self, container: dict[str, Any]) -> Result:
        """The agent stores a container (into the outbox if directed; gossiped if broadcast)."""
        return self.ingest([container], "agent")[0]

    def forget(self, did: str) -> None:
        self.store.forget(did)

    # -- storing ---------------------------------------------------------------------------

    def ingest(self, items: list[dict[str, Any]], source: str) -> list[Result]:
        """Verify (real signatures, or the run's stand-in) and store; the store hook (outbox,
        relay holding) in the same step; what was stored is forwarded."""
        now = self.now()
        now_us = to_us(now)
        results, done, stored = [], [], []
        for item in items:
            verdict = self.net.verify(item, now)
            if not verdict.ok:
                results.append(Result("rejected", verdict.container_did, reason=verdict.reason, detail=verdict.detail))
                continue
            did = verdict.container_did
            if source != "agent":
                self.received[did] += 1
            result = self.store.put(self.net.intern(did, verdict.container), did, source, now_us)
            results.append(result)
            if result.status == "stored":
                self.stored_at[did] = self.net.loop.time()
                self.net.on_stored(self, did)
                done.append((verdict, result))
                stored.append(self.store.by_did[did])
        if done and self.core.store_hook(self.store, source, done, now_us):
            self.wake.set()
        if stored and self.alive:
            self.spawn(drive.run(self.core.forward(stored), self.world))
        return results

    # -- a session's frames ---------------------------------------------------------------------

    async def read(self, link: SimLink) -> None:
        """A link's frames in order, each through the session and the core (`MeshCore.frame`)."""
        while not link.closed:
            data = await link.inbox.get()
            if link.closed:
                return
            await drive.run(self.core.frame(link, data), self.world)
            if link.session.closed:  # cut off, clock skew
                self.net.close(link, link.session.close_reason or "closed")

    async def handle(self, link: SimLink, events: list) -> None:
        await drive.run(self.core.session_events(link, events), self.world)

    def unhandled(self, link: SimLink, event: Any) -> None:
        """What the node's driver does with the events the core leaves to it, as far as the
        simulation models it: refusals are counted (a cut-off peer is banned: an invariant
        breaks), a clock off ends the connection; the rest is counted as not modelled."""
        if isinstance(event, SE.Refused):
            self.counters[f"refused_{event.reason}"] += 1
            if event.cut:
                self.counters["banned"] += 1
                self.net.close(link, "cut_off")
        elif isinstance(event, SE.ClockSkew):
            self.counters["clock_skew_closed"] += 1
            self.net.close(link, "clock_skew")
        elif not isinstance(event, SE.ClockSample):
            self.counters[f"unmodelled_{type(event).__name__}"] += 1

    def opened(self, link: SimLink) -> None:
        """A connection is up: the dialer reconciles, a relay offers what it holds, the
        outbox looks at what waits for this peer."""
        self.core.links[link.did] = link
        link.reader = self.spawn(self.read(link))
        if link.session.initiator:
            self.spawn(drive.run(self.core.start_sync(link), self.world))
        self.spawn(drive.run(self.core.offer_held(link), self.world))
        self.core.outbox_arrived.add(link.did)
        self.wake.set()

    def closed(self, link: SimLink) -> None:
        link.closed = True
        link.inbox.put_nowait(b"")
        if self.core is not None:
            self.core.ledger.close(link.session.book)
            if self.core.links.get(link.did) is link:
                del self.core.links[link.did]


@dataclass(frozen=True, slots=True)
class Known:
    """A peers-table row as the core reads it."""

    roles: tuple[str, ...]
    mailman: tuple[str, ...]


@dataclass
class LinkModel:
    latency: tuple[float, float] = (0.020, 0.080)  # one-way, seconds (uniform per connection)
    jitter: float = 0.002  # per frame, seconds
    bandwidth: float = 10e6 / 8  # bytes per second, per direction


class SimNet:
    """The nodes, their connections and the frames in flight; the trace digest."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, settings, *,
                 model: LinkModel | None = None, verify: str = "real") -> None:
        self.loop, self.rng, self.settings = loop, rng, settings
        self.model = model or LinkModel()
        self.nodes: dict[str, SimNode] = {}
        self.digest = hashlib.sha256()
        self.failures: list[tuple[int, str]] = []
        self.frames: Counter[str] = Counter()
        self.frame_bytes: Counter[str] = Counter()
        #: frames to lose: (predicate(src, dst, data), how many more)
        self.losses: list[list[Any]] = []
        self.partition: dict[str, int] | None = None
        self.verifier = Verifier(limits=Limits())
        self.stored_hooks: list[Any] = []
        self.verify_mode = verify
        #: the simulated UDP network of the nodes' DHTs, and its bootstrap nodes (None: no DHT)
        self.dgram: DatagramNetwork | None = None
        self.bootstrap: list[tuple[str, int]] = []
        self.bodies: dict[str, dict[str, Any]] = {}
        #: DID -> its latest announce as peers see it (roles, mailman): what LAN and DHT carry
        self.directory: dict[str, Known] = {}
        #: DID -> the nodes that have it in their peers table
        self.known_by: dict[str, list[SimNode]] = {}

    def add(self, node: SimNode) -> None:
        self.nodes[node.did] = node
        self.directory[node.did] = Known(node.roles, ())

    def set_known(self, node: SimNode, known: list[str]) -> None:
        node.known = known
        for did in known:
            self.known_by.setdefault(did, []).append(node)

    def is_relay(self, did: str) -> bool:
        return bool(FORWARDING_ROLES.intersection(self.directory[did].roles))

    def announce(self, node: SimNode, mailman: list[str]) -> None:
        """A node's announce changed (its mailmen): every node that knows it hears of it."""
        row = self.directory[node.did] = Known(node.roles, tuple(mailman))
        for other in self.known_by.get(node.did, ()):
            if other.core is not None:
                other.core.peers[node.did] = row

    def settings_for(self, node: SimNode):
        return self.settings(node)

    def verify(self, item: dict[str, Any], now: datetime):
        if self.verify_mode == "plain":
            return plain_verify(item, now)
        return self.verifier.verify(item, now=now, from_peer=True)

    def crypto_for(self, node: SimNode) -> dict[str, Any]:
        """The MCE signer and checker a node's sessions use: the real ones (empty), or the stand-in."""
        if self.verify_mode != "plain":
            return {}
        plain = node.plain_mce = getattr(node, "plain_mce", None) or PlainMce(node.did)
        return {"sign": plain.sign, "check": plain.check}

    def intern(self, did: str, container: dict[str, Any]) -> dict[str, Any]:
        """One copy of a container's body for every simulated store that holds it (the
        simulator's memory, not a node's: each node's copy would be the same bytes)."""
        return self.bodies.setdefault(did, container)

    def on_stored(self, node: SimNode, did: str) -> None:
        for hook in self.stored_hooks:
            hook(node, did)

    def reachable(self, a: SimNode, b: SimNode) -> bool:
        return a.alive and b.alive and (self.partition is None
                                        or self.partition.get(a.did, 0) == self.partition.get(b.did, 0))

    async def dial(self, node: SimNode, did: str) -> SimLink | None:
        """A connection from `node` to `did`, after the handshake's 1.5 round trips."""
        other = self.nodes.get(did)
        if other is None or other is node:
            return None
        latency = self.rng.uniform(*self.model.latency)
        await asyncio.sleep(3 * latency)
        if not self.reachable(node, other):
            return None
        existing = node.core.links.get(did)
        if existing is not None and not existing.closed:
            return existing
        if other.core.links.get(node.did) is not None:  # a crossing dial: the first one stays
            return other.core.links[node.did].other
        # the node's slot rules (hmpnode.net.slots), on both ends: a full node refuses ("busy"),
        # an inbound peer may evict a worse one
        now = self.loop.time()
        mine = admit_slot(self.slots_of(node), self.slot(did, other.ip, True, now), self.settings_for(node).slots)
        theirs_v = admit_slot(self.slots_of(other), self.slot(node.did, node.ip, False, now),
                              self.settings_for(other).slots)
        if not mine.admit or not theirs_v.admit:
            node.counters[f"dial_refused_{mine.reason if not mine.admit else theirs_v.reason}"] += 1
            return None
        if theirs_v.evict is not None:
            victim = other.core.links.get(theirs_v.evict.key)
            if victim is not None:
                other.counters["evicted"] += 1
                self.close(victim, "evicted")
                evicted = self.nodes[victim.did]  # told `evicted`: backed off as the node does (GIVE_WAY)
                if evicted.alive and "evicted" in dialing.GIVE_WAY:
                    evicted.dials.failed(other.did, now)
        ours = PeerSession(node.identity, did, other.ip, Channel.GLOBAL, peer_roles=other.roles, initiator=True,
                           limits=self.settings_for(node).session, book=node.core.ledger.open(), counters=node.counters,
                           relaying=node.core.relaying, **self.crypto_for(node))
        theirs = PeerSession(other.identity, node.did, node.ip, Channel.GLOBAL, peer_roles=node.roles,
                             initiator=False, limits=self.settings_for(other).session,
                             book=other.core.ledger.open(), counters=other.counters,
                             relaying=other.core.relaying, **self.crypto_for(other))
        a = SimLink(node, ours, other.roles)
        b = SimLink(other, theirs, node.roles)
        a.other, b.other = b, a
        a.latency = b.latency = latency
        a.opened_at = b.opened_at = self.loop.time()
        node.opened(a)
        other.opened(b)
        self.trace(b"open", node.did, did, b"")
        return a

    @staticmethod
    def slot(did: str, ip: str, outbound: bool, since: float, useful: int = 0, strikes: float = 0.0) -> Slot:
        return Slot(did, outbound, *address_keys(ip, Channel.GLOBAL), False, slot_score(useful, strikes), since)

    def slots_of(self, node: SimNode) -> list[Slot]:
        return [self.slot(link.did, link.session.ip, link.session.initiator, link.opened_at, link.session.useful,
                          link.session.strikes.count) for link in node.core.live()]

    def close(self, link: SimLink, reason: str) -> None:
        for side in (link, link.other):
            if side is not None and not side.closed:
                side.node.closed(side)
        if link.other is not None:
            self.trace(b"close", link.node.did, link.other.node.did, reason.encode())

    def send(self, link: SimLink) -> None:
        """What the link's session queued goes on the wire, in order."""
        frames = link.session.data_to_send()
        other = link.other
        if link.closed or other is None or other.closed:
            return
        src, dst = link.node.did, other.node.did
        now = self.loop.time()
        for data in frames:
            kind = self.kind(data)
            self.frames[kind] += 1
            self.frame_bytes[kind] += len(data)
            if self._lost(src, dst, data, kind):
                self.trace(b"lost", src, dst, data)
                continue
            arrive = max(link.busy_until, now + link.latency + self.rng.random() * self.model.jitter
                         + len(data) / self.model.bandwidth)
            link.busy_until = arrive
            self.loop.call_at(arrive, self._arrive, other, data)

    def _arrive(self, link: SimLink, data: bytes) -> None:
        if link.closed:
            return
        self.trace(b"frame", link.other.node.did if link.other else "", link.node.did, data)
        link.inbox.put_nowait(data)

    def _lost(self, src: str, dst: str, data: bytes, kind: str) -> bool:
        for rule in self.losses:
            if rule[1] > 0 and rule[0](src, dst, kind):
                rule[1] -= 1
                return True
        return False

    @staticmethod
    def kind(data: bytes) -> str:
        """A frame's kind for the figures: its type, or the class of the MCE message it carries."""
        if data.startswith(b'{"type":"mce"'):
            found = _CLASS.search(data, 0, 4096)
            return found.group(1).decode() if found else "mce"
        end = data.find(b'"', 9)
        return data[9:end].decode("ascii", "replace") if data.startswith(b'{"type":"') and end > 0 else "other"

    def trace(self, what: bytes, src: str, dst: str, data: bytes) -> None:
        self.digest.update(b"%s|%.6f|%s|%s|" % (what, self.loop.time(), src.encode(), dst.encode()))
        self.digest.update(hashlib.sha256(data).digest())

    def relays(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if FORWARDING_ROLES.intersection(n.roles)]
