"""The node's Kademlia DHT, hardened for a hostile network (asyncio).

`Dht` wraps the `kademlia` package's `Server` (2.2.3, over `rpcudp` 5.0.1) and
keeps its routing table and node lookup, but replaces every part that the
measurements in `kademlia-notes.md` showed unsafe:

- `HardenedProtocol` (a `KademliaProtocol`) parses each datagram itself,
  synchronously: garbage is counted, never logged with a traceback, never
  reaches the library. Every request argument (node id and key: 20 bytes;
  STORE value: bytes or text, size-capped) and every reply (node lists of
  at most k `(20-byte id, IP of the socket's family, port 1..65535)`, FIND_VALUE
  values size-capped) is checked before the library sees it; bad node entries
  are dropped one by one. The library closes its socket for good on a node
  entry with a bad address (a non-OSError from `sendto`), so no address that
  did not pass these checks is ever sent to.
- Replies are matched by message id *and* by the address the request went to.
  Pending calls are bounded, resolved on timeout, removed when the awaiting
  task is cancelled, and all resolved at `stop`.
- A node enters the routing table only once it has answered us: an unknown
  sender of a request is pinged first (a spoofed source cannot plant itself),
  one routing slot per (IP, port), at most `max_contacts_per_ip` per IP, a
  known id seen from another address is not re-homed. A contact is evicted
  after `max_failures` failed calls in a row (a malformed reply counts as
  one), not after one lost datagram.
- Storage (`RecordStore` behind kademlia's `IStorage`) keeps only verified
  signed records (`dhtrecords`), merges sets, enforces per-signer, per-IP,
  per-subnet and total caps, makes room in a full set or store by evicting
  from the source group that holds the most (a flood evicts itself), serves
  sets one record per source group first, holds others' records at most
  `max_hold` after their last STORE, and republishes nothing but this node's
  own records (the library republished everything it held every hour, letting
  a stale holder revert newer values). Every refused STORE is counted by
  reason (`refused_<reason>`) and reported to `on_refuse`.
- Reads verify every returned value and merge the answers of up to
  `read_quorum` replicas, keeping each replica's serving order
  (`merge_ranked`); a forged or stale value is discarded, never returned.
  Publishing counts the replicas whose STORE reply was `True`.
- The welcome hand-over of stored records to a new close node hashes the key
  once (the library hashed it twice, so it almost never handed anything over),
  and is bounded.
- A maintenance task pings silent contacts, refreshes buckets, re-bootstraps
  (configured addresses plus `add_bootstrap` ones, with bounded back-off) when
  the routing table empties, and re-binds the socket if it was ever closed.
- The republish task re-signs this node's records kept in memory (fresh
  `timestamp` and `expires`) every `republish_interval` and stores them again;
  the node therefore only calls `publish_peer` / `announce_topic` once per
  change. Those are few by design. Provider records of the
  node's containers are not among them: the node lists them on disk and calls
  `publish_provider` on its own schedule (a bounded list, a bounded rate), so
  nothing per container stays in memory.
- `save_state` / `load_state` (pickle) and the library's unvalidated
  `get` / `set` are disabled.

Not solved here (see docs/protocol.md): the Kademlia wire is neither
authenticated nor encrypted, so a node that can spoof source addresses or sees
the traffic can still disturb routing (not forge records); an attacker with as
many source groups (/24, /64) as a set has entries can crowd that set.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import umsgpack
from kademlia.crawling import NodeSpiderCrawl, SpiderCrawl
from kademlia.network import Server
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.storage import IStorage

from hmpnode.container.encoding import format_time, parse_time
from hmpnode.identity.keys import Identity, is_self_certifying_did
from hmpnode.net.announce import DEFAULT_MIN_DIFFICULTY
from hmpnode.net.dhtrecords import (
    DhtRecord,
    PeerRecord,
    RecordLimits,
    RecordStore,
    RecordTooLarge,
    StoreLimits,
    build_peer_record,
    build_provider_record,
    build_topic_record,
    decode_record_set,
    key_id,
    merge_ranked,
    peer_key,
    provider_key,
    topic_key,
)
from hmpnode.net.penalty import TokenBucket
from hmpnode.net.scope import is_loopback_ip

__all__ = ["Dht", "DhtLimits", "HardenedProtocol", "PeerRecord"]

log = logging.getLogger(__name__)

#: rpcudp refuses to send a request whose msgpack part is larger
MAX_REQUEST_BYTES = 8192
_HEADER = 21  # 0x00 | 0x01, then the 20-byte message id
_REQUEST_ARGS = {"ping": 1, "store": 3, "find_node": 2, "find_value": 2}
_MALFORMED = object()


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


#: binds a datagram endpoint: `loop.create_datagram_endpoint`'s signature (the simulator
#: passes its in-memory network's)
Endpoint = Callable[..., Awaitable[tuple[asyncio.DatagramTransport, asyncio.DatagramProtocol]]]


@dataclass(frozen=True, slots=True)
class DhtLimits:
    """Every bound of the DHT layer. Defaults suit the open Internet; tests shrink the times."""

    #: Kademlia k (bucket size, replicas per key, node-list length) and alpha (parallelism)
    ksize: int = 20
    alpha: int = 3
    #: seconds to wait for one reply
    rpc_timeout: float = 2.0
    #: seconds one lookup (node or value) may take in all, and its rounds at most
    lookup_timeout: float = 15.0
    max_lookup_rounds: int = 20
    #: a read stops after valid values from this many replicas (or when the lookup ends)
    read_quorum: int = 3
    #: failed calls in a row that evict a contact
    max_failures: int = 2
    #: routing-table contacts per IP address (0: no limit)
    max_contacts_per_ip: int = 8
    #: loopback sources (the nodes of this host, which share one address) are exempt
    #: from the per-IP contact cap and request budget
    exempt_loopback: bool = True
    #: unanswered requests in flight
    max_outstanding: int = 2048
    #: per source IP: bytes per second and burst of the request budget (0: no limit);
    #: each request costs `request_cost` plus the size of our reply
    request_rate: float = 64 * 1024
    request_burst: float = 128 * 1024
    request_cost: int = 256
    #: concurrent "is this unknown sender real?" pings
    max_verify_pings: int = 64
    #: records handed to one new close node, keys scanned for it, concurrent hand-overs
    max_welcome_records: int = 32
    max_welcome_scan: int = 1024
    max_welcome_tasks: int = 4
    #: remembered bootstrap addresses
    max_bootstrap_addrs: int = 64
    #: seconds between maintenance rounds
    maintenance_interval: float = 10.0
    #: ping contacts not heard from for this long (seconds), at most ping_batch per round
    ping_after: float = 300.0
    ping_batch: int = 8
    #: re-bootstrap back-off when the routing table is empty (seconds)
    rebootstrap_min: float = 5.0
    rebootstrap_max: float = 300.0
    #: seconds between bucket refreshes (a lookup of our own id and of lonely buckets)
    refresh_interval: float = 900.0
    #: seconds between re-signing and storing our own records again (0: never)
    republish_interval: float = 1800.0
    #: lifetime of the records we sign
    record_ttl: timedelta = timedelta(hours=2)
    #: the node's containers that have a provider record at one time: the newest unscoped
    #: broadcasts of its agent. Replicas hold at most `store.max_per_signer` (64) records
    #: of one signer, so a network of N nodes keeps about 64 * N / ksize of them anyway
    max_provided: int = 1024
    #: provider records signed and stored per second at most (first publish and
    #: republish alike), saved up to `provide_burst`: a republish round is spread over
    #: about max_provided / provide_rate seconds, not one burst
    provide_rate: float = 2.0
    provide_burst: float = 32.0
    records: RecordLimits = field(default_factory=RecordLimits)
    store: StoreLimits = field(default_factory=StoreLimits)

    def __post_init__(self) -> None:
        for name in ("ksize", "alpha", "read_quorum", "max_failures", "max_outstanding", "ping_batch",
                     "max_lookup_rounds", "max_provided"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("rpc_timeout", "lookup_timeout", "maintenance_interval", "rebootstrap_min", "provide_rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.provide_burst < 1:
            raise ValueError("provide_burst must be >= 1")
        if self.rebootstrap_max < self.rebootstrap_min:
            raise ValueError("rebootstrap_max must be >= rebootstrap_min")
        if not timedelta(0) < self.record_ttl <= self.records.max_lifetime:
            raise ValueError("record_ttl must be in (0, records.max_lifetime]")
        if self.republish_interval and timedelta(seconds=self.republish_interval) >= self.record_ttl:
            raise ValueError("republish_interval must be shorter than record_ttl")
        if self.republish_interval and timedelta(seconds=self.republish_interval) >= self.store.max_hold:
            raise ValueError("republish_interval must be shorter than store.max_hold (others drop our records)")




def _is_id(value: Any) -> bool:
    return type(value) is bytes and len(value) == 20


class _Budget:
    """Token buckets per source IP (bytes): bounds the work and the reply bytes one
    address can draw from us, so the node is a poor reflector for spoofed requests
    (a 50-byte FIND_VALUE can otherwise draw an 8 KiB reply)."""

    def __init__(self, rate: float, burst: float, max_ips: int = 4096):
        self.rate, self.burst, self.max_ips = rate, burst, max_ips
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, ip: str, cost: float, now: float, *, force: bool = False) -> bool:
        """Debit `cost`; False (and nothing debited) if the bucket cannot cover it,
        unless `force` (a debit into the negative for a reply already decided)."""
        if not self.rate:
            return True
        bucket = self._buckets.get(ip)
        if bucket is None:
            if len(self._buckets) >= self.max_ips:
                self._buckets.clear()  # bounded memory; forgetting only grants a fresh burst
            bucket = self._buckets[ip] = TokenBucket(self.rate, self.burst)
        return bucket.take(now, cost, force=force)


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    timer: asyncio.TimerHandle
    address: tuple[str, int]
    method: str


class _Storage(IStorage):
    """kademlia's storage interface over a `RecordStore`: every write is verified.

    `get` returns the FIND_VALUE reply value (a JSON array of records); `__iter__`
    yields single records (one STORE each); `iter_older_than` yields only this
    node's own records, so nothing else is ever republished."""

    def __init__(self, store: RecordStore, clock: Callable[[], datetime], counters: Counter[str],
                 refuse: Callable[[str], None]):
        self.store_ = store
        self.clock = clock
        self.counters = counters
        self.refuse = refuse

    def __bool__(self) -> bool:  # Server.__init__ does `storage or ForgetfulStorage()`
        return True

    def store(self, key: bytes, value: Any, *, source: str | None) -> bool:
        result = self.store_.put(key, value, now=self.clock(), source=source)
        if result.accepted:
            self.counters["accepted_values"] += 1
            self.counters["evicted_records"] += result.evicted
        else:
            self.counters["refused_values"] += 1
            self.refuse(result.reason or "refused")
        return result.accepted

    def __setitem__(self, key: bytes, value: Any) -> None:
        self.store(key, value, source=None)

    def __getitem__(self, key: bytes) -> bytes:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: bytes, default: Any = None) -> Any:
        value = self.store_.reply_value(key, now=self.clock())
        return default if value is None else value

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, bytes]]:
        return self.store_.own_older_than(self.clock() - timedelta(seconds=seconds_old))

    def __iter__(self):
        return iter([(kid, rec.raw) for kid, rec in self.store_.records(now=self.clock())])

    def keys(self) -> list[bytes]:
        return self.store_.keys()

    def raw_records(self, key: bytes) -> list[bytes]:
        return [rec.raw for rec in self.store_.get(key, now=self.clock())]


