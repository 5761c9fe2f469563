"""Peer slots: who may hold a connection, and who makes room, sans-IO.

The mesh asks `admit` before a WebSocket upgrade (by address only) and again
after the handshake (when the peer's DID is known), with a snapshot of its
sessions as `Slot`s. The answer admits the newcomer, refuses it with a reason
code, or admits it by evicting a victim. Anchors: Bitcoin Core's inbound
eviction (protect the useful and the long-lived, then evict from the biggest
group), libp2p's connection manager (protected peers, a hard cap), gossipsub
v1.1 (a score of useful deliveries against offences).

Rules, in order:

1. A pinned peer (its DID in `peer.pinned`, or its address in `peer.allow`) is
   always admitted and never evicted; pinned connections count against no cap.
2. An outbound connection (the node dialled it) is admitted while the node has
   fewer than `max_peers` connections. Inbound ones never take the last
   `outbound_slots` of them, so the node can always dial out.
3. An inbound connection is refused when its address already holds
   `max_per_address` connections (`per_address`), when its subnet (/24 IPv4,
   /64 IPv6; only for peers that are neither on this host nor on a local
   network) holds `max_per_subnet` (`per_subnet`); all connections from this
   host (loopback: every node on it shares 127.0.0.1, and any local process may
   bind any 127/8 address) are one address with its own cap `max_loopback`
   (`loopback_full`).
4. When the inbound slots are full, a victim is looked for among the unpinned
   inbound connections: the `protect_useful` ones with the best positive score
   and the older half of the rest that never offended (score >= 0) are protected
   (an attacker cannot push out every useful or long-lived peer); of the others the lowest score goes, ties
   going to the address with the most connections, then to the youngest. No
   candidate: refused `full`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hmpnode.net.scope import Channel, network_of, parse_ip

__all__ = ["SlotLimits", "Slot", "Verdict", "admit", "pick_victim", "address_keys", "ban_key", "score", "usage",
           "LOOPBACK", "REASONS"]

#: the address key of every connection from this host
LOOPBACK = "loopback"
#: reason codes of refusals (and of an eviction, `evicted`)
REASONS = ("per_address", "per_subnet", "loopback_full", "full", "evicted")
#: useful deliveries count up to this many (a peer cannot buy protection without end)
USEFUL_CAP = 1000
#: score lost per strike (section 25.2): one offence outweighs ten useful deliveries
STRIKE_WEIGHT = 10.0


@dataclass(frozen=True, slots=True)
class SlotLimits:
    """The caps of the rules above ([peer] max_peers, max_per_*; built once by
    hmpnode.config.PeerSettings.slot_limits: `outbound_slots` is min(target_peers, max_peers // 2))."""

    max_peers: int = 64
    outbound_slots: int = 8
    max_per_address: int = 8
    max_per_subnet: int = 16
    max_loopback: int = 32
    protect_useful: int = 4

    @property
    def max_inbound(self) -> int:
        return max(0, self.max_peers - self.outbound_slots)


@dataclass(frozen=True, slots=True)
class Slot:
    """One connection as the slot policy sees it."""

    key: Hashable  # the session (its peer's DID)
    outbound: bool
    address: str  # address key: the IP, or LOOPBACK
    subnet: str | None  # subnet key; None: no subnet cap (this host, a local network)
    pinned: bool = False
    score: float = 0.0
    since: float = 0.0  # when it was connected


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str  # "ok", "pinned", "evict" or a refusal of REASONS
    evict: Slot | None = None


def address_keys(ip: str, channel: Channel | str) -> tuple[str, str | None]:
    """(address key, subnet key) of a peer reached at `ip` over `channel`."""
    if channel == Channel.LOOPBACK:
        return LOOPBACK, None
    addr = parse_ip(ip)
    if addr is None:
        return ip, None
    if channel == Channel.LAN:
        return str(addr), None  # a local network is one subnet by nature: no subnet cap there
    return str(addr), network_of(addr)


def ban_key(address: str, subnet: str | None) -> str:
    """What an address ban covers: the address, or for a global IPv6 peer its /64
    (one host's usual allotment: rotating addresses inside it changes nothing)."""
    return subnet if subnet is not None and ":" in subnet else address


def score(useful: int, strikes: float) -> float:
    """Useful deliveries (capped) against offences (strikes, decaying)."""
    return min(useful, USEFUL_CAP) - STRIKE_WEIGHT * strikes


def admit(slots: Sequence[Slot], new: Slot, limits: SlotLimits) -> Verdict:
    """May `new` hold a connection besides `slots` (the others, not including it)?"""
    if new.pinned:
        return Verdict(True, "pinned")
    counted = [s for s in slots if not s.pinned]
    if new.outbound:
        return Verdict(True, "ok") if len(counted) < limits.max_peers else Verdict(False, "full")
    same = sum(1 for s in counted if s.address == new.address)
    if new.address == LOOPBACK:
        if same >= limits.max_loopback:
            return Verdict(False, "loopback_full")
    elif same >= limits.max_per_address:
        return Verdict(False, "per_address")
    if new.subnet is not None and sum(1 for s in counted if s.subnet == new.subnet) >= limits.max_per_subnet:
        return Verdict(False, "per_subnet")
    inbound = [s for s in counted if not s.outbound]
    if len(inbound) < limits.max_inbound and len(counted) < limits.max_peers:
        return Verdict(True, "ok")
    victim = pick_victim(inbound, limits)
    if victim is None:
        return Verdict(False, "full")
    return Verdict(True, "evict", victim)


def pick_victim(inbound: Iterable[Slot], limits: SlotLimits) -> Slot | None:
    """The inbound connection to close for a newcomer, or None (all protected)."""
    candidates = [s for s in inbound if not s.pinned and not s.outbound]
    useful = sorted((s for s in candidates if s.score > 0), key=lambda s: (-s.score, s.since))
    protected = {id(s) for s in useful[: limits.protect_useful]}
    rest = [s for s in candidates if id(s) not in protected]
    # the older half of the rest (unless it offended): an attacker cannot make its connections old at will
    offenders = [s for s in rest if s.score < 0]
    rest = sorted((s for s in rest if s.score >= 0), key=lambda s: s.since)
    rest = offenders + rest[len(rest) // 2:]
    if not rest:
        return None
    per_address = Counter(s.address for s in candidates)
    return min(rest, key=lambda s: (s.score, -per_address[s.address], -s.since))


def usage(slots: Iterable[Slot], limits: SlotLimits, top: int = 5) -> dict[str, Any]:
    """Slot use for `status`: counts by direction, pinned, and the busiest addresses."""
    slots = list(slots)
    counted = [s for s in slots if not s.pinned]
    by_address = Counter(s.address for s in counted)
    return {
        "max_peers": limits.max_peers,
        "inbound": sum(1 for s in counted if not s.outbound),
        "outbound": sum(1 for s in counted if s.outbound),
        "pinned": len(slots) - len(counted),
        "max_inbound": limits.max_inbound,
        "max_per_address": limits.max_per_address,
        "max_per_subnet": limits.max_per_subnet,
        "max_loopback": limits.max_loopback,
        "top_addresses": [{"address": a, "connections": n} for a, n in by_address.most_common(top)],
    }
