"""The mesh: peer connections, container exchange, gossip, relay and outbox.

The adapter around the sans-IO pieces: it listens on the node's peer port
(aiohttp, WebSocket at `PEER_PATH`), dials peers found by LAN discovery, the DHT
or the peers table, and moves containers between the node's store and its peers.

Who does what: `transport` (with `peerauth`) turns WebSocket bytes into a peer's
plaintext frames and back; `session.PeerSession` is one peer's protocol state and
makes every per-connection decision (what a frame means and earns, budgets,
strikes, acks, which containers to send and how to batch them, reconciliation
steps), emitting events; this module (`Link` per connection) runs the handshake
and admission, feeds frames to the session, answers its events from the store
(`_handle`), sends what it queued, runs CPU work on the verify threads, and keeps
the node-wide policy: slots, bans, dialing, the ledger, sync snapshots, the
forward loop (`session.plan_forward` picks the peers), the outbox, relay holding
and quotas, the DHT.

Every peer connection is a v2 session (`hmp-peer/2`, docs/protocol.md 21): a
Noise XX handshake bound to both identities, then every frame travels as AEAD
records in binary WebSocket messages. There is no cleartext (v1) peer path.

- Every container a node stores (from its agent or a peer) is offered onward
  by the forward loop: a `broadcast` one is pushed to `fanout` random eligible
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
- The agent's directed containers wait in the durable outbox until a
  recipient, or a relay holding them for it, acknowledges them; retries back
  off exponentially; expired ones are dropped.
- With the `relay`/`mailman` role, containers for other recipients are held
  (`relay_queue`) and handed over when the recipient connects and asks;
  deleted after its `container_ack` or at their `ttl`.
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import aiohttp
import nacl.utils
import orjson
from aiohttp import web

from hmpnode.config import KNOWN_ROLES
from hmpnode.container.build import build_container
from hmpnode.container.encoding import format_time, parse_time
from hmpnode.container.evaluations import evaluations_block
from hmpnode.container.payload import recipients_of
from hmpnode.net import dialing as D
from hmpnode.net import ledger
from hmpnode.net import mce as M
from hmpnode.net import syncset as SY
from hmpnode.net.announce import ANNOUNCE_CLASS, DEFAULT_MIN_DIFFICULTY, AnnounceCheck, make_address_record, parse_addr
from hmpnode.net.announce import outward_first
from hmpnode.net.peerauth import AnnounceGate, PeerInfo
from hmpnode.net.penalty import BanList, DidChurn, TokenBucket
from hmpnode.net.relay import append_relay, verify_relay_chain
from hmpnode.net import session as SE
from hmpnode.net.session import PeerSession, SessionLimits, SyncRefusal
from hmpnode.net.relayquota import RelayLimits, RelayUsage, admit, hold_until_us
from hmpnode.net.skew import SkewEstimates
from hmpnode.net.scope import FORWARDING_ROLES, Channel, host_key, is_loopback_ip, parse_ip
from hmpnode.net.slots import Slot, SlotLimits, address_keys, ban_key
from hmpnode.net.slots import admit as admit_slot
from hmpnode.net.slots import score as slot_score
from hmpnode.net.slots import usage as slot_usage
from hmpnode.net.transport import MAX_FRAGMENT, PROLOGUE, PROTOCOL, KeyPair, NoiseHandshake, TransportError, UnitReader
from hmpnode.net.transport import make_payload
from hmpnode.serving import DEFAULT_IDLE_CONNECTION_SECONDS, server_options
from hmpnode.store import StorageFull
from hmpnode.store.forget import forgotten_of
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

__all__ = ["Mesh", "MeshSettings", "PEER_PATH", "ANNOUNCE_PATH"]

log = logging.getLogger("hmpnode.mesh")

#: the peer protocol's WebSocket path: a later version gets its own path next to it
PEER_PATH = "/hmp/v2/peer"
#: peer protocols this node speaks (its announce lists them; it dials peers that list one)
PROTOCOLS = (PROTOCOL,)
#: WebSocket close code of a refusal before the handshake completed (reason: our code)
CLOSE_REFUSED = 4403
ANNOUNCE_PATH = "/hmp/v1/announce"
#: details of the refusals sent in error frames (reason -> detail)
_REFUSALS = {"banned": "this node is ignored for a while", "fresh_did": "no new DIDs from this host for a while"}
#: inbound handshakes in progress from one (non-loopback) address
PENDING_PER_IP = 4


@dataclass(frozen=True, slots=True)
class MeshSettings:
    host: str = "127.0.0.1"
    port: int = 0
    roles: tuple[str, ...] = ()
    name: str = ""
    interests: tuple[str, ...] = ()
    #: DIDs of relays that hold containers for this agent, besides connected relays
    mailman: tuple[str, ...] = ()
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY
    #: connections the node opens by itself; it accepts up to max_peers in all
    target_peers: int = 8
    max_peers: int = 64
    #: peers a broadcast container is pushed to (the others get an announcement)
    fanout: int = 4
    max_frame_bytes: int = 4 * 1024 * 1024
    max_items_per_frame: int = 512
    max_requested: int = 20_000
    #: who-has-what entries (hmpnode.net.ledger) one connection may fill, and all of them together
    ledger_session_entries: int = 20_000
    ledger_max_entries: int = 400_000
    idle_connection_seconds: float = DEFAULT_IDLE_CONNECTION_SECONDS
    frames_per_second: float = 200.0
    frame_burst: float = 1000.0
    containers_per_second: float = 2000.0
    container_burst: float = 20000.0
    strike_threshold: int = 50
    ban_seconds: float = 600.0
    # peer slots (hmpnode.net.slots; docs/protocol.md section 21.4)
    max_per_address: int = 8
    max_per_subnet: int = 16
    max_loopback_peers: int = 32
    #: connections the node keeps open by itself whatever its inbound ones (at most target_peers)
    min_outbound: int = 4
    #: DIDs that always get a slot and are never evicted; CIDRs whose peers are treated alike
    pinned: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    #: distinct DIDs one (non-loopback) address may present within did_window_seconds before it is banned
    max_dids_per_address: int = 16
    did_window_seconds: float = 600.0
    handshake_timeout: float = 10.0
    dial_timeout: float = 5.0
    mce_max_age_seconds: int = 600
    #: containers scanned per delta answer
    delta_page: int = 2000
    ack_timeout: float = 30.0
    retry_base: float = 1.0
    retry_max: float = 300.0
    relay_max_per_recipient: int = 100_000
    relay_max_bytes_per_recipient: int = 256 * 1024 * 1024
    relay_max_total_bytes: int = 2 * 1024 * 1024 * 1024
    relay_max_per_sender: int = 100_000
    relay_max_bytes_per_sender: int = 256 * 1024 * 1024
    relay_max_bytes_per_address: int = 512 * 1024 * 1024
    relay_max_unknown_bytes: int = 32 * 1024 * 1024
    relay_max_hold_seconds: int = 7 * 86_400
    # ingest budgets (issue 10): what one peer may make this node decompress and verify
    #: decompressed bytes of all containers of one `containers` frame (over: over_budget)
    max_frame_decompressed_bytes: int = 32 * 1024 * 1024
    #: verification CPU seconds per second one peer may use (its frames wait beyond), and its burst
    verify_seconds_per_second: float = 0.5
    verify_burst_seconds: float = 2.0
    #: frames larger than this are parsed on a verify thread, not on the event loop
    offload_frame_bytes: int = 64 * 1024
    # discovery
    lan: bool = True
    lan_port: int = 47474
    lan_group: str = "239.255.74.77"
    lan_mode: str = "both"
    lan_interval: float = 5.0
    lan_interfaces: tuple[str, ...] = ()
    dht: bool = True
    dht_port: int = 0
    bootstrap: tuple[tuple[str, int], ...] = ()
    # DHT store (hmpnode.net.dhtrecords.StoreLimits, RecordLimits.max_skew)
    dht_max_records: int = 8192
    dht_max_records_per_ip: int = 512
    dht_max_records_per_subnet: int = 1024
    dht_hold_seconds: float = 7200.0
    dht_max_skew_seconds: float = 120.0
    dht_max_provided: int = 1024
    dht_provides_per_second: float = 2.0
    # dialing and the peers table (hmpnode.net.dialing; docs/protocol.md 20.6)
    #: a non-LAN source (handshake, DHT) may name loopback/private/link-local addresses
    dial_private: bool = False
    #: CIDRs a non-LAN source may name although they are not globally routable
    dial_allow: tuple[str, ...] = ()
    #: host names may be dialled (never those from a LAN announce)
    dial_hostnames: bool = False
    #: node-wide connection attempts per second, and how many may be saved up
    dials_per_second: float = 2.0
    dial_burst: float = 16.0
    #: per-peer wait after a failed dial round: base * 2**(failures-1), capped
    dial_backoff_base: float = 5.0
    dial_backoff_max: float = 900.0
    #: a peer that never answered is forgotten after this many failed rounds in a row
    dial_give_up_after: int = 5
    #: rows of the peers table (memory and store)
    peers_max: int = 1000
    #: a peer never connected to is forgotten when not heard of for this long
    peer_unanswered_max_age: float = 86_400.0
    # catch-up by reconciliation (hmpnode.net.syncset; docs/protocol.md 22.4)
    #: reconciliations one peer may start per minute (each costs a snapshot lookup and CPU)
    sync_per_minute: float = 6.0
    #: a stale node-wide snapshot is rebuilt only when at least this old (one rebuild of
    #: 100 000 items costs ~0.5 s of CPU; what arrives meanwhile travels by gossip)
    sync_snapshot_seconds: float = 5.0
    #: a responder's reconciliation left unanswered this long is dropped
    sync_idle_seconds: float = 60.0


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
        self.sessions: dict[str, Link] = {}
        self.peers: dict[str, ms.PeerRow] = {}
        self.counters: Counter[str] = Counter()
        #: the node-wide reconciliation sets (syncset.SyncState), rebuilt lazily
        self._sync: SY.SyncState | None = None
        self._sync_lock = asyncio.Lock()
        self.bans = BanList(settings.ban_seconds)
        self.slot_limits = SlotLimits(
            max_peers=settings.max_peers, outbound_slots=min(settings.target_peers, settings.max_peers // 2),
            max_per_address=settings.max_per_address, max_per_subnet=settings.max_per_subnet,
            max_loopback=settings.max_loopback_peers)
        self.churn = DidChurn(settings.max_dids_per_address, settings.did_window_seconds)
        self.ledger = ledger.Ledger(settings.ledger_max_entries, settings.ledger_session_entries)
        self._session_limits = SessionLimits.of(settings)
        #: this node holds containers for others (relay/mailman role)
        self._relays = bool(FORWARDING_ROLES.intersection(settings.roles))
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
        self.dial_policy = D.DialPolicy(private=settings.dial_private, hostnames=settings.dial_hostnames,
                                        allow=D.parse_cidrs(settings.dial_allow))
        self.dials = D.DialBudget(settings.dials_per_second, settings.dial_burst, base=settings.dial_backoff_base,
                                  cap=settings.dial_backoff_max, max_tracked=max(64, 8 * settings.peers_max),
                                  rng=random.Random(nacl.utils.random(16)))
        self._ifaces: tuple[float, list[Any]] = (-1e9, [])
        self._inflight = self.ledger.inflight  # digests, at most a quarter of peer.ledger_session_entries
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
        self._rng = random.Random(nacl.utils.random(16))
        #: each peer's clock offset, from what it signs (status, metrics)
        self.skew = SkewEstimates()
        s = settings
        self._relay_limits = RelayLimits(
            s.relay_max_per_recipient, s.relay_max_bytes_per_recipient, s.relay_max_total_bytes, s.relay_max_per_sender,
            s.relay_max_bytes_per_sender, s.relay_max_bytes_per_address, s.relay_max_unknown_bytes,
            s.relay_max_hold_seconds)
        #: (sending peer, container DID) -> (sender address key, recipients to hold it for, unknown
        #: ones, size charged): admitted by `_accepts`, read by the store hook in the ingest transaction
        self._relay_pending: dict[tuple[str, str], tuple[str, tuple[str, ...], frozenset[str], int]] = {}
        node.store_hooks.append(self._store_hook)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        app = web.Application(client_max_size=s.max_frame_bytes)
        app.router.add_get(PEER_PATH, self._accept)
        app.router.add_get(ANNOUNCE_PATH, self._serve_announce)
        # on stop, connection handlers still running after 1 s are cancelled (they only read frames)
        self._runner = web.AppRunner(app, **server_options(s.idle_connection_seconds), access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=s.dial_timeout))
        for row in await self.node.db.read(ms.load_peers):
            self.peers[row.did] = row
        await self._prune()  # a table written before it was bounded, or under a larger cap
        now_us, mono = self.node.now_us(), time.monotonic()
        for key, until_us in await self.node.db.write(lambda conn: ms.load_bans(conn, now_us)):
            # bans outlive a restart, but never run longer than a ban does: one written by a
            # clock that was ahead would otherwise last as long as that clock was off
            self.bans.ban(key, mono, min((until_us - now_us) / 1e6, s.ban_seconds))
        if FORWARDING_ROLES.intersection(s.roles):
            clamp_us = now_us + s.relay_max_hold_seconds * 1_000_000
            await self.node.db.write(lambda conn: ms.relay_clamp(conn, clamp_us))
        if s.dht:
            from hmpnode.net.dht import Dht

            self.dht = Dht(self.identity, host=_ip_literal(s.host), port=s.dht_port,
                           min_difficulty=s.min_difficulty, clock=self.node.clock, limits=_dht_limits(s),
                           on_refuse=lambda reason: self.node.refuse("dht", reason))
            await self.dht.start(list(s.bootstrap))
            self.dht_port = self.dht.port
            self._dht_on_loopback = is_loopback_ip(_ip_literal(s.host))
        self.addresses = self._own_addresses()
        if s.lan:
            from hmpnode.net.lan import LanDiscovery, LanSettings

            lan_settings = LanSettings(port=s.lan_port, group=s.lan_group, mode=s.lan_mode, interval=s.lan_interval,
                                       min_difficulty=s.min_difficulty, interfaces=s.lan_interfaces or None)
            self.lan = LanDiscovery(
                lan_settings, own_did=self.identity.did, announce=self._announce_bytes, on_peer=self._on_lan_peer,
                verifier=self.node.verifier(), clock=self.node.clock,
                on_refuse=lambda reason: self.node.refuse("lan", reason),
            )
            await self.lan.start()
        for coro in (self._forward_loop(), self._outbox_loop(), self._connect_loop(), self._maintenance_loop(),
                     self._sync_state()):  # the reconciliation snapshot, built before the first peer needs it
            self._spawn(coro)
        if self.dht is not None:
            self._spawn(self._dht_loop())
            self._spawn(self._provide_loop())

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
        relays = [s.did for s in self.sessions.values() if FORWARDING_ROLES.intersection(s.roles)]
        return list(dict.fromkeys([*self.settings.mailman, *sorted(relays)[:3]]))

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

    async def _remember(self, check: AnnounceCheck, announce: dict[str, Any] | None, source: str,
                        origin: D.Origin, contact: bool = False) -> None:
        """Keep what an announce says of a peer, with only the addresses the dial
        rule allows for `origin` (where it was learnt); the table stays within
        `peers_max` (dialing.peers_to_drop)."""
        if check.did is None or check.did == self.identity.did:
            return
        now_us = self.node.now_us()
        announced_us = db.to_us(check.timestamp) if check.timestamp else 0
        old = self.peers.get(check.did)
        if old is not None and old.announced_us > announced_us:
            return
        raw = list(check.addresses)
        # refusals are counted when an announce says something new, not on every repeat
        addresses = self._vet(raw, origin, count=raw != self._raw_addresses.get(check.did))
        if not set(PROTOCOLS).intersection(check.protocols):  # its peer port speaks nothing we do
            if raw != self._raw_addresses.get(check.did) and any(a.startswith("tcp://") for a in addresses):
                self.node.refuse("dial", "no_common_protocol")
            addresses = [a for a in addresses if not a.startswith("tcp://")]
        if old is not None and addresses != old.addresses:
            self.dials.reset(check.did)  # new addresses: old failures say nothing about them
        row = ms.PeerRow(check.did, orjson.dumps(announce) if announce else None, addresses, list(check.roles),
                         list(check.mailman), announced_us, old.source if old else source, now_us,
                         now_us if contact else None)
        if old is not None and old.last_contact_us and not contact:
            row.last_contact_us = old.last_contact_us
        dropped: list[str] = []
        if old is None and len(self.peers) >= self.settings.peers_max:
            # a few at once, so that a flood of new DIDs does not sort the table for each one
            dropped = self._drop_peers(self.settings.peers_max - max(1, self.settings.peers_max // 64), keep={check.did})
            if len(self.peers) >= self.settings.peers_max:
                self.node.refuse("dial", "peers_full")  # every row is a connected or configured peer
                return
        self.peers[check.did] = row
        self._raw_addresses[check.did] = raw
        self._origins[check.did] = origin
        if contact:
            self.dials.succeeded(check.did)
        # A peer re-announces every few seconds: the store is written when what it
        # says changed, on contact, or once a minute (last seen), not every time.
        same = old is not None and (old.addresses, old.roles, old.mailman) == (row.addresses, row.roles, row.mailman)
        if same and not contact and not dropped and now_us - self._persisted.get(check.did, 0) < 60_000_000:
            return
        self._persisted[check.did] = now_us

        def write(conn):
            ms.delete_peers(conn, dropped)
            ms.upsert_peer(conn, row)

        await self.node.db.write(write)
        if not same and addresses:
            self._wake_connect.set()

    def _drop_peers(self, cap: int, keep: Iterable[str] = ()) -> list[str]:
        """Take expired and surplus peers out of the in-memory table (dialing.peers_to_drop);
        the DIDs dropped, for the caller to delete from the store."""
        s = self.settings
        protected = {*self.sessions, *self._dialing, *s.mailman, *keep}
        facts = (D.PeerFacts(r.did, r.last_seen_us, r.last_contact_us) for r in self.peers.values())
        expired, evicted = D.peers_to_drop(
            facts, cap=cap, now_us=self.node.now_us(), max_unanswered_age_us=int(s.peer_unanswered_max_age * 1e6),
            give_up_after=s.dial_give_up_after, failures=self.dials.failures, keep=protected)
        for did in expired + evicted:
            self.peers.pop(did, None)
            self._persisted.pop(did, None)
            self._raw_addresses.pop(did, None)
            self._origins.pop(did, None)
        if expired:
            self.counters["peers_expired"] += len(expired)
        if evicted:
            self.counters["peers_evicted"] += len(evicted)
        return expired + evicted

    async def _prune(self) -> None:
        dropped = self._drop_peers(self.settings.peers_max)
        if dropped:
            await self.node.db.write(lambda conn: ms.delete_peers(conn, dropped))

    def _on_lan_peer(self, accepted, source_ip: str, interface) -> None:
        check: AnnounceCheck = accepted.check
        origin = D.lan_origin(source_ip, [interface] if interface is not None else self._interfaces())
        self.counters["lan_announces"] += 1
        self._spawn(self._remember(check, accepted.container, "lan", origin))
        if self.dht is not None and check.did not in self.peers:  # a new neighbour: a way into the DHT
            allowed, _ = D.vet(check.addresses, origin, self.dial_policy, schemes=("udp",))
            if allowed:
                _, host, port = parse_addr(allowed[0])
                self._spawn(self.dht.add_bootstrap([(host, port)]))

    def peers_view(self) -> list[dict[str, Any]]:
        out = []
        for did, row in sorted(self.peers.items()):
            link = self.sessions.get(did)
            out.append({
                "did": did, "connected": link is not None, "addresses": row.addresses, "roles": row.roles,
                "mailman": row.mailman, "source": row.source,
                "last_seen": format_time(db.from_us(row.last_seen_us)),
                "last_contact": format_time(db.from_us(row.last_contact_us)) if row.last_contact_us else None,
                **({"ip": link.ip, "channel": str(link.channel), "initiator": link.initiator,
                    "received": link.session.received, "sent": link.session.sent,
                    "score": slot_score(link.session.useful, link.session.strikes.count)} if link else {}),
            })
        for did, link in sorted(self.sessions.items()):
            if did not in self.peers:
                out.append({"did": did, "connected": True, "ip": link.ip, "channel": str(link.channel),
                            "roles": list(link.roles)})
        return out

    async def queues(self, limit: int) -> dict[str, Any]:
        """What waits: the agent's outbox and the containers held as a relay (up to `limit` each)."""
        def read(conn):
            return ms.outbox_list(conn, limit), ms.relay_list(conn, limit)

        outbox, relay = await self.node.db.read(read)
        return {
            "outbox": [{"did": did, "recipient": recipient, "seq": seq, "tries": tries,
                        "next_attempt": format_time(db.from_us(next_us))}
                       for did, recipient, seq, tries, next_us in outbox],
            "relay": [{"recipient": recipient, "did": did, "seq": seq, "size": size, "sender": sender or None,
                       "until": format_time(db.from_us(until_us)) if 0 < until_us < ms.NEVER_US else None}
                      for recipient, did, seq, size, sender, until_us in relay],
        }

    async def status(self) -> dict[str, Any]:
        def read(conn):
            return ms.outbox_count(conn), ms.relay_counts(conn)

        outbox, relay = await self.node.db.read(read)
        return {
            "outbox": outbox, "relay": relay,
            "peer_port": self.port, "dht_port": self.dht_port or None, "addresses": self.addresses,
            "roles": list(self.settings.roles), "connected": len(self.sessions), "known_peers": len(self.peers),
            "counters": dict(self.counters), "dht": self.dht.stats() if self.dht is not None else None,
            "dht_routing": self.dht.routing_size() if self.dht is not None else None,
            "lan": self.lan.stats() if self.lan is not None else None,
            "clock_skew": {"max_abs_seconds": round(self.skew.max_abs(), 3), "peers": self.skew.view()},
            "peers_table": {"size": len(self.peers), "cap": self.settings.peers_max},
            "dials": {
                "attempts": self.counters["dial_attempts"], "failed": self.counters["dial_failed"],
                "failed_rounds": self.counters["dial_failed_rounds"],
                "rate_limited": self.counters["dial_rate_limited"], "backing_off": len(self.dials),
                "refused": {r: n for (area, r), n in sorted(self.node.refusals.items()) if area == "dial"},
                "off_rule": self.counters["dial_off_rule"],
            },
            "slots": slot_usage(self._slots(), self.slot_limits),
            "ledger": self.ledger.stats(),
        }

    async def metrics(self) -> dict[str, Any]:
        """The mesh's numbers for /metrics (hmpnode.api.metrics.render): sessions by
        direction and by the peer's role (roles outside KNOWN_ROLES count as "other":
        a peer names them, the label set stays bounded), the relay queue, the outbox
        and its oldest entry, the DHT and LAN discovery."""
        def read(conn):
            return ms.relay_usage(conn), ms.outbox_backlog(conn), ms.provide_count(conn)

        (relay_items, relay_bytes), (outbox_items, outbox_oldest_us), provides = await self.node.db.read(read)
        live = [s for s in self.sessions.values() if not s.closed]
        roles = Counter(r if r in KNOWN_ROLES else "other" for s in live for r in set(s.roles))
        dht = self.dht.stats() if self.dht is not None else None
        lan = self.lan.counters if self.lan is not None else None
        return {
            "peers_known": len(self.peers),
            "sessions": Counter("outbound" if s.initiator else "inbound" for s in live),
            "session_roles": {r: roles[r] for r in (*KNOWN_ROLES, "other")},
            "relay": {"items": relay_items, "bytes": relay_bytes},
            "outbox": {"items": outbox_items, "oldest_age_seconds":
                       max(0.0, (self.node.now_us() - outbox_oldest_us) / 1e6) if outbox_oldest_us else 0.0},
            "dht": None if dht is None else {
                "routing_table_size": dht["routing_size"], "records_held": dht.get("stored_records", 0),
                "records_held_bytes": dht.get("stored_bytes", 0), "provides": provides,
                "provides_published": self.counters["dht_provided"], "peer_records_published": self.counters["dht_published"],
            },
            "lan": None if lan is None else {
                "sent": lan["sent_multicast"] + lan["sent_broadcast"], "received": lan["received"],
                "accepted": self.counters["lan_announces"],
                "refused": sum(n for (area, _), n in self.node.refusals.items() if area == "lan"),
                "peers": len(self.lan.peers()),
            },
        }

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
        if sum(self._pending.values()) >= self.settings.max_peers or (
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
                self.settings.dial_timeout,
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
        size = self.settings.max_frame_bytes
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
                            max_age=timedelta(seconds=s.mce_max_age_seconds),
                            early=lambda did: self._refusal_for_claim(did, role, ip))
        payload = make_payload(self.identity, self._announce_bytes(), self._static.public, PROTOCOLS)
        hs = NoiseHandshake(role, self._static, PROLOGUE, payload, nacl.utils.random, verify_announce=gate,
                            own_did=self.identity.did, max_frame=s.max_frame_bytes)
        reader, units = UnitReader(), collections.deque()
        deadline = time.monotonic() + s.handshake_timeout

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
                              book=self.ledger.open(), counters=self.counters)
        link = Link(ws, info, session, mono, address=address, subnet=subnet,
                    pinned=info.did in self._pinned or self._allowed(ip), transport=transport, backlog=backlog)
        existing = self.sessions.get(info.did)
        if existing is not None and not existing.closed:
            # Both may have dialled at once: keep the connection opened by the smaller DID.
            if not SE.keeps_new_connection(link.initiator, self.identity.did, info.did):
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
        if existing is not None and not existing.closed:
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
        await self._remember(info.announce, info.verify_result.container, "inbound" if role == "responder" else "dial",
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
            if session.initiator:  # the dialer reconciles: it pushes what the peer lacks, asks what it lacks
                await self._start_sync(link)
            await self._offer_held(link)
            self._wake_outbox.set()
            async for data in self._frames(link):
                if not session.frame_allowed(time.monotonic()):
                    if await self._offence(link, "rate_limited", "too many frames"):
                        break
                    continue
                try:
                    await self._cpu_wait(link)
                    if session.offload_parse(data):
                        message = await self.node.offload(functools.partial(session.parse, data),
                                                          on_cpu=self._charger(link))
                    else:
                        message = session.parse(data)
                    for event in session.receive(message, time.monotonic()):
                        await self._handle(link, event)
                except M.SkewError as exc:
                    await self._clock_skew(link, exc)
                    break
                except M.FrameError as exc:
                    if isinstance(exc, SyncRefusal):
                        self.node.refuse("sync", exc.refusal)
                    if await self._offence(link, exc.reason, exc.detail):
                        break
                except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError) as exc:
                    # a message of a shape the checks let through: still the peer's fault
                    log.warning("peer %s: frame not handled: %r", link.did, exc)
                    if await self._offence(link, "malformed_frame", f"cannot handle: {type(exc).__name__}"):
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
                if link.session.record_failed(exc.reason, time.monotonic()):
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
            self._loopback_locked = (mono + self.settings.ban_seconds, mono)
        elif not self._allowed(link.ip):
            keys.append(ban_key(link.address, link.subnet))
        self._ban(keys)
        self.counters["banned"] += 1
        log.warning("peer %s (%s) cut off: %s", link.did, link.ip, dict(link.session.strikes.by_reason))

    async def _clock_skew(self, link: Link, exc: M.SkewError) -> None:
        """A signed message of the peer dated outside our window: its clock or ours is off.
        Not an offence (no strikes, never a ban: docs/protocol.md 25.4): say so, with the
        offset, and end the connection; handshakes are refused as clock_skew until a clock
        is fixed, then the peers connect again."""
        self.skew.add(link.did, exc.offset_seconds, jump=True)
        self.counters["clock_skew_closed"] += 1
        self.node.refuse("peer", "clock_skew")
        log.warning("peer %s: clock off by %+.0f s; connection closed", link.did, exc.offset_seconds)
        link.session.clock_skew(exc)
        await link.flush()
        self.dials.defer(link.did, time.monotonic() + 10.0)  # not straight back: the clock is still off

    async def _offence(self, link: Link, reason: str, detail: str) -> bool:
        """Answer a protocol violation (the session decides); True when the connection is to be cut."""
        verdict = link.session.offence(reason, detail, time.monotonic())
        if verdict.cut:
            self._cut_off(link)
        await link.flush()
        return verdict.cut

    # -- events of a session ---------------------------------------------------------------------

    async def _handle(self, link: Link, event: Any) -> None:
        """Carry out one event of a peer's session (store, node-wide state), then send
        what the session queued meanwhile."""
        await self._handlers[type(event)](link, event)
        await link.flush()

    @functools.cached_property
    def _handlers(self) -> dict[type, Any]:
        return {
            SE.ContainersReceived: self._on_containers, SE.MceToCheck: self._on_mce, SE.Requested: self._on_requested,
            SE.Offered: self._on_offered, SE.Acknowledged: self._on_acknowledged, SE.BlocksReceived: self._on_blocks,
            SE.ReconcileStart: self._on_reconcile_start, SE.ReconcileWork: self._on_reconcile_work,
            SE.ReconcileStep: self._on_reconcile_step, SE.WantReceived: self._on_want,
            SE.PeerError: self._on_peer_error, SE.Violation: self._on_violation,
        }

    async def _on_peer_error(self, link: Link, event: SE.PeerError) -> None:
        log.debug("peer %s reports %.64r: %.200r", link.did, event.reason, event.detail)

    async def _on_violation(self, link: Link, event: SE.Violation) -> None:
        raise M.FrameError(event.reason, event.detail)

    def _charger(self, link: Link):
        """What charges verification CPU seconds to `link`'s budget (into debt)."""
        def charge(seconds: float) -> None:
            link.session.charge_cpu(time.monotonic(), seconds)
        return charge

    async def _cpu_wait(self, link: Link) -> None:
        """A peer in debt on its verification budget waits before its next frame is read
        (its frames queue up at its end of the connection), so no peer takes more than
        `verify_seconds_per_second` of the verify threads from the API and other peers."""
        for _ in range(100):  # bounded: each wait refills what was missing
            delay = link.session.cpu_delay(time.monotonic())
            if not delay or link.closed:
                return
            self.counters["verify_throttled"] += 1
            await asyncio.sleep(delay)

    def _mce_limits(self):
        """The verifier limits of MCE messages: a compressed payload expands to at most
        one frame's size (peer.max_frame_bytes), never to the 16 MiB of a container."""
        limits = self.node.limits
        if limits.max_decompressed_bytes <= self.settings.max_frame_bytes:
            return limits
        return dataclasses.replace(limits, max_decompressed_bytes=self.settings.max_frame_bytes)

    def _check_mce(self, session: PeerSession, container: dict[str, Any], now: datetime) -> M.Mce:
        """On a verify thread."""
        return session.check_mce(self.node.verifier(self._mce_limits()), container, now)

    async def _on_mce(self, link: Link, event: SE.MceToCheck) -> None:
        now = self.node.now()
        mce = await self.node.offload(self._check_mce, link.session, event.container, now,
                                      on_cpu=self._charger(link))
        self.skew.add(link.did, (mce.timestamp - now).total_seconds())
        for inner in link.session.mce_checked(mce, time.monotonic(), self.node.now()):
            await self._handle(link, inner)

    async def _on_blocks(self, link: Link, event: SE.BlocksReceived) -> None:
        for did, block in event.items:
            await self.node.take_blocks(did, **{event.kind: block})

    def _eligible(self, link: Link, row: db.StoredContainer, now: datetime) -> bool:
        return link.session.may_receive(row.hmp_container["head"], now)

    # containers ----------------------------------------------------------------------------

    def _accepts(self, link: Link, head: Any, usage: RelayUsage | None, size: int,
                 did: str) -> tuple[bool, str]:
        """May this peer hand us this container? (scope, audience, relay quotas: a container
        a relay admits is noted in `_relay_pending` for the store hook to hold)"""
        refusal = link.session.screen(head, self.node.now(), self.settings.roles)
        if refusal is not None:
            return False, refusal
        own = self.identity.did
        recipients = recipients_of(head)
        if usage is None or head.get("broadcast") is True or not recipients:
            return True, "ok"
        others = tuple(r for r in dict.fromkeys(recipients) if r != own)
        unknown = frozenset(r for r in others if r not in self.peers)
        address = _address_key(link)
        reason = admit(self._relay_limits, usage, sender=link.did, address=address, recipients=list(others),
                       unknown=unknown, size=size)
        if reason is not None:
            self.node.refuse("relay", reason)
            if own not in recipients:
                return False, reason
            others = ()  # for us: taken, but held for nobody else
        self._relay_pending[(link.did, did)] = (address or "", others, unknown, size)
        return True, "ok"

    async def _on_containers(self, link: Link, event: SE.ContainersReceived) -> None:
        """Screen (scope, relay quotas) and ingest a `containers` frame; the session
        answers with the ack and judges the invalid ones."""
        items, dids, heads = event.items, event.dids, event.heads
        usage: RelayUsage | None = None
        if self._relays:
            wanted = {r for h in heads if isinstance(h, dict) and h.get("broadcast") is not True
                      for r in recipients_of(h)}
            address = _address_key(link)
            usage = await self.node.db.read(lambda conn: ms.relay_usage_of(conn, wanted, link.did, address))
        to_ingest: list[int] = []
        rejected: list[dict[str, Any]] = []
        for i, (item, head, did) in enumerate(zip(items, heads, dids, strict=True)):
            size = len(orjson.dumps(item)) if usage is not None else 0
            ok, reason = self._accepts(link, head, usage, size, did) if did else (False, "malformed")
            if ok:
                to_ingest.append(i)
            else:
                rejected.append({"container_did": did or "", "reason": reason, "detail": "not accepted from this peer"})
        outcomes: dict[int, Any] = {}
        if to_ingest:
            try:
                results = await self.node.ingest([items[i] for i in to_ingest], source=f"peer:{link.did}",
                                                 budget=self.settings.max_frame_decompressed_bytes,
                                                 on_cpu=self._charger(link))
                outcomes = dict(zip(to_ingest, results, strict=True))
            except StorageFull:  # our disk, not the peer's fault: unacknowledged, offered again later
                self.node.refuse("store", "storage_full", len(to_ingest))
                rejected += [{"container_did": dids[i] or "", "reason": "storage_full",
                              "detail": "the node's disk is full"} for i in to_ingest]
            finally:
                for i in to_ingest:
                    self._relay_pending.pop((link.did, dids[i]), None)
        done = link.session.ingested(event, outcomes, rejected, time.monotonic(), self.node.now())
        for d in dids:
            self._inflight.pop(d, None)
        chains = [(seq, items[i]["relay_chain"]) for i, seq in done.stored if items[i].get("relay_chain")]
        chains = [(seq, c) for seq, c in chains if verify_relay_chain(c, registry=self.node.registry).ok]
        if chains:
            await self.node.db.write(lambda conn: [ms.save_relay_chain(conn, seq, c) for seq, c in chains])
        await self._confirm_to_relays(link, done.for_us)
        if done.offence is not None and done.offence.cut:
            self._cut_off(link)
            await link.flush()
            link.closed = True
            await link.ws.close()

    async def _confirm_to_relays(self, source: Link, for_me: list[str]) -> None:
        """Containers for us that other relays offered too: tell them we have them,
        so they stop holding them (their own offer may have come first)."""
        if not for_me:
            return
        now = self.node.now()
        for other in list(self.sessions.values()):
            if other is source or other.closed or not FORWARDING_ROLES.intersection(other.roles):
                continue
            other.session.confirm(for_me, now)
            await other.flush()

    async def push(self, link: Link, rows: Sequence[db.StoredContainer], *, relay_for: str | None = None,
                   asked: bool = False) -> list[db.StoredContainer]:
        """Send held containers over one connection (the session picks which: each at
        most once); the rows sent. A relay appends itself to the relay chain of what it
        carries for others."""
        by_did = {r.did: r for r in rows}
        rows = [by_did[d] for d in link.session.select_push([r.did for r in rows], relay_for=relay_for, asked=asked)]
        if not rows:
            return []
        chains: dict[int, list] = {}
        if self._relays:
            mine = self.identity.did
            need = [r.seq for r in rows if r.source.startswith("peer:")
                    and mine not in recipients_of(r.hmp_container["head"])]
            if need:
                chains = await self.node.db.read(lambda conn: {seq: ms.relay_chain_of(conn, seq) for seq in need})
        now = self.node.now()
        items = []
        for row in rows:
            full: dict[str, Any] = {"hmp_container": row.hmp_container}
            if row.seq in chains:
                full["relay_chain"] = chains[row.seq]
                full = append_relay(full, self.identity, now=now)
            items.append(full)
        link.session.send_containers(items)
        await link.flush()
        return rows

    # MCE events ------------------------------------------------------------------------------

    async def _on_requested(self, link: Link, event: SE.Requested) -> None:
        session = link.session
        now = self.node.now()
        if event.after is not None:
            after, page = event.after, self.settings.delta_page
            rows = await self.node.db.read(lambda conn: ms.containers_after(conn, after, page))
            added = {r.did: M.index_entry(r.hmp_container) for r in rows if self._eligible(link, r, now)}
            session.answer_page(added, now, after=after, read=[r.seq for r in rows])
        if event.answer:
            wanted = event.dids
            rows = await self.node.db.read(lambda conn: [r for r in (db.get_by_did(conn, d) for d in wanted)
                                                        if r is not None])
            rows = [r for r in rows if self._eligible(link, r, now)]
            session.answer_request([(r.did, r.hmp_container["head"]["signature"]) for r in rows], now)
            await self.push(link, rows, asked=True)
        asked_rb, asked_ev = event.referenced_by, event.evaluations
        if asked_rb or asked_ev:
            def read(conn):
                out_rb, out_ev = {}, {}
                for did in dict.fromkeys(asked_rb + asked_ev):
                    row = db.get_by_did(conn, did)
                    if row is None or not self._eligible(link, row, now):
                        continue  # nothing about containers the peer may not have
                    if did in asked_rb:
                        out_rb[did] = db.backlinks_of(conn, did)
                    if did in asked_ev:
                        items = db.evaluations_of(conn, did)
                        if items:
                            out_ev[did] = evaluations_block(items)
                return out_rb, out_ev

            links, evaluations = await self.node.db.read(read)
            if asked_rb:
                blocks = {did: self.node.referenced_by_block(did, found) for did, found in links.items()}
                session.send_mce("referenced-by_exchange", {d: b for d, b in blocks.items() if b}, now)
            if evaluations:
                session.send_mce("evaluations_exchange", evaluations, now)

    async def _on_offered(self, link: Link, event: SE.Offered) -> None:
        """The peer holds these: the session asks for what we lack (one request per
        container across connections: another peer's offer is taken up only if the
        first one did not deliver within a while)."""
        dids = event.dids

        def held(conn):
            return [d for d in dids if db.is_held(conn, d)], forgotten_of(conn, dids)

        held_now, forgotten = await self.node.db.read(held)
        have = set(held_now)
        mono = time.monotonic()

        def may_ask(did: str) -> bool:
            # what the agent forgot is never asked for again
            if did in forgotten or self._inflight.get(did, 0) > mono:
                return False
            self._inflight[did] = mono + 10.0
            return True

        link.session.ask(dids, have, self.node.now(), may_ask)

    async def _on_acknowledged(self, link: Link, event: SE.Acknowledged) -> None:
        own, acked, pairs = self.identity.did, event.dids, event.pairs

        def write(conn):
            ms.outbox_done(conn, pairs)
            return ms.relay_release(conn, link.did, acked, own) if self._relays else 0

        released = await self.node.db.write(write)
        if released:
            self.counters["relay_released"] += released
            if link.session.held_after is not None:  # more held for it: the next page
                await self._offer_held(link)

    async def _offer_held(self, link: Link) -> None:
        """A relay offers what it holds for the peer (24.2): a `container_delta` of at most
        `delta_page` entries; the next page when the peer's ack released some."""
        if not self._relays:
            return
        after, page = link.session.held_after or 0, self.settings.delta_page
        rows = await self.node.db.read(lambda conn: ms.relay_held_for(conn, link.did, after, page))
        now = self.node.now()
        added = {r.did: M.index_entry(r.hmp_container) for r in rows if self._eligible(link, r, now)}
        link.session.offer_held(added, now, read=[r.seq for r in rows])
        await link.flush()

    # catch-up by reconciliation (docs/protocol.md 22.4) ----------------------------------------

    async def _sync_state(self) -> SY.SyncState:
        """The node-wide sets: one snapshot of the unscoped broadcasts for every link,
        brought up to date when a reconciliation starts: what was stored since goes into a
        small overlay (cheap); the base is rebuilt (O(n)) only when an item nears its ttl or
        the overlay grew past MAX_OVERLAY, and not more often than `sync_snapshot_seconds`."""
        async with self._sync_lock:
            state = self._sync
            now_us = self.node.now_us()
            margin = SY.MARGIN_US
            if state is not None:
                old = now_us - state.built_us >= self.settings.sync_snapshot_seconds * 1e6
                if not (old and (now_us >= state.stale_at_us or len(state.overlay) > SY.MAX_OVERLAY)):
                    if state.last_seq == self.node.last_seq:
                        return state
                    after = state.last_seq

                    def extend(conn):
                        last, rows = ms.sync_rows(conn, now_us + margin, after)
                        return SY.extend_state(state, rows, now_us=now_us, margin_us=margin, last_seq=last)

                    self._sync = state = await self.node.db.read(extend)
                    self.counters["sync_snapshot_extended"] += 1
                    return state

            def build(conn):
                last, rows = ms.sync_rows(conn, now_us + margin)
                return SY.build_state(rows, now_us=now_us, margin_us=margin, last_seq=last)

            self._sync = state = await self.node.db.read(build)
            self.counters["sync_snapshots"] += 1
            return state

    def _sync_set(self, state: SY.SyncState, link: Link, name: str) -> SY.Snapshot:
        if name == "global":
            return state.global_set
        key = SY.scope_key(state.scoped_rows, peer_ip=link.ip, channel=link.channel, now=self.node.now())
        return state.scoped(key)

    async def _start_sync(self, link: Link) -> None:
        """Start one reconciliation per set (both in the same round trip)."""
        mono = time.monotonic()
        state = await self._sync_state()
        link.session.start_sync({name: self._sync_set(state, link, name) for name in SY.SET_NAMES}, mono)
        await link.flush()

    async def _on_reconcile_start(self, link: Link, event: SE.ReconcileStart) -> None:
        snap = self._sync_set(await self._sync_state(), link, event.name)
        await self._handle(link, link.session.answer_start(event, snap, time.monotonic()))

    async def _on_reconcile_work(self, link: Link, event: SE.ReconcileWork) -> None:
        result = await self.node.offload(event.run, on_cpu=self._charger(link))
        for inner in link.session.reconciled(event, result, time.monotonic()):
            await self._handle(link, inner)

    async def _on_reconcile_step(self, link: Link, event: SE.ReconcileStep) -> None:
        self._spawn(self._transfer(link, event))

    async def _on_want(self, link: Link, event: SE.WantReceived) -> None:
        """The initiator asks for containers by id (those its reconciliation found it lacks)."""
        snap = event.snap if event.snap is not None else self._sync_set(await self._sync_state(), link, event.name)
        self.counters["sync_served"] += len(await self._give(link, await self._rows_of(link, snap, event.ids)))

    async def _paced(self, link: Link, n: int) -> bool:
        """Wait until `n` containers fit the session's transfer pace; False if it ended."""
        for _ in range(10_000):  # bounded: each wait refills what was missing
            if link.closed:
                return False
            delay = link.session.pace_delay(time.monotonic(), n)
            if not delay:
                return True
            await asyncio.sleep(delay)
        return False

    async def _transfer(self, link: Link, step: SE.ReconcileStep) -> None:
        """What one reconciliation step found: ask for what we lack (`want`), push what the
        peer lacks (with evaluations), both paced to the peer's container budget."""
        async with link.transfer_lock:
            for kind, chunk in step.batches():
                if not await self._paced(link, len(chunk)):
                    return
                if kind == "want":
                    link.session.send_want(step.name, chunk)
                    await link.flush()
                else:
                    self.counters["sync_pushed"] += len(await self._give(link, await self._rows_of(link, step.snap,
                                                                                                    chunk)))

    async def _give(self, link: Link, rows: list[db.StoredContainer]) -> list[db.StoredContainer]:
        """Push these containers and their evaluations (as a request with request_evaluations
        would bring them, 22.2); a container this connection carried already is not sent again."""
        rows = await self.push(link, rows, asked=True)

        def read(conn):
            return {r.did: evaluations_block(items) for r in rows if (items := db.evaluations_of(conn, r.did))}

        evaluations = await self.node.db.read(read) if rows else {}
        if evaluations:
            link.session.send_mce("evaluations_exchange", evaluations, self.node.now())
            await link.flush()
        return rows

    async def _rows_of(self, link: Link, snap: SY.Snapshot, ids: Iterable[bytes]) -> list[db.StoredContainer]:
        """The held containers of these ids of `snap` that this peer may receive (never
        anything outside the set: an id we do not list maps to nothing)."""
        seqs = [s for s in (snap.seq_of(i) for i in ids) if s is not None]
        if not seqs:
            return []
        rows = await self.node.db.read(lambda conn: db.get_by_seq(conn, seqs))
        now = self.node.now()
        return [r for r in rows if self._eligible(link, r, now)]

    def evaluated(self, did: str) -> None:
        """Our agent evaluated `did`: tell the peers allowed to hold it (spec 5.6)."""
        self._spawn(self._share_evaluations(did))

    async def _share_evaluations(self, did: str) -> None:
        row = await self.node.db.read(lambda conn: db.get_by_did(conn, did))
        if row is None:
            return
        block = await self.node.evaluations(did)
        now = self.node.now()
        for link in list(self.sessions.values()):
            if not link.closed and self._eligible(link, row, now):
                link.session.send_mce("evaluations_exchange", {did: block}, now)
                await link.flush()

    # -- store hook (writer thread, inside the ingest transaction) --------------------------------

    def _store_hook(self, conn, source: str, done) -> None:
        own = self.identity.did
        relay = bool(FORWARDING_ROLES.intersection(self.settings.roles))
        now_us = self.node.now_us()
        holds, outbox = [], []
        for verdict, result in done:
            if result.status != "stored" or not result.seq:
                continue
            head = verdict.container["hmp_container"]["head"]
            recipients = [r for r in recipients_of(head) if r != own]
            if not recipients:
                continue
            if source == "agent":
                outbox.extend((result.did, r, result.seq, now_us) for r in recipients)
            elif relay and head.get("broadcast") is not True and source.startswith("peer:"):
                sender = source[5:]
                admitted = self._relay_pending.get((sender, result.did))
                if admitted is None:
                    continue
                address, hold_for, unknown, size = admitted
                ttl_us = db.to_us(parse_time(head["ttl"])) if isinstance(head.get("ttl"), str) else None
                until_us = hold_until_us(now_us, ttl_us, self.settings.relay_max_hold_seconds)
                holds.extend((r, result.seq, result.did, size, sender, address, 0 if r in unknown else 1, until_us)
                             for r in hold_for)
        if holds:
            ms.relay_hold(conn, holds)
        if outbox:
            ms.outbox_add(conn, outbox)
            loop = self._loop
            loop.call_soon_threadsafe(self._wake_outbox.set)

    # -- loops -------------------------------------------------------------------------------------

    async def _forward_loop(self) -> None:
        """Offer every newly stored container to the peers allowed to have it.
        A first look reads only a few columns; bodies are read only when a peer
        is connected (a node without peers pays next to nothing per container)."""
        cursor = self.node.last_seq
        while True:
            tick = self.node.changed()
            after = cursor
            marks = await self.node.db.read(lambda conn: ms.stored_after(conn, after, 2000))
            if marks:
                cursor = marks[-1].seq
                try:
                    await self._queue_provider_records(marks)
                    if self.sessions:
                        for i in range(0, len(marks), 500):
                            seqs = [m.seq for m in marks[i:i + 500]]
                            await self._forward(await self.node.db.read(lambda conn: db.get_by_seq(conn, seqs)))
                except Exception:  # one bad batch must not stop gossip
                    log.exception("forwarding failed")
            if len(marks) < 2000:
                await asyncio.shield(tick)

    async def _queue_provider_records(self, marks: list[ms.Stored]) -> None:
        """The agent's unscoped broadcasts get DHT provider records (never scoped ones):
        the newest `max_provided` of them, listed on disk with their next publish time;
        older ones lose theirs (docs/protocol.md 26.7)."""
        if self.dht is None:
            return
        rows = [(m.seq, m.did) for m in marks if m.source == "agent" and m.broadcast and not m.network]
        if not rows:
            return
        keep = self.dht.limits.max_provided
        try:
            gone = await self.node.db.write(lambda conn: ms.provide_add(conn, rows, keep))
        except Exception:  # never at the cost of forwarding the batch
            self.counters["dht_provide_list_failed"] += len(rows)
            log.exception("listing provider records failed")
            return
        for did in gone:
            self.dht.withdraw_provider(did)
        self.counters["dht_provide_listed"] += len(rows)
        self.counters["dht_provide_withdrawn"] += len(gone)
        self._provide.set()

    async def _forward(self, rows: list[db.StoredContainer]) -> None:
        now = self.node.now()
        now_us = db.to_us(now)
        push: dict[str, list[db.StoredContainer]] = {}
        offer: dict[str, dict[str, Any]] = {}
        sessions = [s.session for s in self.sessions.values() if not s.closed]
        for row in rows:
            if row.expired(now_us):
                continue
            head = row.hmp_container["head"]
            if row.source == "agent" and head.get("broadcast") is not True:
                continue  # the agent's directed containers are the outbox's to deliver (once per connection)
            origin = row.source[5:] if row.source.startswith("peer:") else None
            eager, lazy = SE.plan_forward(head, row.did, sessions, origin=origin, now=now,
                                          fanout=self.settings.fanout, rng=self._rng)
            for s in eager:
                push.setdefault(s.did, []).append(row)
            for s in lazy:
                offer.setdefault(s.did, {})[row.did] = M.index_entry(row.hmp_container)
        for did, items in push.items():
            link = self.sessions.get(did)
            if link is not None:
                await self.push(link, items)
        for did, added in offer.items():
            link = self.sessions.get(did)
            if link is not None and link.session.announce(added, now):
                await link.flush()

    async def _outbox_loop(self) -> None:
        """Deliver the agent's directed containers: recipient, its relays, or retry later."""
        while True:
            now_us = self.node.now_us()
            due = await self.node.db.read(lambda conn: ms.outbox_due(conn, now_us, 1000))
            if due:
                by_recipient: dict[str, list[tuple[str, int, int]]] = {}
                for did, recipient, seq, tries in due:
                    by_recipient.setdefault(recipient, []).append((did, seq, tries))
                outcomes = await asyncio.gather(*(self._deliver(r, entries) for r, entries in by_recipient.items()),
                                                return_exceptions=True)
                for outcome in outcomes:
                    if isinstance(outcome, Exception):
                        log.error("outbox delivery failed", exc_info=outcome)
            self._wake_outbox.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_outbox.wait(), 0.5 if due else 1.0)

    async def _deliver(self, recipient: str, entries: list[tuple[str, int, int]]) -> None:
        s = self.settings
        now = self.node.now()
        now_us = db.to_us(now)
        rows = await self.node.db.read(lambda conn: db.get_by_seq(conn, [seq for _, seq, _ in entries]))
        expired = [(r.did, recipient) for r in rows if r.expired(now_us)]
        live = [r for r in rows if not r.expired(now_us)]
        gone = {did for did, _, _ in entries} - {r.did for r in rows}
        if expired or gone:
            self.counters["outbox_expired"] += len(expired) + len(gone)
            await self.node.db.write(lambda conn: ms.outbox_done(conn, expired + [(d, recipient) for d in gone]))
        if not live:
            return
        wait_ack = now_us + int(s.ack_timeout * 1e6)
        link = self.sessions.get(recipient) or await self._reach(recipient)
        if link is not None:
            # what this connection carried already is not sent on it again (an ack can only be
            # lost with the connection; a new connection starts with nothing known)
            eligible = [r for r in live if self._eligible(link, r, now)]
            await self.node.db.write(lambda conn: ms.outbox_retry(conn, [(wait_ack, r.did, recipient) for r in eligible]))
            await self.push(link, eligible)
            self.counters["outbox_direct"] += len(eligible)
            live = [r for r in live if r not in eligible]
            if not live:
                return
        relay = await self._relay_for(recipient)
        if relay is not None:
            eligible = [r for r in live if relay.session.may_receive(r.hmp_container["head"], now, as_relay=True)]
            await self.node.db.write(lambda conn: ms.outbox_retry(conn, [(wait_ack, r.did, recipient) for r in eligible]))
            await self.push(relay, eligible, relay_for=recipient)
            self.counters["outbox_via_relay"] += len(eligible)
            live = [r for r in live if r not in eligible]
        if live:
            tries = {did: t for did, _, t in entries}
            retry = []
            for r in live:
                delay = min(s.retry_max, s.retry_base * 2 ** min(tries.get(r.did, 0), 20))
                retry.append((now_us + int(delay * (0.5 + self._rng.random()) * 1e6), r.did, recipient))
            self.counters["outbox_deferred"] += len(retry)
            await self.node.db.write(lambda conn: ms.outbox_retry(conn, retry))

    async def _reach(self, did: str) -> Link | None:
        """A link with `did`: dial a known address, else look it up in the DHT.

        Only addresses the dial rule allows (`dialing.check`, judged again for the
        peers table); each attempt takes a token of the node-wide dial budget, and a
        failed round backs this peer off exponentially."""
        if did == self.identity.did:
            return None
        mono = time.monotonic()
        if did in self._dialing or not self.dials.due(did, mono) or self.bans.banned(did, mono):
            return self.sessions.get(did)
        self._dialing.add(did)
        try:
            row = self.peers.get(did)
            # judged again by where they were learnt; rows read from the store, by the table rule
            origin = (self._origins.get(did) or D.table_origin(self._interfaces())) if row else None
            addresses = [a for a in self._vet(row.addresses if row else [], origin, count=False)
                         if a.startswith("tcp://")] if origin else []
            if not addresses and self.dht is not None and self.node.registry.revoked_at(did) is None:
                record = await self.dht.find_peer(did)
                if record is not None:
                    # a DHT peer record names no protocol: its addresses are tried, the handshake decides
                    check = AnnounceCheck(True, did=did, addresses=tuple(record.addresses), roles=tuple(record.roles),
                                          mailman=tuple(record.mailman), timestamp=record.timestamp,
                                          protocols=PROTOCOLS)
                    origin = D.dht_origin(self._dht_local())
                    await self._remember(check, None, "dht", origin)
                    addresses = [a for a in self._vet(record.addresses, origin, count=False) if a.startswith("tcp://")]
                    self.counters["dht_found"] += 1
            if not addresses or origin is None:
                self.dials.defer(did, time.monotonic() + self.settings.dial_backoff_base)
                return None
            for addr in addresses:
                if not self.dials.take(time.monotonic()):
                    self.counters["dial_rate_limited"] += 1
                    self.node.refuse("dial", "rate_limited")
                    return None  # not this peer's failure: tried again when the budget refills
                link = await self.dial(addr, expect_did=did, origin=origin)
                if link is not None and link.did == did:
                    self.dials.succeeded(did)
                    return link
            failures = self.dials.failed(did, time.monotonic())
            self.counters["dial_failed_rounds"] += 1
            if failures >= self.settings.dial_give_up_after and row is not None and not row.last_contact_us:
                self._wake_prune = True  # never answered: forgotten at the next maintenance
            return None
        finally:
            self._dialing.discard(did)

    async def _relay_for(self, recipient: str) -> Link | None:
        """A connection to a relay that holds for `recipient`: one of its announced
        mailmen, else any connected relay."""
        row = self.peers.get(recipient)
        mailmen = list(row.mailman) if row else []
        if not mailmen and self.dht is not None and row is None:
            record = await self.dht.find_peer(recipient)
            mailmen = list(record.mailman) if record else []
        for did in mailmen:
            link = self.sessions.get(did) or await self._reach(did)
            if link is not None:
                return link
        relays = [s for s in self.sessions.values() if FORWARDING_ROLES.intersection(s.roles) and not s.closed]
        return relays[0] if relays else None

    async def _connect_loop(self) -> None:
        """Keep `target_peers` connections to known peers, and at least `min_outbound`
        of its own whatever its inbound ones (peers that dialled it cannot cut it off);
        pinned peers are kept connected on top."""
        s = self.settings
        while True:
            self._wake_connect.clear()
            pinned = [d for d in self._pinned if d not in self.sessions and d != self.identity.did]
            if pinned:  # _reach keeps its own back-off per DID
                await asyncio.gather(*(self._reach(d) for d in pinned), return_exceptions=True)
            live = [x for x in self.sessions.values() if not x.closed]
            outbound = sum(1 for x in live if x.initiator)
            want = max(s.target_peers - len(live), min(s.min_outbound, s.target_peers) - outbound)
            if want > 0:
                mono = time.monotonic()
                candidates = [d for d, row in self.peers.items()
                              if d not in self.sessions and d not in self._dialing
                              and self.dials.due(d, mono) and not self.bans.banned(d, mono)
                              and any(a.startswith("tcp://") for a in row.addresses)]
                self._rng.shuffle(candidates)
                # no more rounds than the dial budget has tokens for (each round takes at least one)
                want = min(want, int(self.dials.available(mono)))
                if candidates and want > 0:
                    await asyncio.gather(*(self._reach(d) for d in candidates[:want]), return_exceptions=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_connect.wait(), 1.0)

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
            await self._prune()
        idle = mono - self.settings.sync_idle_seconds
        for link in list(self.sessions.values()):  # answered reconciliations left idle hold a snapshot
            link.session.expire_reconciliations(idle)
        if FORWARDING_ROLES.intersection(self.settings.roles):
            now_us = self.node.now_us()
            own = self.identity.did
            dropped = await self.node.db.write(lambda conn: ms.relay_expired(conn, now_us, own))
            if dropped:
                self.counters["relay_expired"] += dropped
        current = self._mailman()
        if current != mailman:
            if self.lan is not None:
                await self.lan.announce_now()
            if self.dht is not None:
                self._spawn(self._dht_publish())
        return current

    async def _dht_publish(self) -> None:
        records = [self._address_records.get(a) or make_address_record(self.identity.did, a,
                                                                       difficulty=self.settings.min_difficulty)
                   for a in outward_first(self.addresses)]
        replicas = await self.dht.publish_peer(records, roles=list(self.settings.roles), mailman=self._mailman())
        self.counters["dht_published"] += 1
        self.counters["dht_replicas_last"] = replicas
        for topic in self.settings.interests:
            await self.dht.announce_topic(topic)

    async def _provide_loop(self) -> None:
        """Sign and store the provider records that are due (never published first, newest
        first; then each `republish_interval` after its last), one at a time, at most
        `provide_rate` per second: the list and the schedule are read from disk in
        batches, so memory does not grow with the number of containers, and a republish
        round is spread out instead of re-signing everything at once."""
        dht = self.dht
        limits = dht.limits
        bucket = TokenBucket(limits.provide_rate, limits.provide_burst)
        interval_us = int(limits.republish_interval * 1_000_000) if limits.republish_interval else None

        async def one_round() -> None:
            """Publish up to one batch of due provider records, or wait for one to be due."""
            self._provide.clear()
            now_us = self.node.now_us()
            due, gone = await self.node.db.write(lambda conn: ms.provide_due(conn, now_us, 32))
            for did in gone:  # deleted since: no record
                dht.withdraw_provider(did)
            if not due:
                next_us = await self.node.db.read(ms.provide_next_us)
                wait = 60.0 if next_us is None else min(60.0, max(0.05, (next_us - now_us) / 1e6))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._provide.wait(), wait)
                return
            done: list[int] = []
            for seq, did in due:
                while not bucket.take(time.monotonic()):
                    await asyncio.sleep(max(0.01, (1 - bucket.tokens) / limits.provide_rate))
                try:
                    replicas = await dht.publish_provider(did)
                    self.counters["dht_provided"] += 1
                    if not replicas:
                        self.counters["dht_provide_unreplicated"] += 1
                except ValueError:  # a DID no record can carry (stored DIDs are checked: not expected)
                    self.counters["dht_provide_invalid"] += 1
                except Exception:
                    log.exception("DHT provide failed")
                done.append(seq)
            next_us = self.node.now_us() + interval_us if interval_us else 2**62
            dropped = set(await self.node.db.write(lambda conn: ms.provide_done(conn, done, next_us)))
            for seq, did in due:  # withdrawn while we were publishing it
                if seq in dropped:
                    dht.withdraw_provider(did)

        while True:
            try:
                await one_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. the database failing once: wait, then go on
                log.exception("DHT provide round failed")
                await asyncio.sleep(10)

    async def _dht_loop(self) -> None:
        """Publish our records once the DHT has neighbours, again while it has
        few (so that more replicas hold them), and whenever the routing table
        was emptied and refilled. The Dht republishes them by itself later."""
        published_with = 0
        while True:
            size = self.dht.routing_size()
            if size == 0:
                published_with = 0
            elif published_with == 0 or (published_with < 8 and size >= 2 * published_with):
                try:
                    await self._dht_publish()
                    published_with = size
                except Exception:
                    log.exception("DHT publish failed")
            await asyncio.sleep(1.0 if published_with < 8 else 10.0)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.node.loop


async def _close_quietly(ws) -> None:
    with contextlib.suppress(Exception):
        await ws.close()


def _dht_limits(s: MeshSettings):
    """The DHT's limits with the store settings of [peer] (everything else: defaults)."""
    from hmpnode.net.dht import DhtLimits
    from hmpnode.net.dhtrecords import RecordLimits, StoreLimits

    store = StoreLimits(max_entries=s.dht_max_records, max_per_source=s.dht_max_records_per_ip,
                        max_per_group=s.dht_max_records_per_subnet, max_hold=timedelta(seconds=s.dht_hold_seconds))
    return DhtLimits(store=store, records=RecordLimits(max_skew=timedelta(seconds=s.dht_max_skew_seconds)),
                     max_provided=s.dht_max_provided, provide_rate=s.dht_provides_per_second,
                     provide_burst=max(1.0, s.dht_provides_per_second * 16))


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


def _address_key(link: Link) -> str | None:
    """What relay quotas per address count a peer under: its IPv4 address or IPv6 /64;
    None on loopback (every node of this host shares the address)."""
    if link.channel is Channel.LOOPBACK:
        return None
    addr = parse_ip(link.ip)
    return link.ip if addr is None else host_key(addr)