class HardenedProtocol(KademliaProtocol):
    """`KademliaProtocol` whose every input is checked before use (module docstring).

    Results of calls are `(True, value)` or `(False, None)` as in rpcudp; a node-list
    reply from which entries were dropped is `(True, nodes, dropped)`, so that
    `handle_call_response` can count it against the peer."""

    def __init__(
        self, source_node: Node, storage: _Storage, ksize: int, *, limits: DhtLimits, counters: Counter[str],
        family: int, refuse: Callable[..., None], rng: Callable[[int], bytes] = os.urandom,
    ):
        super().__init__(source_node, storage, ksize)
        self._rng = rng
        self._wait_timeout = limits.rpc_timeout
        self.limits = limits
        self.counters = counters
        self.family = family
        self.refuse = refuse
        self.own_address: tuple[str, int] | None = None
        self.closed = False
        self._outstanding: dict[bytes, _Pending] = {}
        self._failures: dict[bytes, int] = {}
        self._last_seen: dict[bytes, float] = {}
        self._verifying: set[bytes] = set()
        self._welcome_busy = 0
        #: in start order (a set would cancel them in address order: a simulated run must replay)
        self._tasks: dict[asyncio.Task[Any], None] = {}
        self._logged_internal_error = False
        self._budget = _Budget(limits.request_rate, limits.request_burst)
        self.max_datagram = _HEADER + max(MAX_REQUEST_BYTES, limits.store.max_set_bytes + 512)

    def __getattr__(self, name: str) -> Any:
        # rpcudp turns any unknown attribute into a remote call; here a typo is an error.
        raise AttributeError(name)

    # -- addresses ---------------------------------------------------------

    def check_ip(self, ip: Any) -> str | None:
        """The canonical text of `ip` if it is an address we may send to, else None."""
        if type(ip) is not str or not 2 <= len(ip) <= 45 or "%" in ip:
            return None
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return None
        if addr.version != self.family or addr.is_unspecified or addr.is_multicast:
            return None
        if addr.version == 4 and addr.is_reserved:  # 240/4 and the limited broadcast address
            return None
        return str(addr)

    def check_address(self, address: Any) -> tuple[str, int] | None:
        if not isinstance(address, (tuple, list)) or len(address) < 2:
            return None
        ip, port = self.check_ip(address[0]), address[1]
        if ip is None or type(port) is not int or not 1 <= port <= 65535:
            return None
        return ip, port

    # -- inbound -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.abort_pending()

    def error_received(self, exc: Exception) -> None:
        # ICMP errors and failed sends: expected on a real network, counted only.
        self.counters["socket_errors"] += 1

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            self._datagram(data, addr)
        except Exception:  # our bug, not the sender's fault; the socket must survive it
            self.counters["internal_errors"] += 1
            log.warning("DHT: internal error handling a datagram", exc_info=not self._logged_internal_error)
            self._logged_internal_error = True

    def _datagram(self, data: bytes, addr: Any) -> None:
        if self.closed:
            return
        peer = self.check_address(addr)
        if peer is None or not _HEADER < len(data) <= self.max_datagram or data[0] > 1:
            self.counters["garbage_datagrams"] += 1
            return
        msg_id = bytes(data[1:_HEADER])
        try:
            message = umsgpack.unpackb(data[_HEADER:])
        except Exception:  # UnpackException, RecursionError, ...: garbage
            self.counters["garbage_datagrams"] += 1
            return
        if data[0] == 0:
            self._on_request(msg_id, message, peer)
        else:
            self._on_reply(msg_id, message, peer)

    def _on_request(self, msg_id: bytes, message: Any, peer: tuple[str, int]) -> None:
        if not (
            type(message) is list and len(message) == 2 and type(message[0]) is str and type(message[1]) is list
        ):
            self.counters["dropped_malformed_rpc"] += 1
            return
        name, args = message
        if (
            _REQUEST_ARGS.get(name) != len(args)
            or not _is_id(args[0])
            or args[0] == self.source_node.id
            or (name != "ping" and not _is_id(args[1]))
        ):
            self.counters["dropped_malformed_rpc"] += 1
            return
        now = asyncio.get_running_loop().time()
        local = self.limits.exempt_loopback and is_loopback_ip(peer[0])  # this host's nodes share one address
        if not local and not self._budget.take(peer[0], self.limits.request_cost, now):
            self.counters["rate_limited"] += 1
            self.refuse("rate_limited", counted=True)
            return
        self.counters[f"served_{name}"] += 1
        response = getattr(self, f"rpc_{name}")(peer, *args)
        reply = b"\x01" + msg_id + umsgpack.packb(response)
        if not local:
            self._budget.take(peer[0], len(reply), now, force=True)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, peer)
        self._heard_from(Node(args[0], peer[0], peer[1]))

    # The rpc_* handlers get checked arguments (see _on_request); they do not welcome
    # the sender themselves: _heard_from does, after a liveness check.

    def rpc_ping(self, sender: tuple[str, int], nodeid: bytes) -> bytes:
        return self.source_node.id

    def rpc_store(self, sender: tuple[str, int], nodeid: bytes, key: bytes, value: Any) -> bool:
        return self.storage.store(key, value, source=sender[0])

    def rpc_find_node(self, sender: tuple[str, int], nodeid: bytes, key: bytes) -> list[tuple[bytes, str, int]]:
        source = Node(nodeid, sender[0], sender[1])
        return [tuple(n) for n in self.router.find_neighbors(Node(key), exclude=source)]  # type: ignore[misc]

    def rpc_find_value(self, sender: tuple[str, int], nodeid: bytes, key: bytes) -> Any:
        value = self.storage.get(key)
        if value is None:
            return self.rpc_find_node(sender, nodeid, key)
        return {"value": value}

    def _on_reply(self, msg_id: bytes, message: Any, peer: tuple[str, int]) -> None:
        pending = self._outstanding.get(msg_id)
        if pending is None:
            self.counters["unknown_replies"] += 1
            return
        if pending.address != peer:
            # Not from where the request went: ignore it and keep waiting for the real one.
            self.counters["mismatched_replies"] += 1
            return
        del self._outstanding[msg_id]
        pending.timer.cancel()
        if pending.future.done():
            return
        checked = self._check_reply(pending.method, message)
        if checked is _MALFORMED:
            self.counters["dropped_malformed_reply"] += 1
            pending.future.set_result((False, None))
        else:
            pending.future.set_result(checked)

    def _check_reply(self, method: str, message: Any) -> Any:
        if method == "ping":
            return (True, message) if _is_id(message) and message != self.source_node.id else _MALFORMED
        if method == "store":
            return (True, message) if type(message) is bool else _MALFORMED
        if method == "find_value" and type(message) is dict:
            value = message.get("value")
            if len(message) != 1 or type(value) not in (bytes, str):
                return _MALFORMED
            size = len(value) if type(value) is bytes else len(value.encode("utf-8", "surrogatepass"))
            return (True, message) if size <= self.limits.store.max_set_bytes else _MALFORMED
        return self._check_nodes(message)

    def _check_nodes(self, message: Any) -> Any:
        if type(message) is not list:
            return _MALFORMED
        k = self.router.ksize
        dropped = max(0, len(message) - k)
        nodes: list[tuple[bytes, str, int]] = []
        seen: set[bytes] = set()
        for entry in message[:k]:
            node = self._check_node(entry)
            if node is None or node[0] in seen:
                dropped += 1
            else:
                seen.add(node[0])
                nodes.append(node)
        if dropped:
            self.counters["dropped_node_entries"] += dropped
            return (True, nodes, dropped)
        return (True, nodes)

    def _check_node(self, entry: Any) -> tuple[bytes, str, int] | None:
        if type(entry) is not list or len(entry) != 3 or not _is_id(entry[0]) or entry[0] == self.source_node.id:
            return None
        address = self.check_address(entry[1:])
        if address is None or address == self.own_address:
            return None
        return (entry[0], *address)

    # -- outbound ----------------------------------------------------------

    def _call(self, address: Any, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send one request; the future resolves to `(True, value)` or `(False, None)`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        target = self.check_address(address)
        if target is None or self.closed or self.transport is None or self.transport.is_closing():
            self.counters["calls_not_sent"] += 1
            future.set_result((False, None))
            return future
        if len(self._outstanding) >= self.limits.max_outstanding:
            self.counters["calls_overloaded"] += 1
            future.set_result((False, None))
            return future
        body = umsgpack.packb([method, list(args)])
        if len(body) > MAX_REQUEST_BYTES:
            self.counters["calls_not_sent"] += 1
            future.set_result((False, None))
            return future
        msg_id = self._rng(20)
        timer = loop.call_later(self._wait_timeout, self._timeout, msg_id)
        self._outstanding[msg_id] = _Pending(future, timer, target, method)
        future.add_done_callback(lambda f, m=msg_id: self._forget(m) if f.cancelled() else None)
        self.transport.sendto(b"\x00" + msg_id + body, target)
        return future

    def ping(self, address: Any, nodeid: bytes) -> asyncio.Future[Any]:
        return self._call(address, "ping", (nodeid,))

    def store(self, address: Any, nodeid: bytes, key: bytes, value: Any) -> asyncio.Future[Any]:
        return self._call(address, "store", (nodeid, key, value))

    def find_node(self, address: Any, nodeid: bytes, key: bytes) -> asyncio.Future[Any]:
        return self._call(address, "find_node", (nodeid, key))

    def find_value(self, address: Any, nodeid: bytes, key: bytes) -> asyncio.Future[Any]:
        return self._call(address, "find_value", (nodeid, key))

    def _timeout(self, msg_id: bytes) -> None:
        pending = self._outstanding.pop(msg_id, None)
        if pending is not None and not pending.future.done():
            self.counters["rpc_timeouts"] += 1
            pending.future.set_result((False, None))

    def _forget(self, msg_id: bytes) -> None:
        # The awaiting task was cancelled: drop the entry instead of leaking it.
        pending = self._outstanding.pop(msg_id, None)
        if pending is not None:
            pending.timer.cancel()
            self.counters["cancelled_calls"] += 1

    def abort_pending(self) -> None:
        """Resolve every pending call as unanswered (the socket is gone)."""
        pending, self._outstanding = self._outstanding, {}
        for entry in pending.values():
            entry.timer.cancel()
            if not entry.future.done():
                entry.future.set_result((False, None))

    def pending_calls(self) -> int:
        return len(self._outstanding)

    async def call_ping(self, node_to_ask: Node) -> Any:
        result = await self.ping((node_to_ask.ip, node_to_ask.port), self.source_node.id)
        if result[0] and result[1] != node_to_ask.id:
            # Another node now answers at that address (a restart with a new id):
            # the old contact is gone, the new one is alive.
            self._evict(node_to_ask)
            self.welcome_if_new(Node(result[1], node_to_ask.ip, node_to_ask.port))
            return (False, None)
        return self.handle_call_response(result, node_to_ask)

    # -- routing table -----------------------------------------------------

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks[task] = None
        task.add_done_callback(lambda done: self._tasks.pop(done, None))

    async def close(self) -> None:
        self.closed = True
        self.abort_pending()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def contact(self, node_id: bytes) -> Node | None:
        bucket = self.router.buckets[self.router.get_bucket_for(Node(node_id))]
        return bucket.nodes.get(node_id)

    def contacts(self) -> list[Node]:
        return [n for bucket in self.router.buckets for n in bucket.nodes.values()]

    def last_seen(self, node_id: bytes) -> float:
        return self._last_seen.get(node_id, 0.0)

    def _heard_from(self, sender: Node) -> None:
        """A request came from `sender`: refresh it if known at that address, else
        check that it really answers there before it may enter the table."""
        known = self.contact(sender.id)
        if known is not None:
            if known.same_home_as(sender):
                self.router.add_contact(known)
                self._last_seen[sender.id] = asyncio.get_running_loop().time()
            return
        if sender.id in self._verifying or len(self._verifying) >= self.limits.max_verify_pings:
            return
        self._verifying.add(sender.id)
        self.spawn(self._verify(sender))

    async def _verify(self, node: Node) -> None:
        try:
            ok, node_id = await self.ping((node.ip, node.port), self.source_node.id)
            if ok and node_id == node.id:
                self.welcome_if_new(node)
        finally:
            self._verifying.discard(node.id)

    def welcome_if_new(self, node: Node) -> None:
        """Add a node that answered us; hand it the records it should hold.

        Unlike the library: the key is hashed once (the library's `digest(key)` of an
        id made hand-overs nearly never happen); a known id keeps its address; one
        slot per (IP, port) and at most `max_contacts_per_ip` per IP; the hand-over
        is bounded."""
        if self.closed or node.id == self.source_node.id:
            return
        now = asyncio.get_running_loop().time()
        known = self.contact(node.id)
        if known is not None:
            if known.same_home_as(node):
                self.router.add_contact(known)
                self._last_seen[node.id] = now
            return
        same_ip = 0
        for other in self.contacts():
            if other.same_home_as(node):
                self._evict(other)  # the address now belongs to another id
            elif other.ip == node.ip:
                same_ip += 1
        if self.limits.max_contacts_per_ip and same_ip >= self.limits.max_contacts_per_ip and not (
                self.limits.exempt_loopback and is_loopback_ip(node.ip)):
            self.counters["refused_contacts"] += 1
            self.refuse("contacts_per_ip", counted=True)
            return
        handover = self._handover_for(node)
        self.router.add_contact(node)
        if self.contact(node.id) is None:
            return  # bucket full: in the replacement list only
        self._last_seen[node.id] = now
        if handover:
            self.spawn(self._hand_over(node, handover))

    def _handover_for(self, node: Node) -> list[tuple[bytes, bytes]]:
        if self._welcome_busy >= self.limits.max_welcome_tasks:
            return []
        out: list[tuple[bytes, bytes]] = []
        for index, kid in enumerate(self.storage.keys()):
            if index >= self.limits.max_welcome_scan or len(out) >= self.limits.max_welcome_records:
                break
            keynode = Node(kid)
            neighbours = self.router.find_neighbors(keynode)
            if neighbours:
                newcomer_close = (
                    len(neighbours) < self.router.ksize
                    or node.distance_to(keynode) < neighbours[-1].distance_to(keynode)
                )
                we_closest = self.source_node.distance_to(keynode) < neighbours[0].distance_to(keynode)
                if not (newcomer_close and we_closest):
                    continue
            out.extend((kid, raw) for raw in self.storage.raw_records(kid))
        return out[: self.limits.max_welcome_records]

    async def _hand_over(self, node: Node, records: list[tuple[bytes, bytes]]) -> None:
        self._welcome_busy += 1
        try:
            self.counters["handed_over"] += len(records)
            await asyncio.gather(*(self.call_store(node, kid, raw) for kid, raw in records))
        finally:
            self._welcome_busy -= 1

    def handle_call_response(self, result: Any, node: Node) -> Any:
        """Welcome a node that answered; count a failure (or a malformed reply) against it
        and evict it after `max_failures` in a row."""
        if not result[0] or len(result) > 2:
            # No reply, or a node list with bad entries (its good entries still serve
            # the lookup): a strike, and no refresh of the contact.
            self._failed(node)
            return result
        self._failures.pop(node.id, None)
        self.welcome_if_new(node)
        return result

    def _failed(self, node: Node) -> None:
        known = self.contact(node.id)
        if known is None or not known.same_home_as(node):
            return
        count = self._failures.get(node.id, 0) + 1
        if count >= self.limits.max_failures:
            self._evict(known)
        else:
            self._failures[node.id] = count

    def _evict(self, node: Node) -> None:
        self.router.remove_contact(node)
        self._failures.pop(node.id, None)
        self._last_seen.pop(node.id, None)
        self.counters["evicted_contacts"] += 1


class _NodeCrawl(NodeSpiderCrawl):
    """The library's node lookup, bounded to `max_rounds` rounds: it recurses once per
    round, and a peer feeding ever new (fake) closer ids would otherwise drive it to
    the recursion limit before the lookup deadline."""

    def __init__(self, *args: Any, max_rounds: int):
        super().__init__(*args)
        self.max_rounds = max_rounds
        self.rounds = 0

    async def find(self) -> list[Node]:
        self.rounds += 1
        if self.rounds > self.max_rounds:
            return list(self.nearest)
        return await super().find()


class _ValueCrawl(SpiderCrawl):
    """A FIND_VALUE lookup that validates each value (`accept`) and merges those of up
    to `quorum` replicas instead of returning the first one it sees (the library's
    `ValueSpiderCrawl` also crashed on list or dict values and stored the value it
    picked back onto the network unverified)."""

    def __init__(
        self, protocol: HardenedProtocol, node: Node, peers: list[Node], ksize: int, alpha: int,
        accept: Callable[[Any], list[DhtRecord]], quorum: int, max_rounds: int,
    ):
        super().__init__(protocol, node, peers, ksize, alpha)
        self.accept = accept
        self.quorum = quorum
        self.max_rounds = max_rounds
        self.rounds = 0
        #: the valid records of each holder's answer, in its serving order
        self.answers: list[list[DhtRecord]] = []

    async def find(self) -> list[list[DhtRecord]]:
        self.rounds += 1
        if self.rounds > self.max_rounds:
            return self.answers
        return await self._find(self.protocol.call_find_value)

    async def _nodes_found(self, responses: dict[bytes, Any]) -> list[list[DhtRecord]]:
        gone = []
        for peer_id, response in responses.items():
            if not response[0]:
                gone.append(peer_id)
            elif type(response[1]) is dict:
                found = self.accept(response[1]["value"])
                if found:
                    self.answers.append(found)
            else:
                self.nearest.push([Node(*entry) for entry in response[1]])
        self.nearest.remove(gone)
        if len(self.answers) >= self.quorum or self.nearest.have_contacted_all():
            return self.answers
        return await self.find()


class _Server(Server):
    """kademlia's `Server` with the hardened protocol; its unsafe entry points are closed."""

    def __init__(self, *, ksize: int, alpha: int, node_id: bytes, storage: _Storage,
                 protocol_factory: Callable[[Node, _Storage, int], HardenedProtocol], max_rounds: int):
        super().__init__(ksize=ksize, alpha=alpha, node_id=node_id, storage=storage)
        self._protocol_factory = protocol_factory
        self.max_rounds = max_rounds

    def _create_protocol(self) -> HardenedProtocol:
        return self._protocol_factory(self.node, self.storage, self.ksize)

    async def bootstrap(self, addrs: list[tuple[str, int]]) -> list[Node]:
        """Ping `addrs` (checked IP literals), then look up our own id from those that
        answered (the library's, with the bounded crawl)."""
        answered = await asyncio.gather(*(self.bootstrap_node(addr) for addr in addrs))
        nodes = [node for node in answered if node is not None]
        spider = _NodeCrawl(self.protocol, self.node, nodes, self.ksize, self.alpha, max_rounds=self.max_rounds)
        return await spider.find()

    def refresh_table(self, interval: int = 3600) -> None:
        """Disabled: it republished every stored value; `Dht` maintains the table itself."""

    async def get(self, key: Any) -> Any:
        raise NotImplementedError("Server.get returns unvalidated values; use Dht")

    async def set(self, key: Any, value: Any) -> Any:
        raise NotImplementedError("Server.set stores unvalidated values; use Dht")

    async def set_digest(self, dkey: bytes, value: Any) -> Any:
        raise NotImplementedError("use Dht")

    def save_state(self, fname: Any) -> None:
        raise NotImplementedError("pickle state files are never written nor read")

    def save_state_regularly(self, fname: Any, frequency: int = 600) -> None:
        raise NotImplementedError("pickle state files are never written nor read")

    @classmethod
    async def load_state(cls, fname: Any, port: int, interface: str = "0.0.0.0") -> Any:
        raise NotImplementedError("pickle state files are never written nor read")


class Dht:
    """This node's DHT: publish and find signed peer, provider and topic records.

    `host` is the interface to bind (an IP literal; its family is the DHT's family).
    `clock` gives the time records are signed and checked at. Randomness (the node
    id, the request message ids) comes from `rng`. `endpoint` binds the socket
    (default: the running loop's `create_datagram_endpoint`; the simulator binds to
    its in-memory network). Reads never raise on what the network returns.
    `on_refuse(reason)` is told of every refusal (a STORE refused by reason,
    `rate_limited`, `contacts_per_ip`), e.g. `node.refuse("dht", reason)`."""

    def __init__(
        self,
        identity: Identity,
        *,
        host: str,
        port: int,
        min_difficulty: int = DEFAULT_MIN_DIFFICULTY,
        clock: Callable[[], datetime] = _utc_now,
        limits: DhtLimits = DhtLimits(),
        rng: Callable[[int], bytes] = os.urandom,
        on_refuse: Callable[[str], None] | None = None,
        endpoint: Endpoint | None = None,
    ):
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"host must be an IP address literal, not {host!r:.60}") from None
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError("port must be 0..65535")
        if type(min_difficulty) is not int or not 0 <= min_difficulty <= 64:
            raise ValueError("min_difficulty must be an int in 0..64")
        self.identity = identity
        self.host = str(address)
        self.port = port
        self.family = address.version
        self.min_difficulty = min_difficulty
        self.limits = limits

        def aware_clock() -> datetime:  # a naive clock reads as UTC, never a TypeError mid-datagram
            moment = clock()
            return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)

        self._clock = aware_clock
        self._rng = rng
        self._endpoint = endpoint
        self._counters: Counter[str] = Counter()
        #: addresses the last peer record left out (said again only when they change)
        self._left_out: tuple[Any, ...] = ()
        self._on_refuse = on_refuse
        self._store = RecordStore(
            own_did=identity.did, min_difficulty=min_difficulty, record_limits=limits.records, limits=limits.store
        )
        self._storage = _Storage(self._store, aware_clock, self._counters, self._refuse)
        self._server: _Server | None = None
        self._protocol: HardenedProtocol | None = None
        self._bootstrap: list[tuple[str, int]] = []
        self._own: dict[str, Callable[[datetime], bytes]] = {}
        self._last_stamp: dict[str, datetime] = {}
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def did(self) -> str:
        return self.identity.did

    def _refuse(self, reason: str, *, counted: bool = False) -> None:
        """Count a refusal as `refused_<reason>` (unless the caller keeps its own
        counter) and tell `on_refuse`; `reason` is one of our own codes."""
        if not counted:
            self._counters[f"refused_{reason}"] += 1
        if self._on_refuse is not None:
            try:
                self._on_refuse(reason)
            except Exception:  # a counter must never break a datagram handler
                self._counters["internal_errors"] += 1
                log.exception("DHT refusal callback failed")

    @property
    def node_id(self) -> bytes | None:
        return self._server.node.id if self._server is not None else None

    # -- life cycle --------------------------------------------------------

    async def start(self, bootstrap: Sequence[tuple[str, int]] = ()) -> None:
        """Bind the socket, join through `bootstrap` (remembered for re-bootstrap), start
        the maintenance and republish tasks. OSError if the address cannot be bound."""
        if self._server is not None:
            raise RuntimeError("Dht already started")
        self._remember(bootstrap)  # ValueError before anything is bound
        limits = self.limits

        def make_protocol(node: Node, storage: _Storage, ksize: int) -> HardenedProtocol:
            return HardenedProtocol(node, storage, ksize, limits=limits, counters=self._counters, family=self.family,
                                    refuse=self._refuse, rng=self._rng)

        node_id = self._rng(20)
        if len(node_id) != 20:
            raise ValueError("rng(20) must return 20 bytes")
        server = _Server(
            ksize=limits.ksize, alpha=limits.alpha, node_id=node_id, storage=self._storage,
            protocol_factory=make_protocol, max_rounds=limits.max_lookup_rounds,
        )
        protocol = server._create_protocol()
        transport = await self._bind(protocol)
        server.transport, server.protocol = transport, protocol
        self.port = transport.get_extra_info("sockname")[1]
        protocol.own_address = (self.host, self.port)
        self._server, self._protocol = server, protocol
        log.info("DHT listening on %s port %d", self.host, self.port)
        self._tasks = [asyncio.ensure_future(self._maintain())]
        if limits.republish_interval:
            self._tasks.append(asyncio.ensure_future(self._republish_loop()))
        if self._bootstrap:  # these, and any given to add_bootstrap before start
            await self._join(list(self._bootstrap))

    async def stop(self) -> None:
        """Stop the tasks, resolve pending calls, close the socket. Idempotent."""
        server, protocol = self._server, self._protocol
        if server is None or protocol is None:
            return
        self._server = self._protocol = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await protocol.close()
        server.stop()
        await asyncio.sleep(0)  # let the transport call connection_lost

    async def add_bootstrap(self, addrs: Sequence[tuple[str, int]]) -> None:
        """Remember `addrs` (e.g. peers found on the LAN) for re-bootstrapping, and join
        through those not given before. Hosts may be IP literals or names (resolved each time)."""
        known = set(self._bootstrap)
        fresh = [a for a in self._remember(addrs) if a not in known]
        if fresh and self._server is not None:
            await self._join(fresh)  # only through addresses not given before: a join is a lookup

    def _remember(self, addrs: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Validate all of `addrs` (ValueError, nothing kept), then keep them, newest last."""
        fresh: list[tuple[str, int]] = []
        for addr in addrs:
            if (
                not isinstance(addr, (tuple, list)) or len(addr) != 2 or not isinstance(addr[0], str)
                or not 1 <= len(addr[0]) <= 253 or type(addr[1]) is not int or not 1 <= addr[1] <= 65535
            ):
                raise ValueError(f"bootstrap address must be (host, port): {addr!r:.80}")
            if (addr[0], addr[1]) not in fresh:
                fresh.append((addr[0], addr[1]))
        for item in fresh:
            if item in self._bootstrap:
                self._bootstrap.remove(item)
            self._bootstrap.append(item)
        del self._bootstrap[: max(0, len(self._bootstrap) - self.limits.max_bootstrap_addrs)]
        return fresh

    async def _resolve(self, addrs: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        protocol = self._protocol
        assert protocol is not None
        out: list[tuple[str, int]] = []
        loop = asyncio.get_running_loop()
        family = socket.AF_INET if self.family == 4 else socket.AF_INET6
        for host, port in addrs:
            literal = protocol.check_address((host, port))
            candidates: list[tuple[str, int]] = []
            if literal is not None:
                candidates = [literal]
            else:
                try:
                    infos = await asyncio.wait_for(
                        loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM), self.limits.rpc_timeout
                    )
                except (OSError, asyncio.TimeoutError, UnicodeError, ValueError):
                    self._counters["unresolved_bootstrap"] += 1
                    continue
                for info in infos[:4]:
                    checked = protocol.check_address((info[4][0], port))
                    if checked is not None:
                        candidates.append(checked)
            out.extend(c for c in candidates if c != protocol.own_address and c not in out)
        return out

    async def _join(self, addrs: Sequence[tuple[str, int]]) -> None:
        server = self._server
        if server is None:
            return
        resolved = await self._resolve(addrs)
        if not resolved:
            return
        self._counters["bootstraps"] += 1
        try:
            await asyncio.wait_for(server.bootstrap(resolved), self.limits.lookup_timeout)
        except asyncio.TimeoutError:
            self._counters["lookup_timeouts"] += 1

    # -- maintenance -------------------------------------------------------

    async def _maintain(self) -> None:
        """Every `maintenance_interval`: re-bind a lost socket; re-bootstrap an empty
        table (back-off from rebootstrap_min doubling to rebootstrap_max); otherwise
        ping silent contacts and, every `refresh_interval`, refresh the buckets."""
        loop = asyncio.get_running_loop()
        backoff = self.limits.rebootstrap_min
        next_join = 0.0
        next_refresh = loop.time() + self.limits.refresh_interval
        while True:
            await asyncio.sleep(self.limits.maintenance_interval)
            try:
                if self._protocol is not None and self._protocol.transport is None:
                    await self._relisten()
                now = loop.time()
                if self.routing_size() == 0:
                    if self._bootstrap and now >= next_join:
                        self._counters["rebootstraps"] += 1
                        await self._join(self._bootstrap)
                        backoff = (
                            self.limits.rebootstrap_min if self.routing_size()
                            else min(backoff * 2, self.limits.rebootstrap_max)
                        )
                        next_join = loop.time() + backoff
                    continue
                backoff, next_join = self.limits.rebootstrap_min, 0.0
                await self._ping_silent()
                if now >= next_refresh:
                    next_refresh = now + self.limits.refresh_interval
                    await self._refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._counters["internal_errors"] += 1
                log.exception("DHT maintenance round failed")

    async def _bind(self, protocol: HardenedProtocol) -> asyncio.DatagramTransport:
        endpoint = self._endpoint or asyncio.get_running_loop().create_datagram_endpoint
        transport, _ = await endpoint(lambda: protocol, local_addr=(self.host, self.port))
        return transport

    async def _relisten(self) -> None:
        protocol, server = self._protocol, self._server
        assert protocol is not None and server is not None
        server.transport = await self._bind(protocol)
        self._counters["relistens"] += 1
        log.warning("DHT socket was closed; bound %s port %d again", self.host, self.port)

    async def _ping_silent(self) -> None:
        protocol = self._protocol
        if protocol is None:
            return
        now = asyncio.get_running_loop().time()
        silent = [n for n in protocol.contacts() if now - protocol.last_seen(n.id) >= self.limits.ping_after]
        silent.sort(key=lambda n: protocol.last_seen(n.id))
        await asyncio.gather(*(protocol.call_ping(n) for n in silent[: self.limits.ping_batch]))

    async def _refresh(self) -> None:
        protocol, server = self._protocol, self._server
        if protocol is None or server is None:
            return
        # our own id (keeps our neighbourhood fresh) and a random id in each lonely bucket
        targets = [Node(server.node.id)] + [Node(i) for i in protocol.get_refresh_ids()]
        for target in targets[:8]:
            await self._closest(target)

    async def _republish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.republish_interval)
            for key in list(self._own):
                try:
                    await self._publish_own(key)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self._counters["internal_errors"] += 1
                    log.exception("DHT republish of %s failed", key[:80])

    # -- publishing --------------------------------------------------------

    def _stamp(self, key: str) -> datetime:
        """Signing time for a record of `key`: the clock, truncated to milliseconds as
        emitted, but always after the previous one (so the new record wins)."""
        stamp = parse_time(format_time(self._clock()))
        last = self._last_stamp.get(key)
        if last is not None and stamp <= last:
            stamp = last + timedelta(milliseconds=1)
        self._last_stamp[key] = stamp
        return stamp

    async def _publish_own(self, key: str) -> int:
        builder = self._own.get(key)
        if builder is None:
            return 0
        return await self._publish(key, builder(self._stamp(key)))

    async def _publish(self, key: str, raw: bytes) -> int:
        kid = key_id(key)
        self._storage.store(kid, raw, source=None)  # we answer for our own records too
        protocol = self._protocol
        if protocol is None:
            return 0
        nodes = await self._closest(Node(kid))
        if not nodes:
            return 0
        results = await asyncio.gather(*(protocol.call_store(n, kid, raw) for n in nodes))
        accepted = sum(1 for r in results if r[0] and r[1] is True)
        self._counters["store_replicas"] += accepted
        return accepted

    async def _closest(self, target: Node) -> list[Node]:
        protocol = self._protocol
        if protocol is None:
            return []
        nearest = protocol.router.find_neighbors(target)
        if not nearest:
            return []
        spider = _NodeCrawl(
            protocol, target, nearest, self.limits.ksize, self.limits.alpha, max_rounds=self.limits.max_lookup_rounds
        )
        try:
            return await asyncio.wait_for(spider.find(), self.limits.lookup_timeout)
        except asyncio.TimeoutError:
            self._counters["lookup_timeouts"] += 1
            return list(spider.nearest)

    def _register(self, key: str, builder: Callable[[datetime], bytes]) -> bytes:
        raw = builder(self._stamp(key))  # raises ValueError on bad input, before anything is kept
        self._own[key] = builder
        return raw

    async def publish_peer(
        self, address_records: list[dict[str, Any]], roles: Sequence[str] = (), mailman: Sequence[str] = ()
    ) -> int:
        """Publish (and keep republishing) this agent's `peer` record. `address_records`
        come from `announce.make_address_record(self.did, addr)`, most important first:
        those that do not fit (beyond `max_addresses`, or past `max_record_bytes`) are
        left out, last first, and counted in `peer_addresses_left_out`. Returns how
        many replicas accepted it (0 when none is reachable); ValueError for a record
        our own checks would refuse (an invalid address record, bad roles, not even
        one address fitting)."""
        records = [dict(r) for r in address_records]
        roles, mailman = list(roles), list(mailman)
        ttl, limits, difficulty = self.limits.record_ttl, self.limits.records, self.min_difficulty

        def build(now: datetime, records: list[dict[str, Any]] = records) -> bytes:
            return build_peer_record(
                self.identity, address_records=records, roles=roles, mailman=mailman, now=now, ttl=ttl,
                min_difficulty=difficulty, limits=limits,
            )

        # Fit at the longest timestamp form (milliseconds), so that every later
        # re-signing fits as well.
        probe = self._clock().replace(microsecond=999_000)
        kept = records[: limits.max_addresses]
        while True:
            try:
                build(probe, kept)
                break
            except RecordTooLarge:
                if len(kept) <= 1:
                    raise
                kept = kept[:-1]
        if len(kept) < len(records):
            self._counters["peer_addresses_left_out"] += len(records) - len(kept)
            # Nothing to act on (the record carries what fits, most dialable first; the
            # handshake and LAN announces carry every address): said once per set left out.
            left_out = tuple(r.get("addr") for r in records[len(kept):])
            log.log(logging.INFO if left_out != self._left_out else logging.DEBUG,
                    "DHT peer record: %d of %d addresses left out (record size): %s; peer.host chooses the "
                    "interface", len(left_out), len(records), ", ".join(map(str, left_out)))
            self._left_out = left_out
            records[:] = kept

        key = peer_key(self.did)
        return await self._publish(key, self._register(key, build))

    async def publish_provider(self, container_did: str) -> int:
        """Sign and store the provider record of `container_did` once; the caller keeps
        the republish schedule (the node: on disk, `hmpnode.store.mesh.provide_*`), so
        nothing per container stays in memory but this node's own copy in its store,
        which `withdraw_provider` drops. Returns the replicas that accepted it;
        ValueError for a container DID no record can carry."""
        key = provider_key(container_did)
        kid = key_id(key)
        # as `_stamp`, but the last timestamp is that of our own stored copy (if any),
        # not a per-key memory that would grow with every container ever provided
        stamp = parse_time(format_time(self._clock()))
        held = self._store.own_record(kid)
        if held is not None and stamp <= held.timestamp:
            stamp = held.timestamp + timedelta(milliseconds=1)
        raw = build_provider_record(self.identity, container_did, now=stamp, ttl=self.limits.record_ttl,
                                    limits=self.limits.records)
        self._counters["provider_records_signed"] += 1
        return await self._publish(key, raw)

    async def announce_topic(self, topic: str) -> int:
        """Announce (and keep announcing) that this agent follows `topic`."""
        ttl, limits = self.limits.record_ttl, self.limits.records
        key = topic_key(topic, limits=limits)
        raw = self._register(key, lambda now: build_topic_record(self.identity, topic, now=now, ttl=ttl, limits=limits))
        return await self._publish(key, raw)

    def withdraw_provider(self, container_did: str) -> None:
        """Stop republishing the provider record and drop this node's own copy; the
        replicas' copies expire within `record_ttl`."""
        try:
            key = provider_key(container_did)
        except ValueError:
            return
        self._store.drop_own(key_id(key))

    def leave_topic(self, topic: str) -> None:
        """Stop republishing the topic record; it expires within `record_ttl`."""
        key = topic_key(topic, limits=self.limits.records)
        self._own.pop(key, None)
        self._last_stamp.pop(key, None)

    async def republish(self) -> int:
        """Re-sign and store every own record now; returns the replicas that accepted."""
        total = 0
        for key in list(self._own):
            total += await self._publish_own(key)
        return total

    # -- reading -----------------------------------------------------------

    async def _read(self, key: str) -> list[DhtRecord]:
        """Verified records of `key`: this node's own store merged with what up to
        `read_quorum` replicas return; newest per signer, in the holders' serving
        order (one record per source group first: `merge_ranked`)."""
        kid = key_id(key)
        local = self._store.get(kid, now=self._clock())
        protocol = self._protocol
        if protocol is None:
            return local
        nearest = protocol.router.find_neighbors(Node(kid))
        if not nearest:
            return local

        def accept(value: Any) -> list[DhtRecord]:
            good, refused = decode_record_set(
                value, now=self._clock(), key=key, min_difficulty=self.min_difficulty, limits=self.limits.records,
                max_items=2 * self.limits.store.max_set_entries,
            )
            self._counters["invalid_read_values"] += refused
            return good

        crawl = _ValueCrawl(
            protocol, Node(kid), nearest, self.limits.ksize, self.limits.alpha, accept, self.limits.read_quorum,
            self.limits.max_lookup_rounds,
        )
        try:
            await asyncio.wait_for(crawl.find(), self.limits.lookup_timeout)
        except asyncio.TimeoutError:
            self._counters["lookup_timeouts"] += 1
        # FIND_VALUE rounds (one round: up to alpha requests in parallel, one RTT)
        self._counters["reads"] += 1
        self._counters["read_rounds"] += min(crawl.rounds, self.limits.max_lookup_rounds)
        return merge_ranked([local, *crawl.answers])

    async def find_peer(self, did: str) -> PeerRecord | None:
        """The newest valid `peer` record of `did`, or None."""
        if not isinstance(did, str) or not is_self_certifying_did(did):
            return None  # no valid record can exist for it
        for record in await self._read(peer_key(did)):
            if isinstance(record, PeerRecord) and record.did == did:
                return record
        return None

    async def find_providers(self, container_did: str) -> list[str]:
        """DIDs of agents with a valid `provider` record for `container_did`, in serving order."""
        try:
            key = provider_key(container_did)
        except ValueError:
            return []
        return [r.did for r in await self._read(key)]

    async def find_topic(self, topic: str) -> list[str]:
        """DIDs of agents with a valid `topic` record for `topic`, in serving order."""
        try:
            key = topic_key(topic, limits=self.limits.records)
        except ValueError:
            return []
        return [r.did for r in await self._read(key)]

    # -- introspection -----------------------------------------------------

    def held(self, key: str) -> list[DhtRecord]:
        """The live records of `key` in this node's own store (no lookup): what it serves."""
        return self._store.get(key_id(key), now=self._clock())

    def routing_size(self) -> int:
        protocol = self._protocol
        return 0 if protocol is None else sum(len(b) for b in protocol.router.buckets)

    def stats(self) -> dict[str, int]:
        """Counters (dropped_malformed_rpc, dropped_malformed_reply, dropped_node_entries,
        garbage_datagrams, unknown_replies, mismatched_replies, refused_values and
        refused_<reason>, accepted_values, evicted_records, invalid_read_values, rpc_timeouts,
        reads and read_rounds (FIND_VALUE rounds of those reads),
        lookup_timeouts, evicted_contacts, refused_contacts, rebootstraps, ...) and
        gauges (routing_size, pending_calls, stored_records, stored_bytes, stored_keys,
        stored_groups: source groups holding records here, stored_own: this node's own
        records in its store, own_records: records re-signed from memory)."""
        out = dict(self._counters)
        out.update(self._store.stats())
        out["stored_groups"] = len(self._store.held_by())
        out["own_records"] = len(self._own)  # re-signed from memory (peer, topics, `provide`)
        out["routing_size"] = self.routing_size()
        out["pending_calls"] = self._protocol.pending_calls() if self._protocol is not None else 0
        return out
