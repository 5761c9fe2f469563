"""Whom the node may dial, how often, and which peers it keeps: sans-IO.

Addresses reach the node from four sources: a LAN announce (UDP datagram),
the announce a peer sends in its handshake, a DHT peer record, and the peers
table (what the first three left there). An announce is signed by its author
but may name *any* host, so each address is judged by **one rule**
(`check`, docs/protocol.md section 20.6) against what vouches for it, an
`Origin`:

- Always refused: host names (unless `DialPolicy.hostnames`, never from a
  LAN announce), ports outside 1..65535, other schemes, 0.0.0.0/::,
  multicast, 255.255.255.255, 240.0.0.0/4, and a subnet's network or
  broadcast address.
- The origin's own IP (the datagram's source, the connection's remote
  address) is allowed: the network vouches for it.
- An address in a subnet the origin vouches for (the receiver's interface
  subnet the datagram or connection came from) is allowed, except the
  receiver's own address on it unless the origin *is* that address (a node on
  this host).
- A LAN announce stops there (`lan_only`): nothing beyond its subnet.
- An address the operator wrote (`operator`: peer.static) is allowed, host
  names and private ranges included: the operator chose it.
- Other origins may also name globally routable addresses. Loopback, private,
  link-local, CGNAT, documentation and other special-purpose ranges only when
  the origin is this host (`local`: a peer connected over loopback, a DHT
  bound to loopback) for loopback, or when the operator allowed them
  (`DialPolicy.private`, `DialPolicy.allow` CIDRs).

Why: otherwise one datagram or one DHT record makes every node that reads it
connect to a third party (reflection) or to services inside the receiver's own
network or host (request forgery).

`DialBudget` bounds how often the node dials (one node-wide token bucket, and
per peer an exponential backoff after failures); `peers_to_drop` bounds the
peers table (cap, eviction by last useful contact, expiry of peers that
never answered). The IO layer (`hmpnode.net.mesh`) only calls these.
"""

from __future__ import annotations

import ipaddress
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from hmpnode.net.announce import parse_addr
from hmpnode.net.penalty import TokenBucket
from hmpnode.net.scope import IPAddress, IPNetwork, parse_ip

__all__ = [
    "REASONS",
    "Origin",
    "DialPolicy",
    "DialLimits",
    "check",
    "vet",
    "parse_cidrs",
    "DialBudget",
    "PeerFacts",
    "peers_to_drop",
    "lan_origin",
    "peer_origin",
    "dht_origin",
    "table_origin",
    "peer_addresses",
    "OPERATOR",
]

#: why an address is not dialled (the codes counted as refused{area="dial"})
REASONS = frozenset({"malformed", "port", "scheme", "hostname", "special", "own", "off_subnet", "loopback",
                     "link_local", "private", "peers_full"})

_LIMITED_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_PORT = re.compile(r":([0-9]+)\Z")


@dataclass(frozen=True, slots=True)
class Origin:
    """What vouches for an address: where it was learnt.

    `kind` is for counting and logs (lan, peer, dht, table); the rule reads
    only the other fields."""

    kind: str
    #: the datagram's source IP or the connection's remote address
    ip: IPAddress | None = None
    #: receiver subnets the origin is on (the interface the datagram or connection came by)
    subnets: tuple[IPNetwork, ...] = ()
    #: the receiver's own addresses on those subnets (never dialled unless `ip` is one)
    own: tuple[IPAddress, ...] = ()
    #: the origin is this host: loopback addresses are fine
    local: bool = False
    #: a LAN announce: nothing outside `subnets` (and `ip`), whatever the policy
    lan_only: bool = False
    #: the operator wrote the address (peer.static, `hmpnode peers add`): host names and
    #: every range allowed; only what cannot be a peer (malformed, port, scheme, special) is refused
    operator: bool = False


