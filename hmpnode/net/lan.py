"""Zero-configuration discovery of nodes on one host and one LAN (UDP multicast + broadcast).

Every node sends its signed `peer_announce` (full form, compact JSON, one
datagram) to UDP port 47474 of the multicast group 239.255.74.77 and/or of
each interface's broadcast address, at start and every ~5 s; it listens on
that port on all chosen interfaces. The wire rules are in
docs/protocol.md ("LAN discovery"); this module has two layers:

- `AnnounceFilter` (sans-IO: no sockets, no clock reads) decides what a
  received datagram is worth: `Accepted` or `Ignored(reason)`.
- `LanDiscovery` (asyncio) owns the socket, sends, receives, and hands each
  accepted announce to `on_peer`.

`pick_address` chooses which announced address to dial, refusing addresses
that do not belong to the datagram's sender (reflection).

Several nodes on one host share the port (SO_REUSEADDR + SO_REUSEPORT);
multicast and broadcast datagrams reach every socket bound to it. IPv4 only.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import ipaddress
import logging
import random
import socket
import struct
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from hmpnode.container import reasons as R
from hmpnode.container.schema import default_schemas
from hmpnode.container.verify import Limits, Verifier, VerifyResult
from hmpnode.identity.registry import KeyRegistry, MemoryKeyRegistry
from hmpnode.net.announce import DEFAULT_MIN_DIFFICULTY, AnnounceCheck, check_peer_announce, newer_announce
from hmpnode.net.interfaces import Interface
from hmpnode.net.interfaces import interfaces as host_interfaces
from hmpnode.net.penalty import TokenBucket
from hmpnode.net.scope import is_loopback_ip

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_GROUP",
    "MODES",
    "IGNORE_REASONS",
    "LanSettings",
    "Accepted",
    "Ignored",
    "AnnounceFilter",
    "LanPeer",
    "LanDiscovery",
    "pick_address",
]

log = logging.getLogger("hmpnode.lan")

DEFAULT_PORT = 47474
#: administratively scoped (RFC 2365): never routed off the site
DEFAULT_GROUP = "239.255.74.77"
MODES = ("multicast", "broadcast", "both")

#: Why `AnnounceFilter.receive` ignores a datagram (stable codes, counted in stats).
IGNORE_REASONS = (
    "oversize",          # longer than max_datagram
    "own",               # one of the datagrams this node sent itself, or signed by its own DID
    "duplicate",         # byte-identical to an announce already accepted
    "rate_limited",      # the source IP's token bucket is empty
    "overloaded",        # the filter-wide token bucket is empty
    "malformed",         # not a JSON container (verifier `malformed` / `schema`)
    "unverified",        # the container does not verify (any other verifier reason)
    "wrong_class",       # check_peer_announce refusals, with its codes ...
    "unreadable",
    "bad_payload",
    "expired",
    "no_valid_address",  # ... e.g. every address record's PoW is too weak
    "stale",             # head.timestamp older than now - max_age
    "replayed",          # not newer than the last announce accepted from that DID
    "revoked",           # a non-revoking announce after that DID's revocation
)

_IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)            # Linux; Python 3.11 lacks the name
_IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)
_LIMITED_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_OWN_SENT = 16         # how many of our last sent datagrams are recognised as our own
_RECV_BATCH = 64       # datagrams read per wake-up, so a flood cannot starve the loop
_STOP_TIMEOUT = 2.0


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True, slots=True)
class LanSettings:
    """LAN discovery settings; defaults are the protocol's (docs/protocol.md)."""

    enabled: bool = True
    port: int = DEFAULT_PORT
    group: str = DEFAULT_GROUP
    #: how to send: "multicast", "broadcast" or "both" (receiving takes both always)
    mode: str = "both"
    #: seconds between announces, each spread uniformly by +-jitter*interval
    interval: float = 5.0
    jitter: float = 0.2
    #: IPv4 addresses of the interfaces to use; None = every up IPv4 interface, loopback included
    interfaces: tuple[str, ...] | None = None
    #: announces whose head.timestamp is older than this (seconds) are ignored
    max_age: float = 120.0
    max_datagram: int = 8192
    #: per source IP: sustained datagrams/s and bucket size (~50 nodes behind one address at 5 s)
    rate: float = 10.0
    burst: float = 40.0
    #: all sources together: bounds the CPU spent verifying (~0.2 ms each)
    global_rate: float = 200.0
    global_burst: float = 400.0
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY
    #: bounds on remembered DIDs and source IPs (least recently used forgotten first)
    max_peers: int = 4096
    max_sources: int = 1024
    #: answer a newly seen DID with our own announce (0..0.5 s later, at most every min(interval/4, 1 s))
    reply_to_new: bool = True

    def __post_init__(self) -> None:
        if self.interfaces is not None:
            object.__setattr__(self, "interfaces", tuple(self.interfaces))
            for addr in self.interfaces:
                try:
                    ipaddress.IPv4Address(addr)
                except ValueError:
                    raise ValueError(f"interfaces: {addr!r} is not an IPv4 address") from None
        if not 1 <= self.port <= 65535:
            raise ValueError("port must be 1..65535")
        try:
            group = ipaddress.IPv4Address(self.group)
        except ValueError:
            raise ValueError(f"group {self.group!r} is not an IPv4 address") from None
        if not group.is_multicast:
            raise ValueError(f"group {self.group} is not a multicast address (224.0.0.0/4)")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if not 0.05 <= self.interval <= 3600 or not 0 <= self.jitter < 1:
            raise ValueError("interval must be 0.05..3600 s and jitter 0..1 (exclusive)")
        if not self.max_age > 0:
            raise ValueError("max_age must be positive")
        if not 512 <= self.max_datagram <= 65507:
            raise ValueError("max_datagram must be 512..65507 bytes")
        if min(self.rate, self.burst, self.global_rate, self.global_burst) <= 0 or min(self.burst, self.global_burst) < 1:
            raise ValueError("rates must be positive and bursts at least 1")
        if not 0 <= self.min_difficulty <= 64:
            raise ValueError("min_difficulty must be 0..64")
        if self.max_peers < 1 or self.max_sources < 1:
            raise ValueError("max_peers and max_sources must be at least 1")


