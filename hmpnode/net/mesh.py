"""The mesh's asyncio driver: it starts and stops the node's peer side and carries out
what the sans-IO pieces decide.

Sockets: `connections` (accepting and dialling at `PEER_PATH`, the v2 handshake,
`hmp-peer/2`, docs/protocol.md 21, admission carried out, each connection's read loop),
`link` (one connection; the handshake's messages). Decisions: `admission` (who may
connect), `session.PeerSession` (one connection), `core.MeshCore` (node-wide, as effects
this module answers: `_NodeWorld`). Jobs, each typing against `host.Host`, never
against this module: `gossip` (the forward loop), `drive.outbox_loop` (directed
delivery), `peers` (the peers table, dialing), `provide` (what we publish in the DHT),
`delta` (container_delta modified/removed), `indexquery` (the index on request),
`ourinterests` (what our agent wants), `catchup` (the reconciliation snapshot); `views`
reads them for the API. docs/architecture.md has the picture.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import logging
import random
import socket
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from datetime import datetime
from typing import Any

import aiohttp
import nacl.utils
import orjson
from aiohttp import web

from hmpnode.net import catchup, drive, gossip
from hmpnode.net import core as C
from hmpnode.net import delta as DL
from hmpnode.net import dialing as D
from hmpnode.net import session as SE
from hmpnode.net.addresses import own_addresses
from hmpnode.net.admission import Admission, channel_of
from hmpnode.net.announce import OwnAnnounce
from hmpnode.net.circuits import Circuits
from hmpnode.net.connections import CIRCUIT_PATH, PEER_PATH, Connections
from hmpnode.net.dialback import Dialback
from hmpnode.net.core import MeshCore
from hmpnode.net.indexquery import IndexQueries
from hmpnode.net.link import Link, close_quietly
from hmpnode.net.nat import Nat
from hmpnode.net.ourinterests import OurInterests
from hmpnode.net.peers import Peers
from hmpnode.net.provide import Publisher
from hmpnode.net.reach import DIALBACK_PATH, Reachability, format_addr
from hmpnode.net.punching import Punching
from hmpnode.net.relay import verify_relay_chain
from hmpnode.net.scope import is_loopback_ip
from hmpnode.net.settings import MeshSettings
from hmpnode.net.skew import SkewEstimates
from hmpnode.net.slots import Slot
from hmpnode.net.transport import PROTOCOLS
from hmpnode.logs import LogLimiter
from hmpnode.serving import server_options
from hmpnode.store import mesh as ms
from hmpnode.store.port import SqlitePort

__all__ = ["Mesh", "ANNOUNCE_PATH"]

log = logging.getLogger("hmpnode.mesh")
#: what a peer's frames or an undelivered holding make the node say: one line per peer and
#: reason a minute at most (a flood of refusals must not flood the log)
limited = LogLimiter(log, 60.0)

ANNOUNCE_PATH = "/hmp/v1/announce"


class Mesh:
    def __init__(self, node, settings: MeshSettings):
        self.node = node
        self.settings = settings
        self.identity = node.identity
        self.counters: Counter[str] = Counter()
        rng = random.Random(nacl.utils.random(16))
        #: the node-wide decisions (sans-IO); this class carries out what they ask (`world`)
        self.core = MeshCore(node.identity, settings, rng, self.counters,
                             revoked_at=node.registry.revoked_at, refuse=node.refuse,
                             chain_ok=lambda chain: verify_relay_chain(chain, registry=node.registry).ok,
                             on_changed=lambda did, origin: DL.changed(self, did, origin))
        self.world = _NodeWorld(self)
        #: the connected peers (DID -> link) and what is known of peers: the core's
        self.sessions: dict[str, Link] = self.core.links
        self.peers: dict[str, ms.PeerRow] = self.core.peers
        #: the node-wide reconciliation sets (catchup), rebuilt lazily
        self.snapshots = catchup.Snapshots(self.world, lambda: node.last_seq, node.now_us, settings, self.counters)
        self.admission = Admission(settings, channel_of)
        self.dialer = Peers(self, rng, self.admission)
        self.wants = OurInterests(self, self.dialer.reach)
        self.own = OwnAnnounce(self.identity, name=settings.name, interests=settings.interests, roles=settings.roles,
                               difficulty=settings.min_difficulty, protocols=PROTOCOLS)
        self.publisher = Publisher(self, self.own, self.wants)
        self.queries = IndexQueries(self)
        #: changes to announce in `container_delta` modified/removed (hmpnode.net.delta)
        self.delta = DL.DeltaQueue(settings.delta)
        #: each peer's clock offset, from what it signs (status, metrics)
        self.skew = SkewEstimates()
        self._tasks: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self._wake_outbox = asyncio.Event()
        #: the `nat` frames' ops (reachability, circuits, hole punching: docs/protocol.md 34)
        self.nat = Nat(self.counters)
        self.connections = Connections(self, self.admission, self._announce_bytes, self._greet, self._wake_outbox)
        #: what peers see us at and what dial-backs confirmed (docs/protocol.md 34.1, 34.2)
        self.reach = Reachability(limits=settings.dialback, routable=self._reach_routable, counters=self.counters)
        self.dialback = Dialback(self)
        self._confirmed: list[str] = []
        #: circuit relays: ours if we have the role, and the reservations we hold (docs/protocol.md 34.3)
        self.circuits = Circuits(self, self.connections, rng)
        #: hole punching over relayed sessions (docs/protocol.md 34.4)
        self.punching = Punching(self, self.connections, settings.punch)
        self.punching.register(self.nat)
        self._pruned_at = 0.0
        self._stopping = False
        self.lan = None
        self.dht = None
        self.port = 0
        self.dht_port = 0
        self.addresses: list[str] = []
        node.store_hooks.append(self._store_hook)

    async def _greet(self, link: Link) -> None:
        """A session starts, before its first frame is read: our interests to the peer, where
        we see it (`observed`), and a punch when it came through a relay."""
        self.wants.send(link)
        self.dialback.admitted(link)
        self.punching.admitted(link)
        await link.flush()

    def _store_hook(self, conn, source: str, done) -> None:
        """In the ingest transaction (a writer thread): the core's outbox and relay holding."""
        if self.core.store_hook(SqlitePort(conn), source, done, self.node.now_us()):
            self.node.loop.call_soon_threadsafe(self._wake_outbox.set)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        app = web.Application(client_max_size=s.session.max_frame_bytes)
        app.router.add_get(PEER_PATH, self.connections.accept)
        app.router.add_get(ANNOUNCE_PATH, self._serve_announce)
        app.router.add_get(DIALBACK_PATH, self.dialback.serve)
        app.router.add_get(CIRCUIT_PATH, self.circuits.serve)
        # on stop, connection handlers still running after 1 s are cancelled (they only read frames)
        self._runner = web.AppRunner(app, **server_options(s.idle_connection_seconds), access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.reach.port = self.port
        await self.dialback.start()
        self.connections.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=s.dialing.timeout))
        for row in await self.node.db.read(ms.load_peers):
            self.peers[row.did] = row
        await self.dialer.prune()  # a table written before it was bounded, or under a larger cap
        now_us, mono = self.node.now_us(), time.monotonic()
        for key, until_us in await self.node.db.write(lambda conn: ms.load_bans(conn, now_us)):
            # bans outlive a restart, but never run longer than a ban does: one written by a
            # clock that was ahead would otherwise last as long as that clock was off
            self.admission.bans.ban(key, mono, min((until_us - now_us) / 1e6, s.mesh.ban_seconds))
        if self.core.relaying:
            clamp_us = now_us + s.relay.max_hold_seconds * 1_000_000
            await self.node.db.write(lambda conn: ms.relay_clamp(conn, clamp_us))
        if s.dht:
            from hmpnode.net.dht import Dht

            self.dht = Dht(self.identity, host=_ip_literal(s.host), port=s.dht_port,
                           min_difficulty=s.min_difficulty, clock=self.node.clock, limits=s.dht_limits,
                           on_refuse=lambda reason: self.node.refuse("dht", reason))
            await self.dht.start(list(s.bootstrap))
            self.dht_port = self.dht.port
            self.dialer.dht_local = is_loopback_ip(_ip_literal(s.host))
        self.addresses = self._own_addresses()
        if s.lan.enabled:
            from hmpnode.net.lan import LanDiscovery

            self.lan = LanDiscovery(
                s.lan, own_did=self.identity.did, announce=self._announce_bytes, on_peer=self.dialer.on_lan_peer,
                verifier=self.node.verifier(), clock=self.node.clock,
                on_refuse=lambda reason: self.node.refuse("lan", reason),
            )
            await self.lan.start()
        for coro in (gossip.forward_loop(self, self.publisher), drive.outbox_loop(self.core, self.world, self._wake_outbox),
                     self.dialer.connect_loop(), self._maintenance_loop(), DL.delta_loop(self), self.dialback.loop(),
                     self.circuits.loop(),
                     self.snapshots.current()):  # the reconciliation snapshot, built before the first peer needs it
            self.spawn(coro)
        if self.dht is not None:
            self.spawn(self.publisher.dht_loop())
            self.spawn(self.publisher.provide_loop())

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        sessions = list(self.sessions.values())
        for link in sessions:
            link.closed = True
        if sessions:  # all at once, bounded: a peer that does not answer the close costs 2 s, not 2 s each
            await asyncio.wait([asyncio.ensure_future(close_quietly(s.ws)) for s in sessions], timeout=2)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self.lan is not None:
            await self.lan.stop()
        if self.dht is not None:
            await self.dht.stop()
        if self.connections.client is not None:
            await self.connections.client.close()
        await self.dialback.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run `coro` on its own until it ends or the mesh stops (a failure is logged)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._stopping:
            log.error("mesh task failed", exc_info=task.exception())

    # -- our announce -------------------------------------------------------------------

    def _own_addresses(self) -> list[str]:
        """What we announce: [peer] announce and the interfaces' addresses, less no_announce
        (hmpnode.net.addresses.own_addresses)."""
        hosts: list[str]
        if self.settings.host in ("0.0.0.0", "", "::"):
            from hmpnode.net.interfaces import interfaces

            hosts = list(dict.fromkeys(str(i.address) for i in interfaces())) or ["127.0.0.1"]
        else:
            hosts = [self.settings.host]
        a = self.settings.addresses
        return own_addresses(interface_hosts=hosts, port=self.port, dht_port=self.dht_port if self.dht else None,
                             announce=a.announce, no_announce=a.no_announce, announce_interfaces=a.announce_interfaces,
                             confirmed=self.reach.confirmed_addresses())  # confirmed by dial-back (34.2)

    def _reach_routable(self, ip: str) -> bool:
        """Does an IP a peer sees us at count for reachability? When we would dial it on a
        peer's word (docs/protocol.md 20.6); loopback only when listed in dial_allow, so that
        [peer] dial_private never makes a node call itself public on loopback."""
        policy = self.settings.dialing.policy
        if is_loopback_ip(ip):
            policy = dataclasses.replace(policy, private=False)
        return D.check(format_addr(ip, 1), D.Origin("observed"), policy, schemes=("tcp",)) is None

    def mailman(self) -> list[str]:
        """The relays that hold containers for our agent (MeshCore.mailman)."""
        return self.core.mailman(self.settings.mailman)

    def announced_addresses(self) -> list[str]:
        """What our announce and DHT peer record list: our own addresses, then the relayed
        ones of the circuit reservations we hold."""
        return self.addresses + self.circuits.addresses()

    def announce(self) -> dict[str, Any]:
        """Our signed peer_announce (announce.OwnAnnounce)."""
        return self.own.current(self.announced_addresses(), self.mailman(), self.node.now(), time.monotonic())

    def _announce_bytes(self) -> bytes:
        return orjson.dumps(self.announce())

    async def _serve_announce(self, request: web.Request) -> web.Response:
        return web.Response(body=self._announce_bytes(), content_type="application/json")

    # -- admission (hmpnode.net.admission decides; this carries it out) ------------------------

    def slots(self, but: str | None = None) -> list[Slot]:
        """The live connections' slots (hmpnode.net.slots)."""
        return self.admission.slots(self.sessions.values(), but)

    async def dial(self, addr: str, expect_did: str | None = None, *, origin: D.Origin,
                   require_did: bool = False) -> Link | None:
        """Connect to a peer's `tcp://` address learnt from `origin` (Connections.dial)."""
        return await self.connections.dial(addr, expect_did, origin=origin, require_did=require_did)

    async def _clock_skew(self, link: Link, event: SE.ClockSkew) -> None:
        """A signed message of the peer dated outside our window: its clock or ours is off.
        Not an offence (no strikes, never a ban: docs/protocol.md 25.4): the session said so,
        with the offset, and ended; handshakes are refused as clock_skew until a clock is
        fixed, then the peers connect again."""
        self.skew.add(link.did, event.offset, jump=True)
        self.counters["clock_skew_closed"] += 1
        self.node.refuse("peer", "clock_skew")
        log.warning("peer %s: clock off by %+.0f s; connection closed", link.did, event.offset)
        self.dialer.dials.defer(link.did, time.monotonic() + 10.0)  # not straight back: the clock is still off

    async def _on_refused(self, link: Link, event: SE.Refused) -> None:
        """A refusal the session made (strike, error frame). The frame it came in is dropped
        while the session goes on: said in the log (rate limited), so that what a dropped
        frame held up can be traced. A peer cut off is banned (the session is closed)."""
        if event.sync is not None:
            self.node.refuse("sync", event.sync)
        if event.cause:
            limited.log(logging.WARNING, (link.did, "unhandled"), "peer %s: frame not handled: %s", link.did,
                        event.cause)
        limited.log(logging.WARNING, (link.did, event.reason), "peer %s (%s): frame refused, %s: %.200s "
                    "(%d strikes of %d)", link.did, link.ip, event.reason, event.detail, link.session.strikes.count,
                    self.settings.session.strike_threshold)
        if event.cut:
            self.connections.cut_off(link)

    # -- events of a session ---------------------------------------------------------------------

    async def drive(self, link: Link, events: Sequence[SE.SessionEvent]) -> None:
        """Carry out a session's events (`MeshCore.session_events`)."""
        await drive.run(self.core.session_events(link, events), self.world)

    async def _unhandled(self, link: Link, event: Any) -> None:
        """A session event the core leaves to this driver."""
        await self._handlers[type(event)](link, event)

    @functools.cached_property
    def _handlers(self) -> dict[type, Any]:
        return {
            SE.BlocksReceived: self._on_blocks, SE.PeerError: self._on_peer_error, SE.Refused: self._on_refused,
            SE.ClockSkew: self._clock_skew, SE.ClockSample: self._on_clock_sample,
            SE.Modified: functools.partial(DL.on_modified, self), SE.Removed: functools.partial(DL.on_removed, self),
            SE.IndexRequested: self.queries.on_requested, SE.IndexEntries: self.queries.on_entries,
            SE.IndexDone: self.queries.on_done, SE.NatReceived: self.nat.on_frame,
        }

    async def _on_peer_error(self, link: Link, event: SE.PeerError) -> None:
        log.debug("peer %s reports %.64r: %.200r", link.did, event.reason, event.detail)
        if event.reason in D.GIVE_WAY:  # it needed our slot: backed off like a failed dial, not dialled straight back
            self.dialer.dials.failed(link.did, time.monotonic())

    async def _on_clock_sample(self, link: Link, event: SE.ClockSample) -> None:
        self.skew.add(link.did, event.offset)

    def _charger(self, link: Link):
        """What charges verification CPU seconds to `link`'s budget (into debt)."""
        def charge(seconds: float) -> None:
            link.session.charge_cpu(time.monotonic(), seconds)
        return charge

    async def _on_blocks(self, link: Link, event: SE.BlocksReceived) -> None:
        for did, block in event.items:
            if await self.node.take_blocks(did, **{event.kind: block}):
                DL.changed(self, did, link.did)  # new evaluations: `modified` to the others (32)

    def evaluated(self, did: str) -> None:
        """Our agent evaluated `did` (or took another agent's evaluation of it): a `modified`
        entry to the peers allowed to hold it, who ask for the block (spec 5.6, 32)."""
        DL.changed(self, did)

    def revoked(self, revocations: list[tuple[str, datetime]]) -> None:
        """Keys just revoked: their held containers signed later are removed (32)."""
        self.spawn(DL.revocations(self, revocations))

    # -- maintenance (the node-wide loops: gossip, outbox, peers, provide) -------------------------------------------------------------------------------------

    async def _maintenance_loop(self) -> None:
        """Drop relay holdings past their ttl; re-announce when our mailmen changed."""
        mailman = self.mailman()
        while True:
            await asyncio.sleep(1.0)
            try:
                mailman = await self._maintain(mailman)
            except Exception:
                log.exception("mesh maintenance failed")

    async def _maintain(self, mailman: list[str]) -> list[str]:
        mono = time.monotonic()
        if self.dialer.prune_due or mono - self._pruned_at > 10.0:  # expiry of peers that never answered
            self.dialer.prune_due, self._pruned_at = False, mono
            await self.dialer.prune()
        idle = mono - self.settings.mesh.sync_idle_seconds
        for link in list(self.sessions.values()):  # answered reconciliations left idle hold a snapshot
            link.session.expire_reconciliations(idle)
        await self._timers(mono)
        if self.core.relaying:
            await drive.run(self.core.expire_holdings(), self.world)
        confirmed = self.reach.confirmed_addresses()
        moved = confirmed != self._confirmed
        if moved:  # a dial-back confirmed an address, or one lapsed: announce anew
            self._confirmed, self.addresses = confirmed, self._own_addresses()
        current = self.mailman()
        if current != mailman or moved:
            if self.lan is not None:
                await self.lan.announce_now()
            if self.dht is not None:
                self.spawn(self.publisher.dht_publish())
        return current

    async def _timers(self, mono: float) -> None:
        """The sessions' deadlines (requests not answered, a relay's re-offer), each session
        on its own: one that fails is logged, the others go on."""
        for link, events in self.core.due_timers(mono):
            try:
                await self.drive(link, events)
            except Exception:
                log.exception("peer %s: timer failed", link.did)


