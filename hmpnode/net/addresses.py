"""The addresses the operator writes: what the node announces (`[peer] announce`,
`no_announce`, `announce_interfaces`) and whom it keeps connected (`[peer] static`,
`hmpnode peers add`). Sans-IO: parsing, the announce rule and the static-peers list;
the driver (`mesh`, `peers`) reads the interfaces, dials and writes the file.

The announce rule (docs/operations.md "Addresses"):

- an `announce` entry is `tcp://IP[:PORT]` or `udp://IP[:PORT]` (an IP literal: peers
  refuse host names, docs/protocol.md 20.6); without a port it takes the node's own
  peer port (tcp) or DHT port (udp);
- when `announce` lists no `udp://` entry and the DHT runs, each `tcp://` entry's IP
  is also announced with the DHT port (a forwarded or 1:1-NATed address forwards both);
- the interfaces' addresses follow the announced ones unless `announce_interfaces` is
  false (then `announce` replaces them, as kubo's Addresses.Announce does);
- no address in a `no_announce` CIDR is announced, whatever its source;
- an announce must list an address (peers refuse one with none): when nothing is
  left, `tcp://127.0.0.1:PORT` is announced (only this host dials loopback).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hmpnode.net.announce import parse_addr, url_host
from hmpnode.net.scope import IPNetwork, parse_ip

__all__ = ["AnnounceEntry", "parse_announce", "own_addresses", "StaticPeer", "parse_static", "StaticPeers",
           "StaticError", "AddressSettings"]


@dataclass(frozen=True, slots=True)
class AnnounceEntry:
    """One `[peer] announce` entry; `port` None: the node's own port of that scheme."""

    scheme: str
    ip: str
    port: int | None

    def addr(self, port: int) -> str:
        return f"{self.scheme}://{url_host(self.ip)}:{self.port or port}"


def parse_announce(entry: str) -> AnnounceEntry:
    """`tcp://IP[:PORT]` / `udp://IP[:PORT]` -> AnnounceEntry; ValueError says what is wrong."""
    scheme, sep, rest = entry.partition("://")
    if not sep or scheme not in ("tcp", "udp"):
        raise ValueError(f"{entry!r:.80}: not tcp://IP[:PORT] or udp://IP[:PORT]")
    bare = rest[1:-1] if rest.startswith("[") and rest.endswith("]") else rest
    try:  # no port: the node's own
        ip = ipaddress.ip_address(bare)
    except ValueError:
        try:
            _, host, port = parse_addr(entry)
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{entry!r:.80}: not tcp://IP[:PORT] or udp://IP[:PORT] with an IP address "
                             "(peers do not dial announced host names)") from None
        return AnnounceEntry(scheme, str(ip), port)
    if isinstance(ip, ipaddress.IPv6Address) and not rest.startswith("["):
        raise ValueError(f"{entry!r:.80}: an IPv6 address goes in brackets")
    return AnnounceEntry(scheme, str(ip), None)


def _hidden(addr: str, no_announce: Sequence[IPNetwork]) -> bool:
    ip = parse_ip(parse_addr(addr)[1])  # a host name (peer.host = "node.example") is not in a CIDR
    return ip is not None and any(ip.version == net.version and ip in net for net in no_announce)


def own_addresses(*, interface_hosts: Iterable[str], port: int, dht_port: int | None,
                  announce: Sequence[AnnounceEntry] = (), no_announce: Sequence[IPNetwork] = (),
                  announce_interfaces: bool = True, confirmed: Sequence[str] = ()) -> list[str]:
    """The addresses our peer_announce and DHT peer record list (the module's rule);
    `dht_port` None: no DHT, so no `udp://` address. `confirmed`: `tcp://` addresses a
    dial-back confirmed (hmpnode.net.reach), after the configured ones."""
    addrs = [e.addr(port) for e in announce if e.scheme == "tcp"] + list(confirmed)
    if dht_port is not None:
        udp = [e.addr(dht_port) for e in announce if e.scheme == "udp"]
        addrs += udp or [AnnounceEntry("udp", e.ip, None).addr(dht_port) for e in announce if e.scheme == "tcp"]
    if announce_interfaces or not announce:
        hosts = list(interface_hosts)
        addrs += [AnnounceEntry("tcp", h, None).addr(port) for h in hosts]
        if dht_port is not None:
            addrs += [AnnounceEntry("udp", h, None).addr(dht_port) for h in hosts]
    kept = [a for a in dict.fromkeys(addrs) if not _hidden(a, no_announce)]
    return kept or [f"tcp://127.0.0.1:{port}"]