# -- the sans-IO filter ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Accepted:
    """A verified, fresh `peer_announce` from another node."""

    container: dict[str, Any] = field(repr=False)
    check: AnnounceCheck
    source_ip: str
    #: the datagram as received (what to hand to the node's ingest)
    datagram: bytes = field(repr=False)
    verify_result: VerifyResult = field(repr=False)
    ok: bool = True


@dataclass(frozen=True, slots=True)
class Ignored:
    reason: str
    detail: str = ""
    ok: bool = False


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class AnnounceFilter:
    """Decides whether a received discovery datagram is a new announce from a peer.

    Sans-IO: `now` (wall clock, for timestamps) and `clock` (monotonic
    seconds, for the rate limits) are passed in. Checks run cheapest first:
    size, own/duplicate bytes, rate limits, then verification (~0.2 ms),
    announce rules, own DID, age and replay. Never raises on the datagram.
    """

    def __init__(
        self,
        own_did: str | None,
        *,
        settings: LanSettings = LanSettings(),
        registry: KeyRegistry | None = None,
        verifier: Verifier | None = None,
    ):
        self.own_did = own_did
        self.settings = settings
        # A registry of our own takes TOFU pins itself (a DID of a foreign form keeps
        # its first key); a registry handed in is the node's, which pins on ingest.
        self._pins: MemoryKeyRegistry | None = None
        if verifier is None:
            if registry is None:
                registry = self._pins = MemoryKeyRegistry()
            verifier = Verifier(registry=registry, schemas=default_schemas(),
                                limits=Limits(max_container_bytes=settings.max_datagram))
        self.verifier = verifier
        self._max_age = timedelta(seconds=settings.max_age)
        # DID -> (last accepted check, digest of its datagram); LRU order
        self._last: OrderedDict[str, tuple[AnnounceCheck, bytes]] = OrderedDict()
        self._accepted_digests: dict[bytes, str] = {}
        self._own_sent: OrderedDict[bytes, None] = OrderedDict()
        self._sources: OrderedDict[str, TokenBucket] = OrderedDict()
        self._global = TokenBucket(settings.global_rate, settings.global_burst)
        self.accepted = 0
        self.ignored: Counter[str] = Counter()
        #: verifier reason codes behind `unverified` and `malformed`
        self.unverified: Counter[str] = Counter()

    def note_sent(self, datagram: bytes) -> None:
        """Remember a datagram this node sent: its echo is dropped as `own` unverified."""
        digest = _digest(bytes(datagram))
        self._own_sent[digest] = None
        self._own_sent.move_to_end(digest)
        while len(self._own_sent) > _OWN_SENT:
            self._own_sent.popitem(last=False)

    def forget(self, did: str) -> None:
        """Drop what is remembered of `did` (its next announce is judged afresh)."""
        entry = self._last.pop(did, None)
        if entry is not None:
            self._accepted_digests.pop(entry[1], None)

    def last(self, did: str) -> AnnounceCheck | None:
        entry = self._last.get(did)
        return entry[0] if entry is not None else None

    def _ignore(self, reason: str, detail: str = "") -> Ignored:
        self.ignored[reason] += 1
        return Ignored(reason, detail)

    def _rate_ok(self, source_ip: str, clock: float) -> str | None:
        s = self.settings
        # Loopback sources are this host's own nodes, all on one address and not
        # spoofable from outside: only the receiver-wide bucket bounds them.
        if not is_loopback_ip(source_ip):
            bucket = self._sources.get(source_ip)
            if bucket is None:
                bucket = self._sources[source_ip] = TokenBucket(s.rate, s.burst)
                if len(self._sources) > s.max_sources:
                    self._sources.popitem(last=False)
            else:
                self._sources.move_to_end(source_ip)
            if not bucket.take(clock):
                return "rate_limited"
        if not self._global.take(clock):
            return "overloaded"
        return None

    def receive(self, datagram: bytes, source_ip: str, now: datetime, *, clock: float | None = None) -> Accepted | Ignored:
        """Judge one datagram from `source_ip`; `clock` defaults to `now` in seconds."""
        s = self.settings
        data = bytes(datagram)
        if len(data) > s.max_datagram:
            return self._ignore("oversize", f"{len(data)} bytes, over {s.max_datagram}")
        digest = _digest(data)
        if digest in self._own_sent:
            return self._ignore("own", "our own datagram")
        if digest in self._accepted_digests:
            return self._ignore("duplicate", self._accepted_digests[digest])
        limited = self._rate_ok(str(source_ip), now.timestamp() if clock is None else clock)
        if limited is not None:
            return self._ignore(limited, str(source_ip))

        result = self.verifier.verify(data, now=now)
        if not result.ok:
            code = result.reason or R.MALFORMED
            self.unverified[code] += 1
            reason = "malformed" if code in (R.MALFORMED, R.SCHEMA) else "unverified"
            return self._ignore(reason, f"{code}: {result.detail}"[:200])
        sender = result.container["hmp_container"]["head"]["sender_did"]  # type: ignore[index]
        if self.own_did is not None and sender == self.own_did:
            return self._ignore("own", "signed by our own DID")
        check = check_peer_announce(result, min_difficulty=s.min_difficulty, now=now)
        if not check.ok:
            return self._ignore(check.reason or "bad_payload", check.detail[:200])
        assert check.did is not None and check.timestamp is not None
        if check.timestamp < now - self._max_age:
            return self._ignore("stale", f"timestamp {check.timestamp.isoformat()} is older than {s.max_age:g} s")
        current = self.last(check.did)
        if not newer_announce(current, check):
            reason = "revoked" if current is not None and current.revoked and not check.revoked else "replayed"
            return self._ignore(reason, check.did)

        if self._pins is not None and result.pin_candidate is not None:
            self._pins.pin(*result.pin_candidate)
        self.forget(check.did)
        self._last[check.did] = (check, digest)
        self._accepted_digests[digest] = check.did
        while len(self._last) > s.max_peers:
            _, (_, old) = self._last.popitem(last=False)
            self._accepted_digests.pop(old, None)
        self.accepted += 1
        return Accepted(result.container, check, str(source_ip), data, result)  # type: ignore[arg-type]

    def stats(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "ignored": dict(self.ignored),
            "unverified": dict(self.unverified),
            "peers": len(self._last),
            "sources": len(self._sources),
        }