def _ip_literal(host: str) -> str:
    """The DHT binds an IP address: a host name is resolved once, at start."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)
    if not infos:
        raise OSError(f"{host} has no IPv4 address")
    return infos[0][4][0]


class _NodeWorld(drive.World):
    """The core's effects on a live node: the SQLite store, verify threads, sockets."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.node = mesh, mesh.node

    def clock(self) -> tuple[datetime, float]:
        return self.node.now(), time.monotonic()

    async def read(self, fn):
        return await self.node.db.read(lambda conn: fn(SqlitePort(conn)))

    async def write(self, fn):
        return await self.node.db.write(lambda conn: fn(SqlitePort(conn)))

    async def ingest(self, effect: C.Ingest):
        return await self.node.ingest(effect.items, source=effect.source, budget=effect.budget,
                                      on_cpu=self.mesh._charger(effect.link))

    async def offload(self, effect: C.Offload):
        return await self.node.offload(effect.fn, on_cpu=self.mesh._charger(effect.link))

    async def flush(self, link: Link) -> None:
        await link.flush()

    async def reach(self, did: str, *, mail: bool = False) -> Link | None:
        dialer = self.mesh.dialer
        return await (dialer.reach_for_mail(did) if mail else dialer.reach(did))

    async def find_peer(self, did: str):
        return None if self.mesh.dht is None else await self.mesh.dht.find_peer(did)

    async def sets(self):
        return await self.mesh.snapshots.current()

    def spawn(self, steps) -> None:
        self.mesh.spawn(drive.run(steps, self))

    async def cut_off(self, link: Link) -> None:
        self.mesh.connections.cut_off(link)
        await link.flush()
        link.closed = True
        await link.ws.close()

    async def unhandled(self, link: Link, event) -> None:
        await self.mesh._unhandled(link, event)