# -- static peers --------------------------------------------------------------------


class StaticError(ValueError):
    """A static-peer change refused; `reason` is the stable code the API answers."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class StaticPeer:
    """A peer the operator named: its `tcp://` address (a host name allowed) and, when
    given, the DID its handshake must prove."""

    addr: str
    did: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.did}@{self.addr}" if self.did else self.addr


def parse_static(spec: object) -> StaticPeer:
    """`tcp://host:port` or `did:…@tcp://host:port` -> StaticPeer; StaticError("bad_static")."""
    if not isinstance(spec, str) or not spec.isprintable() or len(spec) > 800:
        raise StaticError("bad_static", "a static peer is a string: tcp://host:port or did:…@tcp://host:port")
    did, at, addr = spec.rpartition("@")
    if at and not (did.startswith("did:") and 5 <= len(did) <= 512 and "@" not in did):
        raise StaticError("bad_static", f"{spec!r:.100}: before '@' must come a DID (did:…)")
    try:
        scheme, _host, _port = parse_addr(addr)
    except ValueError as exc:
        raise StaticError("bad_static", f"{spec!r:.100}: {exc}") from None
    if scheme != "tcp":
        raise StaticError("bad_static", f"{spec!r:.100}: a static peer is dialled at a tcp:// address")
    return StaticPeer(addr, did or None)


class StaticPeers:
    """The static peers: those of the configuration (`configured`, not removable at run
    time: the file would bring them back) and those added at run time (saved by the
    driver in the data dir), at most `max_entries` in all; and the DID each one proved
    when it connected (`seen`), so that a peer named without a DID is known once met."""

    def __init__(self, configured: Iterable[StaticPeer], max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries: dict[str, StaticPeer] = {p.spec: p for p in configured}
        self.configured = frozenset(self.entries)
        #: spec -> the DID that answered there last
        self.seen: dict[str, str] = {}

    def runtime(self) -> list[str]:
        return [spec for spec in self.entries if spec not in self.configured]

    def add(self, peer: StaticPeer) -> bool:
        """Add `peer`; False when it is there already; StaticError("static_full") over the limit."""
        if peer.spec in self.entries:
            return False
        if len(self.entries) >= self.max_entries:
            raise StaticError("static_full", f"at most {self.max_entries} static peers (peer.static_max)")
        self.entries[peer.spec] = peer
        return True

    def remove(self, key: str) -> list[StaticPeer]:
        """Take out the entries `key` names (a spec, or the DID given or seen); StaticError
        "not_found", or "configured" for an entry of the configuration."""
        matches = [spec for spec, p in self.entries.items() if key in (spec, p.did, self.seen.get(spec))]
        if not matches:
            raise StaticError("not_found", f"{key!r:.100} is not a static peer")
        if any(spec in self.configured for spec in matches):
            raise StaticError("configured", f"{key!r:.100} is in peer.static of the configuration: remove it there")
        for spec in matches:
            self.seen.pop(spec, None)
        return [self.entries.pop(spec) for spec in matches]

    def did_of(self, spec: str) -> str | None:
        peer = self.entries[spec]
        return peer.did or self.seen.get(spec)

    def dids(self) -> set[str]:
        """The DIDs of the static peers known now (given or seen): they get a slot like pinned peers."""
        return {d for d in (self.did_of(spec) for spec in self.entries) if d is not None}


@dataclass(frozen=True, slots=True)
class AddressSettings:
    """[peer] announce, no_announce, announce_interfaces, static, static_max (built once by
    hmpnode.config.PeerSettings.address_settings)."""

    announce: tuple[AnnounceEntry, ...] = ()
    no_announce: tuple[IPNetwork, ...] = ()
    announce_interfaces: bool = True
    static: tuple[StaticPeer, ...] = ()
    #: static peers in all, configured and added at run time
    static_max: int = 64
