"""The mesh: peer connections and the wiring of the node-wide jobs.

The adapter around the sans-IO pieces: it listens on the node's peer port
(aiohttp, WebSocket at `PEER_PATH`), accepts and dials connections, and moves
containers between the node's store and its peers.

Who does what: `transport` (with `peerauth`) turns WebSocket bytes into a peer's
plaintext frames and back; `session.PeerSession` is one peer's protocol state and
makes every per-connection decision (what a frame means and earns, budgets,
strikes, acks, which containers to send and how to batch them, reconciliation
steps), emitting events; this module (`Link` per connection) runs the handshake
and admission (slots, bans), feeds frames to the session, answers its events
from the store (`_handle`: one container goes socket -> `_frames` -> session ->
`_on_containers` -> node.ingest), sends what it queued, runs CPU work on the
verify threads, and keeps relay admission. The node-wide jobs have their own
modules, started here: `gossip` (the forward loop), `outbox` (directed delivery,
relays, the store hook), `peers` (the peers table, dialing), `provide` (what we
publish in the DHT), `catchup` (the shared reconciliation snapshot); `views`
reads them for the API.

Every peer connection is a v2 session (`hmp-peer/2`, docs/protocol.md 21): a
Noise XX handshake bound to both identities, then every frame travels as AEAD
records in binary WebSocket messages. There is no cleartext (v1) peer path.

- Every container a node stores (from its agent or a peer) is offered onward
  by the forward loop (`gossip`): a `broadcast` one is pushed to `fanout` random eligible
  peers and announced (a `container_delta`) to the other eligible ones, which
  ask for it if they lack it; a directed one goes to a connected peer that
  serves a recipient. Eligibility is `scope.may_forward` (scope, expiry,
  audience) per connection; a connection remembers what went either way over
  it and never carries a container twice.
- On every new connection the dialing side reconciles with the other
  (`reconcile`, range-based set reconciliation over the broadcast containers
  both may send each other, `syncset`): it learns what each side lacks in
  bytes that grow with the difference, pushes what the peer lacks and asks
  for what it lacks; a relay offers what it holds for the peer. So a node
  that was away catches up.
- The agent's directed containers wait in the durable outbox (`outbox`) until a
  recipient, or a relay holding them for it, acknowledges them; retries back
  off exponentially; expired ones are dropped.
- With the `relay`/`mailman` role, containers for other recipients are held
  (`relay_queue`) and handed over when the recipient connects and asks;
  deleted after its `container_ack` or at their `ttl`.
- What changes about a held container later (new evaluations, referenced-by,
  its ttl passing, its sender's key revoked) goes to the peers in
  `container_delta` `modified`/`removed` (`delta`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import random
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import nacl.utils
import orjson
from aiohttp import web

from hmpnode.container.build import build_container
from hmpnode.net import dialing as D
from hmpnode.net import catchup, drive, gossip, peers, provide
from hmpnode.net import core as C
from hmpnode.net.core import MeshCore
from hmpnode.net import delta as DL
from hmpnode.net import index as IX
from hmpnode.net import mce as M
from hmpnode.net.interests import ChangedTooOften, InterestError, InterestLimits, Interests, topic_changes
from hmpnode.net.announce import ANNOUNCE_CLASS, DEFAULT_MIN_DIFFICULTY, make_address_record, parse_addr
from hmpnode.net.peerauth import AnnounceGate, PeerInfo
from hmpnode.net.penalty import BanList, DidChurn, TokenBucket
from hmpnode.net.relay import verify_relay_chain
from hmpnode.net import session as SE
from hmpnode.net.session import PeerSession, SessionLimits
from hmpnode.net.relayquota import RelayLimits
from hmpnode.net.dht import DhtLimits
from hmpnode.net.lan import LanSettings
from hmpnode.net.skew import SkewEstimates
from hmpnode.net.scope import Channel, is_loopback_ip, parse_ip
from hmpnode.net.slots import Slot, SlotLimits, address_keys, ban_key
from hmpnode.net.slots import admit as admit_slot
from hmpnode.net.slots import score as slot_score
from hmpnode.net.transport import MAX_FRAGMENT, PROLOGUE, PROTOCOLS, KeyPair, NoiseHandshake, TransportError, UnitReader
from hmpnode.net.transport import make_payload
from hmpnode.logs import LogLimiter
from hmpnode.serving import DEFAULT_IDLE_CONNECTION_SECONDS, server_options
from hmpnode.store import mesh as ms
from hmpnode.store.port import SqlitePort
from hmpnode.store import records as db

__all__ = ["Mesh", "MeshSettings", "PEER_PATH", "ANNOUNCE_PATH"]

log = logging.getLogger("hmpnode.mesh")
#: what a peer's frames or an undelivered holding make the node say: one line per peer and
#: reason a minute at most (a flood of refusals must not flood the log)
limited = LogLimiter(log, 60.0)

#: the peer protocol's WebSocket path: a later version gets its own path next to it
PEER_PATH = "/hmp/v2/peer"
#: WebSocket close code of a refusal before the handshake completed (reason: our code)
CLOSE_REFUSED = 4403
ANNOUNCE_PATH = "/hmp/v1/announce"
#: details of the refusals sent in error frames (reason -> detail)
_REFUSALS = {"banned": "this node is ignored for a while", "fresh_did": "no new DIDs from this host for a while"}
#: inbound handshakes in progress from one (non-loopback) address
PENDING_PER_IP = 4


@dataclass(frozen=True, slots=True)
class MeshLimits:
    """The mesh's node-wide limits: what spans connections (the core's forward plan, ledger
    and outbox; admission; catch-up snapshots; mesh-wide queries). Declared here only;
    hmpnode.config.PeerSettings.mesh_limits builds them from [peer] once."""

    #: peers a broadcast container is pushed to (the others get an announcement)
    fanout: int = 4
    #: how long a broadcast's announcements wait after its pushes (MeshCore.announce)
    announce_delay_seconds: float = 0.2
    #: who-has-what entries (hmpnode.net.ledger) one connection may fill, and all of them together
    ledger_session_entries: int = 20_000
    ledger_max_entries: int = 400_000
    #: a directed container handed to a peer and not acknowledged within this long is sent again
    ack_timeout: float = 30.0
    #: the outbox's back-off (core.retry_at): base seconds doubled per try, at most retry_max
    retry_base: float = 1.0
    retry_max: float = 300.0
    #: how long a peer cut off (or an address over its DID churn) stays banned
    ban_seconds: float = 600.0
    #: distinct DIDs one (non-loopback) address may present within did_window_seconds before it is banned
    max_dids_per_address: int = 16
    did_window_seconds: float = 600.0
    #: seconds a handshake may take
    handshake_timeout: float = 10.0
    #: a stale node-wide snapshot is rebuilt only when at least this old (one rebuild of
    #: 100 000 items costs ~0.5 s of CPU; what arrives meanwhile travels by gossip)
    sync_snapshot_seconds: float = 5.0
    #: a responder's reconciliation left unanswered this long is dropped
    sync_idle_seconds: float = 60.0
    #: a mesh-wide query (versions?mesh=1) asks at most this many connected peers, waiting this long in all
    index_query_peers: int = 8
    index_query_seconds: float = 2.0


@dataclass(frozen=True, slots=True)
class MeshSettings:
    """What the mesh runs with: the node's facts, then one frozen limits object per area,
    each declared in its own module and built once from its config section
    (hmpnode.daemon.mesh_settings; tests/test_config.py checks no limit is declared twice)."""

    host: str = "127.0.0.1"
    port: int = 0
    roles: tuple[str, ...] = ()
    name: str = ""
    interests: tuple[str, ...] = ()
    #: DIDs of relays that hold containers for this agent, besides connected relays
    mailman: tuple[str, ...] = ()
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY
    #: DIDs that always get a slot and are never evicted; CIDRs whose peers are treated alike
    pinned: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    #: seconds a peer connection may stay open with no request in progress ([node])
    idle_connection_seconds: float = DEFAULT_IDLE_CONNECTION_SECONDS
    #: the DHT (UDP, on dht_port; 0: any) and where it bootstraps from
    dht: bool = True
    dht_port: int = 0
    bootstrap: tuple[tuple[str, int], ...] = ()
    #: what the agent declared in [interests] (<data_dir>/interests.json, written by the API, wins)
    declared: Interests = Interests()
    mesh: MeshLimits = MeshLimits()
    #: per connection (hmpnode.net.session)
    session: SessionLimits = SessionLimits()
    #: the relay role's quotas (hmpnode.net.relayquota)
    relay: RelayLimits = RelayLimits()
    #: container_delta `modified`/`removed` (hmpnode.net.deltaplan; docs/protocol.md 32)
    delta: DL.DeltaLimits = DL.DeltaLimits()
    #: peer slots (hmpnode.net.slots; docs/protocol.md 21.4)
    slots: SlotLimits = SlotLimits()
    #: dialing and the peers table (hmpnode.net.dialing; docs/protocol.md 20.6)
    dialing: D.DialLimits = D.DialLimits()
    #: the DHT's bounds (hmpnode.net.dht, its store: hmpnode.net.dhtrecords)
    dht_limits: DhtLimits = DhtLimits()
    #: LAN discovery (hmpnode.net.lan; `enabled`)
    lan: LanSettings = LanSettings()


# ---------------------------------------------------------------------------------------
# One authenticated connection.


@dataclass(eq=False)
class Link:
    """One connection: its WebSocket and AEAD transport around the sans-IO session
    (hmpnode.net.session.PeerSession), which holds the protocol state."""

    ws: Any
    info: PeerInfo
    session: PeerSession
    started: float
    #: address and subnet keys of its slot (hmpnode.net.slots)
    address: str = ""
    subnet: str | None = None
    pinned: bool = False
    #: the session's AEAD records (hmpnode.net.transport.Transport)
    transport: Any = None
    #: frames that arrived with the handshake's last message, not yet handled
    backlog: list[bytes] = field(default_factory=list)
    #: what reconciliation found moves one transfer at a time
    transfer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False

    @property
    def did(self) -> str:
        return self.info.did

    @property
    def roles(self) -> tuple[str, ...]:
        return self.info.announce.roles

    @property
    def ip(self) -> str:
        return self.session.ip

    @property
    def channel(self) -> Channel:
        return self.session.channel

    @property
    def initiator(self) -> bool:
        return self.session.initiator

    @property
    def lazy(self) -> bool:
        return self.session.lazy

    async def flush(self, *, closing: bool = False) -> bool:
        """Send the frames the session queued, each as its record(s) in one binary
        WebSocket message (encrypted under the lock: the record counters follow the
        order on the wire); `closing`: also after the link was marked closed."""
        async with self.send_lock:
            frames = self.session.data_to_send()
            if self.closed and not closing:
                return False
            try:
                for data in frames:
                    await self.ws.send_bytes(self.transport.encrypt(data))
                return True
            except (ConnectionError, RuntimeError, aiohttp.ClientError, TransportError):
                self.closed = True
                return False

# ---------------------------------------------------------------------------------------


class Mesh:
    def __init__(self, node, settings: MeshSettings):
        self.node = node
        self.settings = settings
        self.identity = node.identity
        self.counters: Counter[str] = Counter()
        self._rng = random.Random(nacl.utils.random(16))
        #: the node-wide decisions (sans-IO); this class carries out what they ask (`world`)
        self.core = MeshCore(node.identity, settings, self._rng, self.counters,
                             revoked_at=node.registry.revoked_at, refuse=node.refuse,
                             chain_ok=lambda chain: verify_relay_chain(chain, registry=node.registry).ok,
                             on_changed=lambda did, origin: DL.changed(self, did, origin))
        self.world = _NodeWorld(self)
        #: the connected peers (DID -> link) and what is known of peers: the core's
        self.sessions: dict[str, Link] = self.core.links
        self.peers: dict[str, ms.PeerRow] = self.core.peers
        self.ledger = self.core.ledger
        #: the node-wide reconciliation sets (catchup), rebuilt lazily
        self.snapshots = catchup.Snapshots(self.world, lambda: node.last_seq, node.now_us, settings, self.counters)
        self.bans = BanList(settings.mesh.ban_seconds)
        self.slot_limits = settings.slots
        self.churn = DidChurn(settings.mesh.max_dids_per_address, settings.mesh.did_window_seconds)
        self._session_limits = settings.session
        self._pinned = frozenset(settings.pinned)
        self._allow = tuple(ipaddress.ip_network(c, strict=False) for c in settings.allow)
        #: after a DID from this host was banned: until when fresh DIDs from this host are
        #: refused, and since when a DID counts as fresh (monotonic)
        self._loopback_locked = (0.0, 0.0)
        #: DIDs that had a connection from this host -> when first (bounded, least recently seen go)
        self._local_dids: OrderedDict[str, float] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self._dialing: set[str] = set()
        #: our Noise static key for this run (signed by our identity in every handshake)
        self._static = KeyPair.generate(nacl.utils.random)
        #: inbound connections in their handshake, per remote address
        self._pending: dict[str, int] = {}
        self.dial_policy = settings.dialing.policy
        self.dials = settings.dialing.budget(random.Random(nacl.utils.random(16)))
        self._ifaces: tuple[float, list[Any]] = (-1e9, [])
        self._persisted: dict[str, int] = {}  # peer DID -> when its row was last written
        #: peer DID -> the addresses its current announce lists (before the dial rule)
        self._raw_addresses: dict[str, list[str]] = {}
        #: peer DID -> where its stored addresses were learnt (they are judged by it again when dialled)
        self._origins: dict[str, D.Origin] = {}
        #: set when containers were given a provider record (the list is on disk: ms.provide_*)
        self._provide = asyncio.Event()
        self._address_records: dict[str, dict[str, Any]] = {}
        self._announce: dict[str, Any] | None = None
        self._announce_at = 0.0
        self._wake_outbox = asyncio.Event()
        self._wake_connect = asyncio.Event()
        self._wake_prune = False
        self._dht_on_loopback = False
        self._pruned_at = 0.0
        self._stopping = False
        self.lan = None
        self.dht = None
        self.port = 0
        self.dht_port = 0
        self.addresses: list[str] = []
        #: each peer's clock offset, from what it signs (status, metrics)
        self.skew = SkewEstimates()
        node.store_hooks.append(self._store_hook)
        #: what our agent wants (docs/protocol.md 33): announced to every peer in a peer_query;
        #: where it comes from: "config" ([interests]) or "api" (saved by PUT /v1/interests)
        self.interests_from = "config"
        self.interests = self._load_interests()
        self._interests_lock = asyncio.Lock()
        #: changes the agent may make: at most half of a peer's default peer_query budget,
        #: so that announcing them never earns this node a strike (33.2)
        self.interest_changes = TokenBucket(settings.session.peer_queries_per_minute / 120.0,
                                            max(settings.session.peer_queries_per_minute / 2, 1.0))
        #: changes to announce in `container_delta` modified/removed (hmpnode.net.delta)
        self.delta = DL.DeltaQueue(settings.delta)

    def _store_hook(self, conn, source: str, done) -> None:
        """In the ingest transaction (a writer thread): the core's outbox and relay holding."""
        if self.core.store_hook(SqlitePort(conn), source, done, self.node.now_us()):
            self._loop.call_soon_threadsafe(self._wake_outbox.set)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        app = web.Application(client_max_size=s.session.max_frame_bytes)
        app.router.add_get(PEER_PATH, self._accept)
        app.router.add_get(ANNOUNCE_PATH, self._serve_announce)
        # on stop, connection handlers still running after 1 s are cancelled (they only read frames)
        self._runner = web.AppRunner(app, **server_options(s.idle_connection_seconds), access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=s.dialing.timeout))
        for row in await self.node.db.read(ms.load_peers):
            self.peers[row.did] = row
        await peers.prune(self)  # a table written before it was bounded, or under a larger cap
        now_us, mono = self.node.now_us(), time.monotonic()
        for key, until_us in await self.node.db.write(lambda conn: ms.load_bans(conn, now_us)):
            # bans outlive a restart, but never run longer than a ban does: one written by a
            # clock that was ahead would otherwise last as long as that clock was off
            self.bans.ban(key, mono, min((until_us - now_us) / 1e6, s.mesh.ban_seconds))
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
            self._dht_on_loopback = is_loopback_ip(_ip_literal(s.host))
        self.addresses = self._own_addresses()
        if s.lan.enabled:
            from hmpnode.net.lan import LanDiscovery

            self.lan = LanDiscovery(
                s.lan, own_did=self.identity.did, announce=self._announce_bytes, on_peer=functools.partial(peers.on_lan_peer, self),
                verifier=self.node.verifier(), clock=self.node.clock,
                on_refuse=lambda reason: self.node.refuse("lan", reason),
            )
            await self.lan.start()
        for coro in (gossip.forward_loop(self), drive.outbox_loop(self.core, self.world, self._wake_outbox), peers.connect_loop(self), self._maintenance_loop(),
                     DL.delta_loop(self),
                     self.snapshots.current()):  # the reconciliation snapshot, built before the first peer needs it
            self._spawn(coro)
        if self.dht is not None:
            self._spawn(provide.dht_loop(self))
            self._spawn(provide.provide_loop(self))

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        sessions = list(self.sessions.values())
        for link in sessions:
            link.closed = True
        if sessions:  # all at once, bounded: a peer that does not answer the close costs 2 s, not 2 s each
            await asyncio.wait([asyncio.ensure_future(_close_quietly(s.ws)) for s in sessions], timeout=2)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self.lan is not None:
            await self.lan.stop()
        if self.dht is not None:
            await self.dht.stop()
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _spawn(self, coro) -> asyncio.Task:
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
        hosts: list[str]
        if self.settings.host in ("0.0.0.0", "", "::"):
            from hmpnode.net.interfaces import interfaces

            hosts = list(dict.fromkeys(str(i.address) for i in interfaces())) or ["127.0.0.1"]
        else:
            hosts = [self.settings.host]
        addrs = [f"tcp://{h}:{self.port}" for h in hosts]
        if self.dht is not None:
            addrs += [f"udp://{h}:{self.dht_port}" for h in hosts]
        return addrs

    def _mailman(self) -> list[str]:
        return self.core.mailman(self.settings.mailman)

    def announce(self) -> dict[str, Any]:
        """Our signed peer_announce, re-signed when older than a second or when
        what it says changed (address records and their proof of work are cached)."""
        mailman = self._mailman()
        now = self.node.now()
        now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # what the timestamp can say
        current = self._announce
        if current is not None:
            payload = current["hmp_container"]["payload"]
            if payload["mailman"] == mailman and time.monotonic() - self._announce_at < 1.0:
                return current
        records = []
        for addr in self.addresses:
            record = self._address_records.get(addr)
            if record is None:
                record = self._address_records[addr] = make_address_record(
                    self.identity.did, addr, difficulty=self.settings.min_difficulty)
            records.append(record)
        payload = {
            "name": self.settings.name, "interests": list(self.settings.interests), "expertise": [],
            "roles": list(self.settings.roles), "mailman": mailman, "addresses": records,
            "protocols": list(PROTOCOLS),
        }
        self._announce = build_container(self.identity, ANNOUNCE_CLASS, payload, now=now)
        self._announce_at = time.monotonic()
        return self._announce

    def _announce_bytes(self) -> bytes:
        return orjson.dumps(self.announce())

    async def _serve_announce(self, request: web.Request) -> web.Response:
        return web.Response(body=self._announce_bytes(), content_type="application/json")

    # -- peers ------------------------------------------------------------------------------

    def _interfaces(self) -> list[Any]:
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

    def _dht_local(self) -> bool:
        """The DHT socket is bound to loopback: every DHT record came from this host."""
        return self._dht_on_loopback

    def _vet(self, addresses: Iterable[Any], origin: D.Origin, *, count: bool = True) -> list[str]:
        """The addresses the dial rule allows for this origin; each refused one is
        counted (refused{area="dial"}) when `count`."""
        allowed, refused = D.vet(addresses, origin, self.dial_policy)
        if count:
            for reason in refused:
                self.node.refuse("dial", reason)
                self.counters[f"dial_refused_{reason}"] += 1
        return allowed

    # -- slots (hmpnode.net.slots decides; this feeds it and carries it out) ------------------

    def _allowed(self, ip: str) -> bool:
        addr = parse_ip(ip)
        return addr is not None and any(addr in net for net in self._allow if net.version == addr.version)

    def _slot(self, link: Link) -> Slot:
        return Slot(link.did, link.initiator, link.address, link.subnet, link.pinned,
                    slot_score(link.session.useful, link.session.strikes.count), link.started)

    def _slots(self, but: str | None = None) -> list[Slot]:
        return [self._slot(x) for d, x in self.sessions.items() if d != but and not x.closed]

    def _refused(self, reason: str) -> None:
        self.node.refuse("peer", reason)
        self.counters[f"refused_{reason}"] += 1

    async def _disconnect(self, link: Link, reason: str, detail: str) -> None:
        """Close a connection the node no longer wants (its slot is free at once)."""
        link.closed = True
        link.session.send_error(reason, detail)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(link.flush(closing=True), 2.0)
        await _close_quietly(link.ws)

    def _ban_address(self, key: str, reason: str) -> None:
        """Ban an address (or IPv6 /64; `ban_key`) minting DIDs: close its unpinned connections."""
        seconds = self._ban([key])
        self.counters["banned_addresses"] += 1
        self.node.refuse("peer", reason)
        log.warning("address %s banned for %.0f s: %s", key, seconds, reason)
        for link in list(self.sessions.values()):
            if key in (link.address, link.subnet) and not link.pinned and not link.closed:
                self._spawn(self._disconnect(link, "banned", "this address is ignored for a while"))

    def _ban(self, keys: list[str]) -> float:
        """Ban DIDs or address keys (repeat offenders for longer: BanList) and write the
        bans to the store, so that they outlive a restart; the length of the last one."""
        mono, now_us = time.monotonic(), self.node.now_us()
        rows = [(k, now_us + int(self.bans.ban(k, mono) * 1_000_000)) for k in keys]
        self._spawn(self.node.db.write(lambda conn: ms.save_bans(conn, rows, now_us, self.bans.max_entries)))
        return (rows[-1][1] - now_us) / 1e6

    def _address_banned(self, ip: str, mono: float) -> bool:
        channel = self._channel(ip)
        key = ban_key(*address_keys(ip, channel))
        return self.bans.banned(ip, mono) or (key != ip and self.bans.banned(key, mono))

    def _refusal_for_claim(self, claimed: str, role: str, ip: str) -> str | None:
        """What the DID a handshake's announce claims already earns (unverified, read
        before any signature work): banned; from a responder's side also a fresh DID
        refused (`_fresh_did_refusal`), or no slot. Claims are counted unverified:
        minting DIDs costs the attacker nothing here, but only its own address pays."""
        if self.bans.banned(claimed, time.monotonic()):
            return "banned"
        if role != "responder":
            return None
        channel = self._channel(ip)
        refusal = self._fresh_did_refusal(ip, channel, claimed)
        if refusal is not None:
            return refusal
        address, subnet = address_keys(ip, channel)
        new = Slot(claimed, False, address, subnet, claimed in self._pinned or self._allowed(ip))
        verdict = admit_slot(self._slots(but=claimed), new, self.slot_limits)
        return None if verdict.admit else verdict.reason

    def _loopback_fresh(self, did: str) -> bool:
        """This host is locked (one of its DIDs was banned) and `did` had no connection before."""
        until, since = self._loopback_locked
        first = self._local_dids.get(did)
        return until > time.monotonic() and (first is None or first >= since)

    def _fresh_did_refusal(self, ip: str, channel: Channel, did: str) -> str | None:
        """A reason to refuse an inbound DID this address has not shown before, or None.

        Elsewhere an address presenting more than `max_dids_per_address` DIDs within
        the window is banned. This host (loopback) is never banned as an address (every
        node on it shares 127.0.0.1): after one of its DIDs was banned, it may only
        bring DIDs that had a connection before, for the ban length."""
        mono = time.monotonic()
        if channel is Channel.LOOPBACK:
            return "fresh_did" if self._loopback_fresh(did) else None
        if self._allowed(ip):
            return None
        key = ban_key(*address_keys(ip, channel))
        if self.churn.over(key, did, mono):
            self.churn.forget(key)
            self._ban_address(key, "did_churn")
            return "banned"
        return None

    # -- connections --------------------------------------------------------------------------

    def _channel(self, ip: str) -> Channel:
        addr = parse_ip(ip)
        if addr is None:
            return Channel.GLOBAL
        if addr.is_loopback:
            return Channel.LOOPBACK
        from hmpnode.net.interfaces import interface_for

        iface = interface_for(str(addr))
        if iface is None:
            return Channel.GLOBAL
        # one of this host's own addresses: another node on this host, reached through lo
        return Channel.LOOPBACK if iface.address == addr else Channel.LAN

    async def _accept(self, request: web.Request) -> web.StreamResponse:
        ip = request.remote or ""
        mono = time.monotonic()
        if self._address_banned(ip, mono):
            self.node.refuse("peer", "banned")
            self.counters["refused_banned"] += 1
            return web.json_response({"error": "banned", "detail": "this address is ignored for a while"}, status=403)
        address, subnet = address_keys(ip, self._channel(ip))
        verdict = admit_slot(self._slots(), Slot(None, False, address, subnet, self._allowed(ip)), self.slot_limits)
        if not verdict.admit:  # an eviction waits until the handshake says who it is
            self._refused(verdict.reason)
            return web.json_response({"error": "busy", "reason": verdict.reason, "detail": "no peer slot for you"},
                                     status=503)
        # connections still in their handshake: at most max_peers in all and, except on
        # loopback (this host's nodes), PENDING_PER_IP per address
        per_ip = self._pending.get(ip, 0)
        if sum(self._pending.values()) >= self.settings.slots.max_peers or (
                per_ip >= PENDING_PER_IP and not is_loopback_ip(ip)):
            self._refused("pending")
            return web.json_response({"error": "busy", "reason": "pending", "detail": "too many handshakes in progress"},
                                     status=503)
        self._pending[ip] = per_ip + 1
        try:
            ws = web.WebSocketResponse(max_msg_size=self._wire_limit(), heartbeat=30, autoping=True)
            await ws.prepare(request)
            link = await self._handshake(ws, "responder", ip)
        finally:
            if self._pending[ip] <= 1:
                del self._pending[ip]
            else:
                self._pending[ip] -= 1
        if link is not None:
            await self._run_session(link)
        else:
            await ws.close()
        return ws

    async def dial(self, addr: str, expect_did: str | None = None, *, origin: D.Origin) -> Link | None:
        """Connect to a peer's `tcp://` address learnt from `origin`; the link, or None.

        The dial rule is checked here once more, at the socket: callers pass only
        vetted addresses, so `dial_off_rule` counts a path that forgot to (and the
        address is still not dialled)."""
        reason = D.check(addr, origin, self.dial_policy, schemes=("tcp",))
        if reason is not None:
            self.counters["dial_off_rule"] += 1
            self.node.refuse("dial", reason)
            return None
        scheme, host, port = parse_addr(addr)
        if self._client is None:
            return None
        self.counters["dial_attempts"] += 1
        url = f"http://{host}:{port}{PEER_PATH}"  # an IPv6 host keeps its brackets
        try:
            ws = await asyncio.wait_for(
                self._client.ws_connect(url, max_msg_size=self._wire_limit(), heartbeat=30, autoping=True),
                self.settings.dialing.timeout,
            )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            self.counters["dial_failed"] += 1
            return None
        link = await self._handshake(ws, "initiator", host.strip("[]"))
        if link is None:
            await ws.close()
            return None
        if expect_did is not None and link.did != expect_did:
            log.info("%s answered as %s, not %s", addr, link.did, expect_did)
        self._spawn(self._run_session(link))
        return link

    def _wire_limit(self) -> int:
        """The largest WebSocket message: the records of one frame of max_frame_bytes
        (19 bytes per record of at most MAX_FRAGMENT bytes: docs/protocol.md 21.3)."""
        size = self.settings.session.max_frame_bytes
        return size + 19 * max(1, -(-size // MAX_FRAGMENT))

    async def _handshake(self, ws, role: str, ip: str) -> Link | None:
        """The v2 handshake over `ws` (hmpnode.net.transport, docs/protocol.md 21.2), then
        the node's admission; the registered link, or None (the caller closes `ws`).

        Refusals before the handshake completes (a banned or fresh DID, no slot for the
        claimed identity) close the WebSocket with CLOSE_REFUSED and our reason code;
        after it completes they are an error frame inside the channel, then the close.
        The responder's first frame is empty when it admits the initiator: the initiator
        waits for it (or the refusal) before it counts itself connected."""
        s = self.settings
        gate = AnnounceGate(self.node.verifier(), min_difficulty=s.min_difficulty, now=self.node.now(),
                            max_age=timedelta(seconds=s.session.mce_max_age_seconds),
                            early=lambda did: self._refusal_for_claim(did, role, ip))
        payload = make_payload(self.identity, self._announce_bytes(), self._static.public, PROTOCOLS)
        hs = NoiseHandshake(role, self._static, PROLOGUE, payload, nacl.utils.random, verify_announce=gate,
                            own_did=self.identity.did, max_frame=s.session.max_frame_bytes)
        reader, units = UnitReader(), collections.deque()
        deadline = time.monotonic() + s.mesh.handshake_timeout

        async def receive() -> bytes | None:
            """The next binary message within the handshake's time; None when the peer
            closed (counted: refused with a reason, or failed)."""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            msg = await asyncio.wait_for(ws.receive(), remaining)
            if msg.type == aiohttp.WSMsgType.BINARY:
                return msg.data
            if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == CLOSE_REFUSED:
                reason = str(msg.extra or "")
                self.counters["handshake_refused"] += 1
                self.counters[f"handshake_refused_{reason if reason in M.ERROR_REASONS else 'other'}"] += 1
            else:
                self.counters["handshake_failed"] += 1
            return None

        transport = None
        try:
            while not hs.complete:
                if hs.my_turn():
                    await ws.send_bytes(hs.write_message())
                    continue
                while not units:
                    data = await receive()
                    if data is None:
                        return None
                    units.extend(reader.feed(data))
                hs.read_message(units.popleft())
            transport = hs.transport()
            # records sent right after the last handshake message, in the same WebSocket message
            backlog = transport.feed(b"".join(units) + reader.rest())
            if gate.skew is not None:  # the peer's announce says what its clock said
                self.skew.add(*gate.skew, jump=gate.clock_skew is not None)
            if gate.clock_skew is not None:
                # not an offence: the authenticated peer is told (inside the channel) and let go
                self.counters["handshake_clock_skew"] += 1
                self.node.refuse("peer", "clock_skew")
                await self._refuse_channel(ws, transport, "clock_skew", gate.clock_skew)
                return None
            if role == "initiator":
                while not backlog:  # the responder's verdict: the empty frame, or an error frame
                    data = await receive()
                    if data is None:
                        return None
                    backlog = transport.feed(data)
                reason = SE.refusal_of(backlog.pop(0))
                if reason is not None:
                    self.counters["handshake_refused"] += 1
                    # e.g. handshake_refused_clock_skew: the peer finds our clock off (or its own is)
                    self.counters[f"handshake_refused_{reason if reason in M.ERROR_REASONS else 'other'}"] += 1
                    return None
        except TransportError as exc:
            if exc.reason == "bad_announce" and gate.refusal is not None:
                # refused on the claimed DID, before any signature work
                self._refused(gate.refusal)
                with contextlib.suppress(Exception):
                    await ws.close(code=CLOSE_REFUSED, message=gate.refusal.encode())
                return None
            self.counters[f"handshake_{exc.reason}"] += 1
            self.node.refuse("peer_handshake", exc.reason)
            return None
        except (asyncio.TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError):
            self.counters["handshake_failed"] += 1
            return None
        peer = hs.peer
        assert peer is not None and gate.checked is not None
        check, result = gate.checked
        info = PeerInfo(peer.did, peer.public_key, check, result, peer.static_key, peer.versions)
        mono = time.monotonic()
        channel = self._channel(ip)
        if self.bans.banned(info.did, mono):
            self._refused("banned")
            await self._refuse_channel(ws, transport, "banned", _REFUSALS["banned"])
            return None
        address, subnet = address_keys(ip, channel)
        session = PeerSession(self.identity, info.did, ip, channel, peer_roles=info.announce.roles,
                              initiator=role == "initiator", limits=self._session_limits,
                              book=self.ledger.open(), counters=self.counters, relaying=self.core.relaying,
                              check=self._check_mce)
        link = Link(ws, info, session, mono, address=address, subnet=subnet,
                    pinned=info.did in self._pinned or self._allowed(ip), transport=transport, backlog=backlog)
        existing = self.sessions.get(info.did)
        if existing is not None and not existing.closed:
            # both dialled at once, or one side twice: both ends keep the same one (21.3)
            if not SE.keeps_new_connection(self.identity.did, info.did, new_is_ours=link.initiator,
                                           old_is_ours=existing.initiator, new_hash=transport.handshake_hash,
                                           old_hash=existing.transport.handshake_hash):
                self.counters["duplicate_connection"] += 1
                await self._refuse_channel(ws, transport, "duplicate_connection", "the other connection is kept")
                return None
        verdict = admit_slot(self._slots(but=info.did), self._slot(link), self.slot_limits)
        if not verdict.admit:
            self._refused(verdict.reason)
            await self._refuse_channel(ws, transport, verdict.reason, "no peer slot for you")
            return None
        if verdict.evict is not None:
            victim = self.sessions.get(verdict.evict.key)
            if victim is not None:
                self._refused("evicted")
                log.info("peer %s (%s) evicted for %s (%s)", victim.did, victim.ip, info.did, ip)
                victim.closed = True
                self._spawn(self._disconnect(victim, "evicted", "a peer slot was needed"))
        if existing is not None:
            # its unanswered requests go now, not when its close completes: the new
            # connection's first offer (a relay's, 24.2, made once) must find them released
            self.ledger.close(existing.session.book)
            if not existing.closed:
                existing.closed = True
                self._spawn(existing.ws.close())
        self.sessions[info.did] = link
        self.counters["connected"] += 1
        if role == "responder":  # admitted: the empty frame tells the initiator (a failed send closes it)
            link.session.admitted()
            await link.flush()
        if channel is Channel.LOOPBACK:
            self._local_dids[info.did] = self._local_dids.pop(info.did, mono)
            if len(self._local_dids) > 4096:
                self._local_dids.popitem(last=False)
        await peers.remember(self, info.announce, info.verify_result.container, "inbound" if role == "responder" else "dial",
                             D.peer_origin(ip, self._interfaces()), contact=True)
        return link

    async def _refuse_channel(self, ws, transport, reason: str, detail: str) -> None:
        """Refuse an authenticated peer: an error frame inside the channel, then the close."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.send_bytes(transport.encrypt(M.error_frame(reason, detail))), 2.0)
        await _close_quietly(ws)

    async def _run_session(self, link: Link) -> None:
        """Read frames until the connection ends; sync first. Each frame goes to the
        session, each event it emits to its handler (`_handle`)."""
        session = link.session
        try:
            self._send_interests(link)  # before sync: the peer filters what it pushes by them (33.2)
            if session.initiator:  # the dialer reconciles: it pushes what the peer lacks, asks what it lacks
                await drive.run(self.core.start_sync(link), self.world)
            await self._offer_held(link)
            self.core.outbox_arrived.add(link.did)
            self._wake_outbox.set()
            async for data in self._frames(link):
                await drive.run(self.core.frame(link, data), self.world)
                if session.closed:  # cut off, clock skew
                    break
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("peer session %s failed", link.did)
        finally:
            link.closed = True
            self.ledger.close(session.book)
            if self.sessions.get(link.did) is link:
                del self.sessions[link.did]
                self.counters["disconnected"] += 1
                now_us = self.node.now_us()
                with contextlib.suppress(Exception):
                    await self.node.db.write(lambda conn: ms.touch_peer(conn, link.did, now_us))
                self._wake_connect.set()
            with contextlib.suppress(Exception):
                await link.ws.close()

    async def _frames(self, link: Link):
        """The link's frames: the decrypted records of its binary WebSocket messages
        (split anyhow). Ends with the connection, or at the first record that fails:
        tampered, replayed, reordered, injected, truncated (docs/protocol.md 21.3).
        Such a failure is counted (refused{peer, reason}) but earns no strike: a man in
        the middle can cause it. A frame over the limit inside the channel does."""
        while link.backlog and not link.closed:
            yield link.backlog.pop(0)
        while not link.closed:
            msg = await link.ws.receive()
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.ERROR):
                if msg.type == aiohttp.WSMsgType.ERROR and "size" in str(msg.data).lower():
                    self._bad_record(link, "frame_too_large")  # unauthenticated: no strike
                return
            if msg.type != aiohttp.WSMsgType.BINARY:
                self._bad_record(link, "text_message")
                return
            try:
                frames = link.transport.feed(msg.data)
            except TransportError as exc:
                if link.session.record_failed(exc.reason, time.monotonic()):  # a Refused: cut off
                    self._cut_off(link)
                self._bad_record(link, exc.reason)
                return
            for frame in frames:
                yield frame

    def _bad_record(self, link: Link, reason: str) -> None:
        """A link's record stream failed: count it and end the session (nothing is
        sent: the channel can no longer be trusted)."""
        link.closed = True
        self.counters[f"record_{reason}"] += 1
        self.node.refuse("peer", reason)
        log.info("peer %s (%s): session ended: %s", link.did, link.ip, reason)

    def _cut_off(self, link: Link) -> None:
        """Ban a peer that crossed its strike threshold: its DID, and its address except on
        loopback, where every node of this host shares 127.0.0.1: only the DID is banned
        there, and for as long, this host may bring no DID that had no connection before."""
        mono = time.monotonic()
        keys = [link.did]
        if link.channel is Channel.LOOPBACK:
            self._loopback_locked = (mono + self.settings.mesh.ban_seconds, mono)
        elif not self._allowed(link.ip):
            keys.append(ban_key(link.address, link.subnet))
        self._ban(keys)
        self.counters["banned"] += 1
        log.warning("peer %s (%s) cut off: %s", link.did, link.ip, dict(link.session.strikes.by_reason))

    async def _clock_skew(self, link: Link, event: SE.ClockSkew) -> None:
        """A signed message of the peer dated outside our window: its clock or ours is off.
        Not an offence (no strikes, never a ban: docs/protocol.md 25.4): the session said so,
        with the offset, and ended; handshakes are refused as clock_skew until a clock is
        fixed, then the peers connect again."""
        self.skew.add(link.did, event.offset, jump=True)
        self.counters["clock_skew_closed"] += 1
        self.node.refuse("peer", "clock_skew")
        log.warning("peer %s: clock off by %+.0f s; connection closed", link.did, event.offset)
        self.dials.defer(link.did, time.monotonic() + 10.0)  # not straight back: the clock is still off

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
            self._cut_off(link)

    # -- events of a session ---------------------------------------------------------------------

    async def _drive(self, link: Link, events: list[SE.SessionEvent]) -> None:
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
            SE.IndexRequested: self._on_index_requested, SE.IndexEntries: self._on_index_entries,
            SE.IndexDone: self._on_index_done,
        }

    async def _on_peer_error(self, link: Link, event: SE.PeerError) -> None:
        log.debug("peer %s reports %.64r: %.200r", link.did, event.reason, event.detail)

    async def _on_clock_sample(self, link: Link, event: SE.ClockSample) -> None:
        self.skew.add(link.did, event.offset)

    def _charger(self, link: Link):
        """What charges verification CPU seconds to `link`'s budget (into debt)."""
        def charge(seconds: float) -> None:
            link.session.charge_cpu(time.monotonic(), seconds)
        return charge

    def _mce_limits(self):
        """The verifier limits of MCE messages: a compressed payload expands to at most
        one frame's size (peer.max_frame_bytes), never to the 16 MiB of a container."""
        limits = self.node.limits
        if limits.max_decompressed_bytes <= self.settings.session.max_frame_bytes:
            return limits
        return dataclasses.replace(limits, max_decompressed_bytes=self.settings.session.max_frame_bytes)

    def _check_mce(self, container: dict[str, Any], **checked: Any) -> M.Mce:
        """The sessions' MceChecker (on a verify thread): the node's registry and MCE limits."""
        return M.check_mce(self.node.verifier(self._mce_limits()), container, **checked)

    async def _on_blocks(self, link: Link, event: SE.BlocksReceived) -> None:
        for did, block in event.items:
            if await self.node.take_blocks(did, **{event.kind: block}):
                DL.changed(self, did, link.did)  # new evaluations: `modified` to the others (32)

    async def _offer_held(self, link: Link, *, again: bool = False) -> None:
        await drive.run(self.core.offer_held(link, again=again), self.world)

    def evaluated(self, did: str) -> None:
        """Our agent evaluated `did` (or took another agent's evaluation of it): a `modified`
        entry to the peers allowed to hold it, who ask for the block (spec 5.6, 32)."""
        DL.changed(self, did)

    def revoked(self, revocations: list[tuple[str, datetime]]) -> None:
        """Keys just revoked: their held containers signed later are removed (32)."""
        self._spawn(DL.revocations(self, revocations))

    # -- maintenance (the node-wide loops: gossip, outbox, peers, provide) -------------------------------------------------------------------------------------

    async def _maintenance_loop(self) -> None:
        """Drop relay holdings past their ttl; re-announce when our mailmen changed."""
        mailman = self._mailman()
        while True:
            await asyncio.sleep(1.0)
            try:
                mailman = await self._maintain(mailman)
            except Exception:
                log.exception("mesh maintenance failed")

    async def _maintain(self, mailman: list[str]) -> list[str]:
        mono = time.monotonic()
        if self._wake_prune or mono - self._pruned_at > 10.0:  # expiry of peers that never answered
            self._wake_prune, self._pruned_at = False, mono
            await peers.prune(self)
        idle = mono - self.settings.mesh.sync_idle_seconds
        for link in list(self.sessions.values()):  # answered reconciliations left idle hold a snapshot
            link.session.expire_reconciliations(idle)
        await self._timers(mono)
        if self.core.relaying:
            await drive.run(self.core.expire_holdings(), self.world)
        current = self._mailman()
        if current != mailman:
            if self.lan is not None:
                await self.lan.announce_now()
            if self.dht is not None:
                self._spawn(provide.dht_publish(self))
        return current

    async def _timers(self, mono: float) -> None:
        """The sessions' deadlines (requests not answered, a relay's re-offer), each session
        on its own: one that fails is logged, the others go on."""
        for link, events in self.core.due_timers(mono):
            try:
                await self._drive(link, events)
            except Exception:
                log.exception("peer %s: timer failed", link.did)

    # the container index on request (spec 12.9; docs/protocol.md 31) ---------------------------

    async def _on_index_requested(self, link: Link, event: SE.IndexRequested) -> None:
        """Answer a peer's index request (`read_index_page`), or count its refusal. The
        read's CPU time is charged to the peer's verification budget, as its frames'
        checks are: a peer asking for costly pages has its next frames wait."""
        if event.refusal is not None or event.query is None:
            self.node.refuse("index", event.refusal or "declined")
            return
        session, query = link.session, event.query
        now = self.node.now()

        def read(conn):
            started = time.thread_time()
            return read_index_page(conn, session, query, now, lambda row: DL.is_revoked(self, row)), \
                time.thread_time() - started

        page, cpu = await self.node.db.read(read)
        session.charge_cpu(time.monotonic(), cpu)
        session.answer_index(event.request, page, now, ignored=query.ignored)

    @functools.cached_property
    def _index_waits(self) -> dict[tuple[str, str], IndexAnswer]:
        """(peer DID, request DID) -> the answer being collected for `query_index`."""
        return {}

    async def _on_index_entries(self, link: Link, event: SE.IndexEntries) -> None:
        wait = self._index_waits.get((link.did, event.request))
        if wait is not None:
            wait.entries.update(event.entries)

    async def _on_index_done(self, link: Link, event: SE.IndexDone) -> None:
        wait = self._index_waits.get((link.did, event.request))
        if wait is not None and not wait.done.done():
            if wait.status != "processed":  # a later page declined keeps the pages answered before
                wait.status = event.status
            wait.complete, wait.cursor, wait.reason = event.complete, event.cursor, event.reason
            wait.done.set_result(None)

    async def query_index(self, selections: Sequence[dict[str, Any]], *, timeout: float | None = None,
                          limit: int | None = None, to: Sequence[str] | None = None,
                          after: str | None = None, pages: int = 1) -> list[IndexAnswer]:
        """Ask at most index_query_peers connected peers (those of `to` only, when given)
        for the index entries that match `selections`, from cursor `after`, following each
        peer's cursor for up to `pages` pages, and wait at most `timeout` in all
        (index_query_seconds): one IndexAnswer per peer asked, `status` None when it did not
        answer in time (what came meanwhile is kept, `complete` false)."""
        links = [link for link in self.sessions.values() if not link.closed and (to is None or link.did in to)]
        links = links[:self.settings.mesh.index_query_peers]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.settings.mesh.index_query_seconds if timeout is None else max(timeout, 0))
        pending: dict[asyncio.Future, tuple[Link, IndexAnswer, tuple[str, str]]] = {}

        async def ask(link: Link, answer: IndexAnswer, cursor: str | None) -> None:
            request = link.session.ask_index(selections, self.node.now(), limit=limit, after=cursor,
                                             nonce=nacl.utils.random(8).hex())
            answer.done, answer.pages = loop.create_future(), answer.pages + 1
            self._index_waits[(link.did, request)] = answer
            pending[answer.done] = (link, answer, (link.did, request))
            await link.flush()

        answers = []
        for link in links:
            answers.append(IndexAnswer(link.did, loop.create_future()))
            await ask(link, answers[-1], after)
        try:
            while pending and loop.time() < deadline:
                done, _ = await asyncio.wait(list(pending), timeout=deadline - loop.time(),
                                             return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    link, answer, key = pending.pop(future)
                    self._index_waits.pop(key, None)
                    if (answer.status == "processed" and not answer.complete and answer.cursor
                            and answer.pages < pages and not link.closed):
                        await ask(link, answer, answer.cursor)  # the next page (its status stays meanwhile)
        finally:
            for future, (_, _, key) in pending.items():
                self._index_waits.pop(key, None)
                future.cancel()
        self.counters["index_queries"] += 1
        return answers

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.node.loop

    # -- interests (hmpnode.net.interests; docs/protocol.md 33) ---------------------------------------

    @property
    def interest_limits(self) -> InterestLimits:
        return InterestLimits(max_entries=self.settings.session.max_interest_entries)

    @property
    def interests_file(self) -> Path:
        return self.node.data_dir / "interests.json"

    def _load_interests(self) -> Interests:
        """The declaration the API saved (it outlives a restart), else [interests]. A file
        that cannot be read is logged and [interests] used (never a node that cannot start)."""
        try:
            data = self.interests_file.read_bytes()
        except FileNotFoundError:
            return self.settings.declared
        try:
            saved = Interests.parse(orjson.loads(data), self.interest_limits)
            self.interests_from = "api"
            return saved
        except (orjson.JSONDecodeError, InterestError, OSError) as exc:
            log.error("%s: %s; using [interests]", self.interests_file, exc)
            return self.settings.declared

    def _send_interests(self, link: Link) -> None:
        """Our declaration to one peer (queued); nothing when we declare nothing, so that
        peers that predate peer_query never see one (33.2)."""
        if self.interests.declared:
            link.session.send_interests(self.interests, self.settings.roles, self.node.now())

    async def set_interests(self, new: Interests | None) -> Interests:
        """The agent declares `new` (None: back to [interests]): saved, announced to every
        peer (then a reconciliation brings what it now wants and lacks), the DHT topic
        records follow the topics, and peers following a new topic are looked up and dialled.
        ChangedTooOften when changed faster than `interest_changes` allows; OSError when
        it cannot be saved (nothing changed then)."""
        if not self.interest_changes.take(time.monotonic()):
            raise ChangedTooOften("interests changed too often; at most "
                                  f"{self.settings.session.peer_queries_per_minute / 2:g} per minute")
        async with self._interests_lock:  # one change at a time: each is announced after the one before
            return await self._set_interests(new)

    async def _set_interests(self, new: Interests | None) -> Interests:
        old = self.interests
        if new is None:
            await asyncio.to_thread(self.interests_file.unlink, missing_ok=True)
            new = self.settings.declared
        else:
            from hmpnode.fsutil import write_private_file

            await asyncio.to_thread(write_private_file, self.interests_file, new.to_json(), replace=True)
        self.interests = new
        self.interests_from = "config" if new is self.settings.declared else "api"
        self.counters["interests_changed"] += 1
        for link in list(self.sessions.values()):
            if link.closed:
                continue
            if new.declared or old.declared:  # a peer told of a declaration is told it ended
                link.session.send_interests(new, self.settings.roles, self.node.now())
            if link.session.recon_out:  # one in progress: it goes on; what it misses comes next connection
                await link.flush()
            else:
                await drive.run(self.core.start_sync(link), self.world)
        started, stopped = topic_changes(old, new, self.settings.interests)
        if self.dht is not None:
            for topic in stopped:
                self.dht.leave_topic(topic)
            for topic in started:
                self._spawn(self.follow_topic(topic, announce=True))
        return new

    async def follow_topic(self, topic: str, *, announce: bool) -> None:
        """Announce that we follow `topic` (unless done already) and dial a few of the
        agents that follow it too (interests.topic_dials), so that they find each other."""
        try:
            if announce:
                await self.dht.announce_topic(topic)
            found = [d for d in await self.dht.find_topic(topic) if d != self.identity.did and d not in self.sessions]
        except Exception:
            log.exception("DHT topic %r failed", topic)
            return
        self.counters["topic_peers_found"] += len(found)
        for did in found[:self.settings.dialing.topic_dials]:
            await peers.reach(self, did)


def read_index_page(conn, session: PeerSession, query: IX.IndexQuery, now: datetime,
                    revoked: Callable[[db.StoredContainer], bool] = lambda row: False) -> IX.Page:
    """One answer to `session`'s peer out of the store (on its read thread): at most
    index_scan rows after the cursor (narrowed in SQL by a single selection), read in
    chunks of about a page (loading a row's body is most of the cost: a full page stops
    the reading), of which those that match and that the peer may be sent (`may_receive`,
    as gossip, and not `revoked`: what is not served is not listed either, 32) make the page."""
    limit, now_us, prefilter = session.index_limit(query), db.to_us(now), query.prefilter()
    chunk = max(limit, 100)
    read = {"left": session.limits.index_scan, "ended": False}

    def rows():
        after = query.after
        while read["left"] > 0:
            want = min(read["left"], chunk)
            got = db.list_containers(conn, db.ListQuery(**prefilter, after_seq=after, limit=want), now_us)
            read["left"] -= len(got)
            yield from got
            if len(got) < want:
                read["ended"] = True
                return
            after = got[-1].seq

    return IX.page(rows(), query,
                   eligible=lambda row: session.may_receive(row.hmp_container["head"], now) and not revoked(row),
                   entry=lambda row: IX.entry_of(row.hmp_container, db.backlinks_of(conn, row.did),
                                                 db.evaluations_of(conn, row.did)),
                   limit=limit, max_bytes=session.limits.max_frame_bytes // 2, more=lambda: not read["ended"])


@dataclass(eq=False)
class IndexAnswer:
    """One peer's answer to `Mesh.query_index`: its entries, and how it closed the answer
    (`status` processed/declined/unknown, None: no answer in time; `complete`: the end
    of what matched was reached)."""

    peer: str
    done: asyncio.Future
    entries: dict[str, Any] = field(default_factory=dict)
    status: str | None = None
    complete: bool = False
    cursor: str | None = None
    reason: str | None = None
    #: requests made for it (one per page)
    pages: int = 0


async def _close_quietly(ws) -> None:
    with contextlib.suppress(Exception):
        await ws.close()


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

    async def reach(self, did: str) -> Link | None:
        return await peers.reach(self.mesh, did)

    async def find_peer(self, did: str):
        return None if self.mesh.dht is None else await self.mesh.dht.find_peer(did)

    async def sets(self):
        return await self.mesh.snapshots.current()

    def spawn(self, steps) -> None:
        self.mesh._spawn(drive.run(steps, self))

    async def cut_off(self, link: Link) -> None:
        self.mesh._cut_off(link)
        await link.flush()
        link.closed = True
        await link.ws.close()

    async def unhandled(self, link: Link, event) -> None:
        await self.mesh._unhandled(link, event)