@dataclass(frozen=True, slots=True)
class DialPolicy:
    """What the operator allows beyond the rule (config [peer] dial_*)."""

    #: dial loopback/private/link-local/special-purpose addresses named by any non-LAN source
    private: bool = False
    #: dial host names (resolved by DNS, which the rule then cannot judge); never from a LAN announce
    hostnames: bool = False
    #: CIDRs a non-LAN source may name although they are not globally routable
    allow: tuple[IPNetwork, ...] = ()


def parse_cidrs(items: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDR strings -> networks (host bits allowed); ValueError names the bad one."""
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"not a CIDR: {item!r:.60}") from None
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DialLimits:
    """Whom and how often the node dials, and the peers table it picks from ([peer] dial_*,
    target_peers, peers_max; built once by hmpnode.config.PeerSettings.dial_limits)."""

    policy: DialPolicy = DialPolicy()
    #: connections the node opens by itself; of them it keeps `min_outbound` whatever its inbound ones
    target_peers: int = 8
    min_outbound: int = 4
    #: node-wide connection attempts per second, and how many may be saved up
    per_second: float = 2.0
    burst: float = 16.0
    #: per-peer wait after a failed dial round: backoff_base * 2**(failures-1), at most backoff_max
    backoff_base: float = 5.0
    backoff_max: float = 900.0
    #: a peer that never answered is forgotten after this many failed rounds in a row
    give_up_after: int = 5
    #: seconds a connection attempt may take
    timeout: float = 5.0
    #: rows of the peers table (memory and store)
    peers_max: int = 1000
    #: a peer never connected to is forgotten when not heard of for this long (seconds)
    unanswered_max_age: float = 86_400.0
    #: peers found by a newly declared topic's DHT records that are dialled ([interests] topic_dials)
    topic_dials: int = 4

    def budget(self, rng: random.Random | None = None) -> DialBudget:
        """The node's dial budget under these limits (per-peer state for 8 x peers_max peers)."""
        return DialBudget(self.per_second, self.burst, base=self.backoff_base, cap=self.backoff_max,
                          max_tracked=max(64, 8 * self.peers_max), rng=rng)


def _special(ip: IPAddress) -> bool:
    if ip.is_unspecified or ip.is_multicast:
        return True
    return isinstance(ip, ipaddress.IPv4Address) and (ip == _LIMITED_BROADCAST or ip.is_reserved)


def check(addr: object, origin: Origin, policy: DialPolicy = DialPolicy(),
          schemes: Collection[str] = ("tcp", "udp", "relay")) -> str | None:
    """None when `addr` may be dialled given where it came from, else a reason in REASONS.
    A `relay://` address is judged by its relay's host (the one the node would dial)."""
    if not isinstance(addr, str):
        return "malformed"
    m = _PORT.search(addr)
    if m is not None and int(m.group(1)) == 0:
        return "port"
    try:
        scheme, host, _port = parse_addr(addr)
    except ValueError:
        return "malformed"
    if scheme not in schemes:
        return "scheme"
    ip = parse_ip(host)
    if ip is None:
        return None if (policy.hostnames and not origin.lan_only) or origin.operator else "hostname"
    if _special(ip):
        return "special"
    if origin.operator:
        return None
    if origin.ip is not None and ip == origin.ip:
        return None
    for net in origin.subnets:
        if ip.version != net.version or ip not in net:
            continue
        if net.num_addresses > 2 and ip in (net.network_address, net.broadcast_address):
            return "special"
        if ip in origin.own:
            return "own"
        return None
    if origin.lan_only:
        return "off_subnet"
    if ip.is_loopback:
        return None if origin.local or policy.private or _allowed(ip, policy) else "loopback"
    if ip.is_global:
        return None
    if policy.private or _allowed(ip, policy):
        return None
    return "link_local" if ip.is_link_local else "private"


def _allowed(ip: IPAddress, policy: DialPolicy) -> bool:
    return any(ip.version == net.version and ip in net for net in policy.allow)


def vet(addresses: Iterable[object], origin: Origin, policy: DialPolicy = DialPolicy(),
        schemes: Collection[str] = ("tcp", "udp", "relay")) -> tuple[list[str], list[str]]:
    """(the addresses that pass, those whose host is the origin's IP first; the
    refusal reasons, one per refused address)."""
    exact: list[str] = []
    rest: list[str] = []
    refused: list[str] = []
    for addr in addresses:
        reason = check(addr, origin, policy, schemes)
        if reason is not None:
            refused.append(reason)
            continue
        assert isinstance(addr, str)
        host = parse_addr(addr)[1]
        (exact if origin.ip is not None and parse_ip(host) == origin.ip else rest).append(addr)
    return list(dict.fromkeys(exact + rest)), refused


def peer_addresses(addresses: Iterable[str]) -> list[str]:
    """The addresses of a peer's peer endpoint, in the order they are tried: direct
    (`tcp://`) ones first, then relayed (`relay://`, docs/protocol.md 34.3) ones, only
    when no direct one answered (a relay's bandwidth is shared, a direct link is not)."""
    addresses = list(addresses)
    return [a for a in addresses if a.startswith("tcp://")] + [a for a in addresses if a.startswith("relay://")]


# -- how often -----------------------------------------------------------------------


#: what a peer that closes our connection says when it needed the slot: that peer is
#: backed off as after a failed dial (a full relay evicting the nodes that want it as
#: their mailman must not have them dial straight back and evict the next one)
GIVE_WAY = frozenset({"evicted"})

class DialBudget:
    """Dial attempts, node-wide and per peer.

    One token bucket (`rate` dials/s, `burst`) for every outgoing connection
    attempt, so that however many addresses the node learns its failed dials
    stay under `rate`/s. Per peer, after each failed round the next waits
    `base * 2**(failures-1)` seconds, capped at `cap`, times a jitter in
    [0.75, 1.25) (so that peers that failed together do not retry together).
    Per-peer state is kept for at most `max_tracked` peers (least recently
    failed forgotten first: a forgotten peer is dialled again, at the node-wide rate)."""

    def __init__(self, rate: float, burst: float, *, base: float = 5.0, cap: float = 900.0,
                 max_tracked: int = 8192, rng: random.Random | None = None):
        self.bucket = TokenBucket(rate, burst)
        self.base, self.cap = base, cap
        self.max_tracked = max_tracked
        self._rng = rng or random.Random()
        #: peer -> (failed rounds in a row, not before)
        self._state: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def due(self, peer: str, now: float) -> bool:
        state = self._state.get(peer)
        return state is None or state[1] <= now

    def available(self, now: float) -> float:
        """Tokens there are now (attempts that may start)."""
        self.bucket.take(now, 0.0)
        return self.bucket.tokens

    def take(self, now: float) -> bool:
        """A token for one connection attempt, or False (try later)."""
        return self.bucket.take(now)

    def failures(self, peer: str) -> int:
        state = self._state.get(peer)
        return state[0] if state else 0

    def failed(self, peer: str, now: float) -> int:
        """A dial round to `peer` failed: back off; the failures in a row."""
        count = self.failures(peer) + 1
        delay = min(self.cap, self.base * 2 ** min(count - 1, 30)) * self._rng.uniform(0.75, 1.25)
        self._remember(peer, count, now + min(self.cap, delay))
        return count

    def defer(self, peer: str, until: float) -> None:
        """Not now (nothing to dial yet), without counting a failure."""
        count = self.failures(peer)
        self._remember(peer, count, max(until, self._state.get(peer, (0, 0.0))[1]))

    def succeeded(self, peer: str) -> None:
        self._state.pop(peer, None)

    def reset(self, peer: str) -> None:
        """The peer announced new addresses: its old failures say nothing about them."""
        self._state.pop(peer, None)

    def _remember(self, peer: str, count: int, until: float) -> None:
        self._state[peer] = (count, until)
        self._state.move_to_end(peer)
        while len(self._state) > self.max_tracked:
            self._state.popitem(last=False)

    def __len__(self) -> int:
        return len(self._state)


# -- which peers are kept ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerFacts:
    """What eviction looks at of a peers-table row."""

    did: str
    last_seen_us: int
    last_contact_us: int | None


def peers_to_drop(rows: Iterable[PeerFacts], *, cap: int, now_us: int, max_unanswered_age_us: int,
                  give_up_after: int, failures: Callable[[str], int],
                  keep: Collection[str] = ()) -> tuple[list[str], list[str]]:
    """(expired, evicted) DIDs to delete from the peers table.

    Expired: never contacted (no connection ever completed with it) and either
    `give_up_after` failed dial rounds in a row, or not heard of for
    `max_unanswered_age_us`. Evicted: of the rest, while more than `cap`
    remain, never-contacted ones first, then the oldest last contact (ties:
    oldest last seen). `keep` (connected peers, configured mailmen) is never
    dropped, even if that leaves more than `cap`."""
    expired: list[str] = []
    rest: list[PeerFacts] = []
    kept = 0
    for row in rows:
        if row.did in keep:
            kept += 1
            continue
        if not row.last_contact_us and (failures(row.did) >= give_up_after
                                        or now_us - row.last_seen_us > max_unanswered_age_us):
            expired.append(row.did)
        else:
            rest.append(row)
    over = len(rest) + kept - cap
    evicted: list[str] = []
    if over > 0:
        rest.sort(key=lambda r: (r.last_contact_us or 0, r.last_seen_us, r.did))
        evicted = [r.did for r in rest[:over]]
    return expired, evicted


def connections_wanted(*, target: int, min_outbound: int, live: int, outbound: int) -> int:
    """How many peers the connect loop dials this round: up to `target` connections
    in all, and at least `min_outbound` (at most `target`) of our own whatever the
    inbound ones (peers that dialled us cannot cut us off). 0 or less: none."""
    return max(target - live, min(min_outbound, target) - outbound)


# -- origins -------------------------------------------------------------------------
# Built from the host's interfaces (passed in: `hmpnode.net.interfaces.interfaces()`).


def lan_origin(source_ip: str, ifaces: Iterable) -> Origin:
    """A LAN announce that came from `source_ip` on one of `ifaces` (the one it
    arrived on): its source IP, and the subnet of the interface the source is on."""
    from hmpnode.net.interfaces import interface_for

    src = parse_ip(source_ip)
    if not isinstance(src, ipaddress.IPv4Address) or _special(src):
        return Origin("lan", lan_only=True)
    iface = interface_for(src, ifaces)
    if iface is None:
        return Origin("lan", src, lan_only=True)
    return Origin("lan", src, (iface.network,), (iface.address,), lan_only=True)


def peer_origin(remote_ip: str, ifaces: Iterable) -> Origin:
    """The announce a peer sent in its handshake over a connection with `remote_ip`:
    a peer on this host (loopback or one of our addresses) may name loopback and our
    addresses; a LAN peer, its subnet; any peer, globally routable addresses."""
    from hmpnode.net.interfaces import interface_for

    ip = parse_ip(remote_ip)
    ifaces = list(ifaces)
    if ip is None:
        return Origin("peer")
    if ip.is_loopback or any(i.address == ip for i in ifaces):
        own = tuple(ipaddress.ip_network(i.address) for i in ifaces)
        return Origin("peer", ip, own, local=True)
    iface = interface_for(ip, ifaces) if isinstance(ip, ipaddress.IPv4Address) else None
    if iface is None:
        return Origin("peer", ip)
    return Origin("peer", ip, (iface.network,), (iface.address,))


def dht_origin(local: bool) -> Origin:
    """A DHT peer record. `local`: the node's DHT is bound to loopback, so every
    record came from a DHT node on this host."""
    return Origin("dht", local=local)


#: a static peer's address (peer.static, `hmpnode peers add`)
OPERATOR = Origin("static", operator=True)


def table_origin(ifaces: Iterable) -> Origin:
    """A peers-table row read from the store (after a restart), whose origin is no
    longer known: its addresses passed the rule when they were stored, but the
    host's interfaces or the settings may have changed since, or an older version
    wrote the table. The host's subnets (loopback included) and global addresses,
    nothing else unless the policy allows it."""
    return Origin("table", subnets=tuple(i.network for i in ifaces))
