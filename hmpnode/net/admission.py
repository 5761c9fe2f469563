"""Who may hold a connection to this node (docs/protocol.md 21.4): bans, the fresh-DID
rule, handshakes in progress, slots and eviction (`slots` decides a slot), the tie-break
of two connections between the same nodes.

Sans-IO: the monotonic time comes in as `mono`; the driver (`mesh`) feeds what it sees
(an address, a claimed or authenticated DID, the live links) and carries out what
comes back (a refusal with its reason, bans to write to the store, a link to evict).
The address's channel (loopback, LAN, global) comes from `channel` (the node passes
`channel_of`, which reads the host's interfaces).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hmpnode.net.penalty import BanList, DidChurn
from hmpnode.net.scope import Channel, is_loopback_ip, parse_ip
from hmpnode.net.slots import Slot, address_keys, ban_key
from hmpnode.net.slots import admit as admit_slot
from hmpnode.net.slots import score as slot_score

if TYPE_CHECKING:
    from hmpnode.net.link import Link
    from hmpnode.net.settings import MeshSettings

__all__ = ["Admission", "channel_of", "PENDING_PER_IP", "REFUSALS"]

#: inbound handshakes in progress from one (non-loopback) address
PENDING_PER_IP = 4
#: details of the refusals sent in error frames (reason -> detail)
REFUSALS = {"banned": "this node is ignored for a while", "fresh_did": "no new DIDs from this host for a while"}
#: DIDs remembered as having had a connection from this host
LOCAL_DIDS = 4096
#: the address key of connections through a circuit relay: this prefix, then the relay's DID
CIRCUIT_KEY = "circuit:"


def channel_of(ip: str) -> Channel:
    """Where a peer's address is: loopback (also one of this host's own addresses: another
    node on this host, reached through lo), one of our LANs, or global."""
    addr = parse_ip(ip)
    if addr is None:
        return Channel.GLOBAL
    if addr.is_loopback:
        return Channel.LOOPBACK
    from hmpnode.net.interfaces import interface_for

    iface = interface_for(str(addr))
    if iface is None:
        return Channel.GLOBAL
    return Channel.LOOPBACK if iface.address == addr else Channel.LAN


class Admission:
    """The node's admission state: bans, DID churn per address, this host's DIDs, and
    the handshakes in progress per address."""

    def __init__(self, settings: MeshSettings, channel: Callable[[str], Channel]) -> None:
        self.limits = settings.slots
        self.ban_seconds = settings.mesh.ban_seconds
        self.bans = BanList(settings.mesh.ban_seconds)
        self.churn = DidChurn(settings.mesh.max_dids_per_address, settings.mesh.did_window_seconds)
        self.pinned = frozenset(settings.pinned)
        #: the static peers' DIDs (given, or proved when they connected): a slot like pinned
        #: peers; kept by hmpnode.net.peers as static peers are added and removed
        self.static: set[str] = set()
        self.channel = channel
        self._allow = tuple(ipaddress.ip_network(c, strict=False) for c in settings.allow)
        #: after a DID from this host was banned: until when fresh DIDs from this host are
        #: refused, and since when a DID counts as fresh (monotonic)
        self._loopback_locked = (0.0, 0.0)
        #: DIDs that had a connection from this host -> when first (bounded, least recently seen go)
        self._local_dids: OrderedDict[str, float] = OrderedDict()
        #: inbound connections in their handshake, per remote address
        self._pending: dict[str, int] = {}

    def allowed(self, ip: str) -> bool:
        """`ip` is in an `allow` CIDR: its peers are treated as pinned."""
        addr = parse_ip(ip)
        return addr is not None and any(addr in net for net in self._allow if net.version == addr.version)

    def is_pinned(self, did: str, ip: str, via: str | None = None) -> bool:
        return did in self.pinned or did in self.static or (via is None and self.allowed(ip))

    def place(self, ip: str, via: str | None = None) -> tuple[Channel, str, str | None]:
        """(channel, address key, subnet key) of a connection from `ip`. Through the circuit
        relay `via` (`ip` is then the relay's): the global channel and a key of its own,
        CIRCUIT_KEY + the relay's DID, capped like one address (max_per_address), so that
        the peers behind one relay neither take the relay's own slot nor get it banned
        for their DID churn (they are banned together, as one address)."""
        if via is not None:
            return Channel.GLOBAL, CIRCUIT_KEY + via, None
        channel = self.channel(ip)
        return (channel, *address_keys(ip, channel))

    @staticmethod
    def slot(link: Link) -> Slot:
        return Slot(link.did, link.initiator, link.address, link.subnet, link.pinned,
                    slot_score(link.session.useful, link.session.strikes.count), link.started)

    def slots(self, links: Iterable[Link], but: str | None = None) -> list[Slot]:
        return [self.slot(x) for x in links if x.did != but and not x.closed]

    # -- before the handshake ------------------------------------------------------------------

    def address_banned(self, ip: str, mono: float) -> bool:
        key = ban_key(*address_keys(ip, self.channel(ip)))
        return self.bans.banned(ip, mono) or (key != ip and self.bans.banned(key, mono))

    def accept(self, ip: str, links: Iterable[Link], mono: float) -> str | None:
        """May a connection from `ip` start its handshake? None (then it counts as pending
        until `handshake_ended`), or why not: banned, no slot for any DID from there (an
        eviction waits until the handshake says who it is), or `pending`: handshakes in
        progress, at most max_peers in all and, except on loopback (this host's nodes),
        PENDING_PER_IP per address."""
        if self.address_banned(ip, mono):
            return "banned"
        address, subnet = address_keys(ip, self.channel(ip))
        verdict = admit_slot(self.slots(links), Slot(None, False, address, subnet, self.allowed(ip)), self.limits)
        if not verdict.admit:
            return verdict.reason
        per_ip = self._pending.get(ip, 0)
        if sum(self._pending.values()) >= self.limits.max_peers or (per_ip >= PENDING_PER_IP and not is_loopback_ip(ip)):
            return "pending"
        self._pending[ip] = per_ip + 1
        return None

    def handshake_ended(self, ip: str) -> None:
        if self._pending[ip] <= 1:
            del self._pending[ip]
        else:
            self._pending[ip] -= 1

    def claim_refusal(self, claimed: str, role: str, ip: str, links: Iterable[Link],
                      mono: float, via: str | None = None) -> tuple[str | None, str | None]:
        """What the DID a handshake's announce claims already earns (unverified, read
        before any signature work): banned; from a responder's side also a fresh DID
        refused (`fresh_did_refusal`), or no slot. Claims are counted unverified:
        minting DIDs costs the attacker nothing here, but only its own address pays.
        (reason or None, an address key to ban now or None)."""
        if self.bans.banned(claimed, mono):
            return "banned", None
        if role != "responder":
            return None, None
        channel, address, subnet = self.place(ip, via)
        refusal, ban = self.fresh_did_refusal(ip, channel, claimed, mono, via)
        if refusal is not None:
            return refusal, ban
        new = Slot(claimed, False, address, subnet, self.is_pinned(claimed, ip, via))
        verdict = admit_slot(self.slots(links, but=claimed), new, self.limits)
        return (None if verdict.admit else verdict.reason), None

    def fresh_did_refusal(self, ip: str, channel: Channel, did: str, mono: float,
                          via: str | None = None) -> tuple[str | None, str | None]:
        """A reason to refuse an inbound DID this address has not shown before, or None;
        with the address key to ban when it is over its churn.

        Elsewhere an address presenting more than `max_dids_per_address` DIDs within
        the window is banned. This host (loopback) is never banned as an address (every
        node on it shares 127.0.0.1): after one of its DIDs was banned, it may only
        bring DIDs that had a connection before, for the ban length."""
        if channel is Channel.LOOPBACK:
            until, since = self._loopback_locked
            first = self._local_dids.get(did)
            return ("fresh_did" if until > mono and (first is None or first >= since) else None), None
        if via is None and self.allowed(ip):
            return None, None
        key = ban_key(*self.place(ip, via)[1:])
        if self.churn.over(key, did, mono):
            self.churn.forget(key)
            return "banned", key
        return None, None

    # -- after the handshake -------------------------------------------------------------------

    def admit(self, link: Link, links: Iterable[Link]) -> tuple[str | None, str | None]:
        """A slot for the authenticated peer of `link`: (refusal reason or None, the DID of a
        link to evict for it or None). Its ban and the tie-break with an existing connection
        (`session.keeps_new_connection`) are checked before."""
        verdict = admit_slot(self.slots(links, but=link.did), self.slot(link), self.limits)
        if not verdict.admit:
            return verdict.reason, None
        return None, (verdict.evict.key if verdict.evict is not None else None)

    def connected(self, link: Link, mono: float) -> None:
        """`link` was admitted: a DID of this host is remembered as not fresh."""
        if link.channel is Channel.LOOPBACK:
            self._local_dids[link.did] = self._local_dids.pop(link.did, mono)
            if len(self._local_dids) > LOCAL_DIDS:
                self._local_dids.popitem(last=False)

    # -- bans ----------------------------------------------------------------------------------

    def cut_off(self, link: Link, mono: float) -> list[str]:
        """The keys to ban for a peer that crossed its strike threshold: its DID, and its
        address except on loopback, where every node of this host shares 127.0.0.1: only
        the DID is banned there, and for as long, this host may bring no DID that had no
        connection before."""
        keys = [link.did]
        if link.channel is Channel.LOOPBACK:
            self._loopback_locked = (mono + self.ban_seconds, mono)
        elif link.via is not None or not self.allowed(link.ip):
            keys.append(ban_key(link.address, link.subnet))
        return keys

    def ban(self, keys: list[str], mono: float, now_us: int) -> list[tuple[str, int]]:
        """Ban DIDs or address keys (repeat offenders for longer: BanList); the rows
        (key, until in wall-clock microseconds) for the store, so that they outlive a restart."""
        return [(k, now_us + int(self.bans.ban(k, mono) * 1_000_000)) for k in keys]