#: ignored datagrams that are no refusal: our own, and the multicast/broadcast twin of one taken
NOT_REFUSALS = frozenset({"own", "duplicate"})


# -- address selection -------------------------------------------------------------


def pick_address(check: AnnounceCheck, source_ip: str, scheme: str,
                 ifaces: Iterable[Interface] | None = None) -> str | None:
    """The announced `scheme` address ("tcp" or "udp") to dial for a LAN announce.

    1. An address whose host is the datagram's source IP (first in announce order).
    2. Else an IPv4 address in the subnet of the local interface the source is
       on (`interface_for`; `ifaces` defaults to the host's), other than that
       subnet's network/broadcast address and other than our own address.
    3. Else None: host names, IPv6 and addresses elsewhere are never chosen.

    The rule is `hmpnode.net.dialing.check` with a LAN origin (the one rule for
    every address source). Why: the source IP is the one thing about the sender
    the network vouches for; an announce is signed by its author but may name
    anyone's host, so dialling arbitrary announced hosts would let one LAN
    datagram point every node at a third party (reflection). Same-subnet hosts
    are allowed because a node listening on 0.0.0.0 announces one address per
    interface and may send from another of its addresses; an attacker on the
    subnet reaches those hosts directly anyway."""
    from hmpnode.net.dialing import lan_origin, vet

    origin = lan_origin(source_ip, host_interfaces() if ifaces is None else ifaces)
    allowed, _ = vet(check.addresses, origin, schemes=(scheme,))
    return allowed[0] if allowed else None


