"""Who may receive a container: propagation scope (profile section 12, spec 3.18).

Pure policy, no sockets and no clock: the caller says how a peer is reached
(`channel`, `peer_ip`), which agent DIDs the peer node serves and which roles
it announces, and passes `now`.

Rules, checked in this order by `may_forward`:

1. Expiry. A container whose `head.ttl` is at or before `now` is never
   forwarded (`expired`); the profile says expired containers are not
   forwarded at all.
2. Scope, from `head.network` (profile section 12, spec 3.18.1-3.18.2):

   - `""` or absent: any channel -- loopback, LAN, DHT, global.
   - `"localhost"`: only over the loopback channel to a loopback address
     (127.0.0.0/8 or ::1; an IPv4-mapped IPv6 address counts as its IPv4 form).
   - `"lan:<cidr>"`: only over a LAN channel to an address inside that subnet;
     never via the DHT, a global connection, or a peer outside the subnet.

   Anything else is `out_of_scope`. A `network` value of a form this node does
   not know (`lan:192.168.10.0` without a prefix, a future scope name) is
   accepted and stored (profile section 13) but fails closed here as
   `unknown_scope`: the node cannot tell who may receive it, so it tells no
   one. A non-object head and an unreadable `ttl` are `malformed`.
3. Audience (profile section 12, spec 3.18.1/3.18.4). `broadcast: true`
   (the JSON boolean) lets every peer in scope receive it. Otherwise a peer
   receives it only if it serves one of the container's recipients
   (`head.recipient` or `head.group_recipient[*].recipient` among `peer_dids`)
   or it stores and forwards for recipients (role `mailman` or `relay`).
   A container with neither `broadcast` nor recipients is private to the
   sender's node. Failing this is `not_addressed`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from hmpnode.container.encoding import EncodingError, parse_time
from hmpnode.container.payload import recipients_of

__all__ = [
    "Channel",
    "Scope",
    "Decision",
    "FORWARDING_ROLES",
    "parse_scope",
    "parse_ip",
    "is_loopback_ip",
    "network_of",
    "host_key",
    "may_forward",
    "recipients_of",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: roles that hold containers for their recipients (store-and-forward)
FORWARDING_ROLES = frozenset({"mailman", "relay"})


class Channel(StrEnum):
    """How the peer is reached."""

    LOOPBACK = "loopback"  # a peer reached over the loopback interface
    LAN = "lan"  # a peer reached directly on a local network
    DHT = "dht"  # via the Kademlia DHT
    GLOBAL = "global"  # any other peer connection


@dataclass(frozen=True, slots=True)
class Scope:
    kind: Literal["global", "localhost", "lan"]
    subnet: IPNetwork | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    ok: bool
    reason: str  # "ok", "expired", "out_of_scope", "unknown_scope", "not_addressed" or "malformed"
    detail: str = ""


def parse_scope(network: str) -> Scope:
    """`""` -> global, `"localhost"`, `"lan:<cidr>"` (host bits allowed); else ValueError."""
    if not isinstance(network, str):
        raise ValueError("network must be a string")
    if network == "":
        return Scope("global")
    if network == "localhost":
        return Scope("localhost")
    if network.startswith("lan:"):
        cidr = network[4:]
        # ip_network also takes a bare address (a /32 or /128) or an int; the profile wants a CIDR
        if "/" not in cidr or not cidr.isascii() or cidr != cidr.strip():
            raise ValueError(f"lan scope needs a CIDR: {network!r:.60}")
        try:
            return Scope("lan", ipaddress.ip_network(cidr, strict=False))
        except ValueError:
            raise ValueError(f"not a CIDR subnet: {network!r:.60}") from None
    raise ValueError(f"unknown network scope: {network!r:.60}")


def parse_ip(peer_ip: str | None) -> IPAddress | None:
    """The address in `peer_ip` (an IPv4-mapped IPv6 address as its IPv4 form), or None."""
    if not isinstance(peer_ip, str):
        return None
    try:
        addr = ipaddress.ip_address(peer_ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def network_of(addr: IPAddress, v4_prefix: int = 24, v6_prefix: int = 64) -> str:
    """The /24 (IPv4) or /64 (IPv6) network around `addr`, as text: what one host or one
    customer of a provider usually holds, so what limits per subnet count under."""
    prefix = v4_prefix if addr.version == 4 else v6_prefix
    return str(ipaddress.ip_network((addr, prefix), strict=False))


def host_key(addr: IPAddress) -> str:
    """One host's key: its IPv4 address, or the IPv6 /64 it commonly holds whole
    (rotating addresses inside it changes nothing)."""
    return network_of(addr) if addr.version == 6 else str(addr)


def is_loopback_ip(ip: str | None) -> bool:
    """A loopback source is this host (the kernel drops such sources from outside)."""
    addr = parse_ip(ip)
    return addr is not None and addr.is_loopback


def may_forward(
    head: dict[str, Any],
    *,
    peer_ip: str | None,
    channel: str,
    now: datetime,
    peer_dids: Iterable[str] = (),
    peer_roles: Iterable[str] = (),
) -> Decision:
    """May the container with this `head` go to this peer? See the module docstring.

    `channel` must be a `Channel` value (ValueError otherwise); `now` must be
    timezone-aware (ValueError otherwise).
    """
    channel = Channel(channel)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    if not isinstance(head, dict):
        return Decision(False, "malformed", "head is not an object")

    if "ttl" in head:
        try:
            ttl = parse_time(head["ttl"])
        except EncodingError:
            return Decision(False, "malformed", "ttl is not an RFC 3339 UTC timestamp")
        if ttl <= now:
            return Decision(False, "expired", "ttl has passed")

    network = head.get("network", "")
    if network is None:
        network = ""
    if not isinstance(network, str):
        return Decision(False, "malformed", "network must be a string")
    try:
        scope = parse_scope(network)
    except ValueError as exc:
        return Decision(False, "unknown_scope", f"{exc}: stored here, never forwarded")

    if scope.kind == "localhost":
        addr = parse_ip(peer_ip)
        if channel is not Channel.LOOPBACK or addr is None or not addr.is_loopback:
            return Decision(False, "out_of_scope", "localhost: only loopback peers")
    elif scope.kind == "lan":
        addr = parse_ip(peer_ip)
        if channel is not Channel.LAN or addr is None or addr not in scope.subnet:
            return Decision(False, "out_of_scope", f"lan: only LAN peers in {scope.subnet}")

    if head.get("broadcast") is True:
        return Decision(True, "ok", "broadcast")
    recipients = recipients_of(head)
    if recipients:
        served = set(d for d in peer_dids if isinstance(d, str))
        if any(r in served for r in recipients):
            return Decision(True, "ok", "peer serves a recipient")
        if FORWARDING_ROLES.intersection(peer_roles):
            return Decision(True, "ok", "peer stores and forwards for recipients")
        return Decision(False, "not_addressed", "peer neither serves a recipient nor forwards for one")
    return Decision(False, "not_addressed", "no broadcast and no recipients: private to the sender's node")