# -- the asyncio layer ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LanPeer:
    """The last accepted announce of a DID and how it arrived."""

    did: str
    check: AnnounceCheck
    source_ip: str
    interface: Interface
    #: "multicast" or "broadcast"
    via: str
    #: loop time (monotonic seconds) when accepted
    seen: float


AnnounceSource = Callable[[], "bytes | Awaitable[bytes]"]
PeerCallback = Callable[[Accepted, str, Interface], Any]


def _mreqn(group: str | ipaddress.IPv4Address, iface: Interface) -> bytes:
    """struct ip_mreqn {group, interface address, interface index}."""
    return struct.pack("=4s4si", ipaddress.IPv4Address(group).packed, iface.address.packed, iface.index)


class LanDiscovery:
    """Sends this node's announce and hands peers' announces to `on_peer`.

    `announce()` is called for every send (at start, every interval, on
    `announce_now`, and in reply to a new peer) so the node can re-sign with a
    fresh timestamp; it may return bytes or an awaitable of bytes (the compact
    full form, e.g. `encode_wire(build_peer_announce(...))`). `on_peer(accepted,
    source_ip, interface)` may be sync or async; its errors are logged and
    counted, never fatal. Linux only (IP_PKTINFO, ip_mreqn)."""

    def __init__(
        self,
        settings: LanSettings = LanSettings(),
        *,
        own_did: str | None,
        announce: AnnounceSource,
        on_peer: PeerCallback | None = None,
        registry: KeyRegistry | None = None,
        verifier: Verifier | None = None,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], datetime] = utc_now,
        list_interfaces: Callable[[], Sequence[Interface]] = host_interfaces,
        on_refuse: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        #: told the reason of every datagram refused (not our own, not a twin of one taken)
        self._on_refuse = on_refuse
        self.filter = AnnounceFilter(own_did, settings=settings, registry=registry, verifier=verifier)
        self._announce = announce
        self._on_peer = on_peer
        self._rng = rng
        self._clock = clock
        self._list_interfaces = list_interfaces
        self._group = ipaddress.IPv4Address(settings.group)
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._callbacks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._reply_handle: asyncio.TimerHandle | None = None
        self._last_send = float("-inf")
        self._ifaces: list[Interface] = []
        self._joined: dict[int, Interface] = {}   # device index -> interface it was joined with
        self._warned: set[Any] = set()
        self._peers: OrderedDict[str, LanPeer] = OrderedDict()
        self.counters: Counter[str] = Counter()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._sock is not None

    @property
    def interfaces(self) -> list[Interface]:
        """The interfaces in use (refreshed before every send)."""
        return list(self._ifaces)

    async def start(self) -> None:
        """Bind the port, join the group, start announcing. Raises OSError when
        the port cannot be bound."""
        if self._sock is not None or self._closed:
            raise RuntimeError("LanDiscovery can be started once")
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)   # never leaves the link
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)  # other nodes on this host
            sock.setsockopt(socket.IPPROTO_IP, _IP_PKTINFO, 1)               # arrival interface + destination
            try:  # only the groups this socket joined, on the interfaces it joined them on
                sock.setsockopt(socket.IPPROTO_IP, _IP_MULTICAST_ALL, 0)
            except OSError:
                pass
            sock.setblocking(False)
            sock.bind(("0.0.0.0", self.settings.port))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._refresh_interfaces()
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self._task = self._loop.create_task(self._run(), name="hmpnode-lan-announce")
        log.info("lan discovery on port %d (%s), interfaces %s", self.settings.port, self.settings.mode,
                 ", ".join(f"{i.name}={i.address}" for i in self._ifaces) or "none yet")

    async def stop(self) -> None:
        """Stop sending and receiving, close the socket; waits at most ~2 s. Idempotent."""
        self._closed = True
        sock, self._sock = self._sock, None
        if self._reply_handle is not None:
            self._reply_handle.cancel()
            self._reply_handle = None
        if sock is not None and self._loop is not None:
            self._loop.remove_reader(sock.fileno())
        tasks = [t for t in (self._task, *self._callbacks) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_TIMEOUT)
        self._task = None
        if sock is not None:
            sock.close()  # leaves the groups

    async def __aenter__(self) -> LanDiscovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- interfaces --------------------------------------------------------------

    def _warn_once(self, key: Any, msg: str, *args: Any) -> None:
        if key in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(key)
            log.warning(msg, *args)

    def _select(self) -> list[Interface]:
        try:
            found = [i for i in self._list_interfaces() if i.up]
        except OSError as exc:
            self._warn_once(("list", exc.errno), "lan: cannot list interfaces: %s", exc)
            return self._ifaces
        wanted = self.settings.interfaces
        if wanted is None:
            return found
        chosen = []
        for addr in wanted:
            match = [i for i in found if str(i.address) == addr]
            if match:
                chosen.append(match[0])
            else:
                self._warn_once(("missing", addr), "lan: no up interface has address %s (yet)", addr)
        return chosen

    def _refresh_interfaces(self) -> None:
        """Re-read the interfaces; join the group on new devices, leave vanished ones."""
        sock = self._sock
        if sock is None:
            return
        self._ifaces = self._select()
        wanted: dict[int, Interface] = {}
        for iface in self._ifaces:
            if iface.multicast:
                wanted.setdefault(iface.index, iface)
        for index in list(self._joined):
            if index not in wanted:
                old = self._joined.pop(index)
                try:
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP, _mreqn(self._group, old))
                except OSError:
                    pass  # the device is gone, and its membership with it
        for index, iface in wanted.items():
            if index in self._joined:
                continue
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, _mreqn(self._group, iface))
            except OSError as exc:
                self.counters["join_errors"] += 1
                self._warn_once(("join", index, exc.errno), "lan: cannot join %s on %s (%s): %s",
                                self._group, iface.name, iface.address, exc)
                continue
            self._joined[index] = iface

    # -- sending -----------------------------------------------------------------

    async def _run(self) -> None:
        assert self._loop is not None
        while True:
            self._wake.clear()
            await self._send()
            s = self.settings
            delay = s.interval * (1 + s.jitter * (2 * self._rng() - 1))
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def announce_now(self) -> int:
        """Send the announce now (e.g. after the node's addresses changed);
        returns the number of datagrams sent."""
        return await self._send()

    async def _send(self) -> int:
        async with self._send_lock:
            if self._sock is None:
                return 0
            try:
                data = self._announce()
                if inspect.isawaitable(data):
                    data = await data
                data = bytes(data)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counters["announce_errors"] += 1
                log.exception("lan: the announce callback failed")
                return 0
            if self._sock is None:
                return 0
            if len(data) > self.settings.max_datagram:
                self.counters["announce_oversize"] += 1
                self._warn_once("oversize", "lan: announce is %d bytes, over max_datagram %d: not sent",
                                len(data), self.settings.max_datagram)
                return 0
            self._refresh_interfaces()
            self.filter.note_sent(data)
            self._last_send = self._loop.time() if self._loop is not None else 0.0
            return self._send_datagrams(data)

    def _send_datagrams(self, data: bytes) -> int:
        sock = self._sock
        assert sock is not None
        mode = self.settings.mode
        port = self.settings.port
        sent = 0
        if mode in ("multicast", "both"):
            for iface in self._joined.values():
                try:
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, _mreqn("0.0.0.0", iface))
                    sock.sendto(data, (str(self._group), port))
                    sent += 1
                    self.counters["sent_multicast"] += 1
                except OSError as exc:
                    self.counters["send_errors"] += 1
                    self._warn_once(("mcast", iface.index, exc.errno), "lan: multicast on %s failed: %s", iface.name, exc)
        if mode in ("broadcast", "both"):
            targets = dict.fromkeys(i.broadcast for i in self._ifaces if i.broadcast is not None)
            for target in targets:
                try:
                    sock.sendto(data, (str(target), port))
                    sent += 1
                    self.counters["sent_broadcast"] += 1
                except OSError as exc:
                    self.counters["send_errors"] += 1
                    self._warn_once(("bcast", target, exc.errno), "lan: broadcast to %s failed: %s", target, exc)
        return sent

    def _schedule_reply(self) -> None:
        """Answer a newcomer soon (it would otherwise wait a full interval for us),
        after a random 0..0.5 s and at least min(interval/4, 1 s) after our last
        send: a crowd of newcomers costs each node about one extra datagram a second."""
        if not self.settings.reply_to_new or self._reply_handle is not None or self._loop is None:
            return
        delay = 0.5 * self._rng()
        earliest = self._last_send + min(self.settings.interval / 4, 1.0)
        delay = max(delay, earliest - self._loop.time())
        self._reply_handle = self._loop.call_later(delay, self._reply)

    def _reply(self) -> None:
        self._reply_handle = None
        self._wake.set()  # the announce loop sends and restarts its interval

    # -- receiving ---------------------------------------------------------------

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        size = self.settings.max_datagram + 1  # one more: a longer datagram shows as oversize
        for _ in range(_RECV_BATCH):
            try:
                data, ancdata, _flags, addr = sock.recvmsg(size, socket.CMSG_SPACE(12))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.counters["recv_errors"] += 1
                log.debug("lan: recvmsg: %s", exc)
                return
            try:
                self._datagram(data, ancdata, addr)
            except Exception as exc:  # noqa: BLE001 - a datagram never breaks the loop
                self.counters["internal_errors"] += 1
                log.warning("lan: datagram from %s: %s: %s", addr, type(exc).__name__, exc)
                log.debug("lan: internal error", exc_info=True)
            if self._sock is None:
                return

    def _arrival(self, ancdata: list[tuple[int, int, bytes]]) -> tuple[int, ipaddress.IPv4Address] | None:
        for level, kind, payload in ancdata:
            if level == socket.IPPROTO_IP and kind == _IP_PKTINFO and len(payload) >= 12:
                index, _spec_dst, dst = struct.unpack_from("=i4s4s", payload)
                return index, ipaddress.IPv4Address(dst)
        return None

    def _datagram(self, data: bytes, ancdata: list[tuple[int, int, bytes]], addr: tuple[str, int]) -> None:
        self.counters["received"] += 1
        source_ip = addr[0]
        arrival = self._arrival(ancdata)
        if arrival is None:
            self.counters["no_pktinfo"] += 1
            return
        index, dst = arrival
        on_device = [i for i in self._ifaces if i.index == index]
        if not on_device:
            self.counters["other_interface"] += 1
            return
        if dst == self._group:
            via = "multicast"
        elif dst == _LIMITED_BROADCAST or any(dst == i.broadcast for i in on_device):
            via = "broadcast"
        else:
            self.counters["unicast"] += 1  # discovery is link-scoped: not addressed to the link
            return
        self.counters[f"received_{via}"] += 1
        loop_time = self._loop.time() if self._loop is not None else 0.0
        result = self.filter.receive(data, source_ip, self._clock(), clock=loop_time)
        if isinstance(result, Ignored):
            log.debug("lan: ignored datagram from %s via %s: %s %s", source_ip, via, result.reason, result.detail)
            if self._on_refuse is not None and result.reason not in NOT_REFUSALS:
                self._on_refuse(result.reason)
            return
        src = ipaddress.IPv4Address(source_ip)
        iface = next((i for i in on_device if src in i.network), on_device[0])
        did = result.check.did
        assert did is not None
        new = self._peer_seen(LanPeer(did, result.check, source_ip, iface, via, loop_time))
        if new:
            log.info("lan: found %s at %s on %s", did, source_ip, iface.name)
            self._schedule_reply()
        self._deliver(result, source_ip, iface)

    def _peer_seen(self, peer: LanPeer) -> bool:
        self._expire_peers()
        new = peer.did not in self._peers
        self._peers[peer.did] = peer
        self._peers.move_to_end(peer.did)
        while len(self._peers) > self.settings.max_peers:
            self._peers.popitem(last=False)
        return new

    def _expire_peers(self) -> None:
        if self._loop is None:
            return
        horizon = self._loop.time() - self.settings.max_age
        while self._peers:
            did, peer = next(iter(self._peers.items()))
            if peer.seen >= horizon:
                break
            del self._peers[did]

    def _deliver(self, result: Accepted, source_ip: str, iface: Interface) -> None:
        if self._on_peer is None:
            return
        try:
            outcome = self._on_peer(result, source_ip, iface)
        except Exception:
            self.counters["callback_errors"] += 1
            log.exception("lan: on_peer failed for %s", result.check.did)
            return
        if inspect.isawaitable(outcome) and self._loop is not None:
            task = self._loop.create_task(_await(outcome))
            self._callbacks.add(task)
            task.add_done_callback(self._callback_done)

    def _callback_done(self, task: asyncio.Task[Any]) -> None:
        self._callbacks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.counters["callback_errors"] += 1
            log.error("lan: on_peer failed", exc_info=exc)

    # -- introspection -----------------------------------------------------------

    def peers(self) -> dict[str, LanPeer]:
        """DIDs heard from within max_age, with their last accepted announce."""
        self._expire_peers()
        return dict(self._peers)

    def stats(self) -> dict[str, Any]:
        return {
            "port": self.settings.port,
            "mode": self.settings.mode,
            "group": str(self._group),
            "running": self.running,
            "interfaces": [{"name": i.name, "address": str(i.address), "network": str(i.network),
                            "broadcast": str(i.broadcast) if i.broadcast else None,
                            "multicast": i.index in self._joined}
                           for i in self._ifaces],
            "peers": len(self.peers()),
            **{k: v for k, v in sorted(self.counters.items())},
            "filter": self.filter.stats(),
        }


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
