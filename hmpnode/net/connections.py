"""The driver's socket side: accepting and dialling peer connections, the v2 handshake
(docs/protocol.md 21.2) with admission carried out (`admission` decides), and each
connection's read loop into the core (`MeshCore.frame`).

Part of the asyncio driver (`mesh.Mesh` builds it and routes `PEER_PATH` here); it types
against `host.Host` for the node, the core and the peers table.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
import nacl.utils
from aiohttp import web

from hmpnode.logs import LogLimiter
from hmpnode.net import dialing as D
from hmpnode.net import drive
from hmpnode.net import mce as M
from hmpnode.net import session as SE
from hmpnode.net.admission import REFUSALS, Admission
from hmpnode.net.announce import parse_addr, parse_relay_addr
from hmpnode.net.circuit import parse_hello
from hmpnode.net.link import CLOSE_REFUSED, Link, Opening, close_quietly
from hmpnode.net.peerauth import AnnounceGate, PeerInfo
from hmpnode.net.reach import format_addr
from hmpnode.net.scope import parse_ip
from hmpnode.net.session import PeerSession
from hmpnode.net.transport import (
    HANDSHAKE_VERSIONS,
    MAX_FRAGMENT,
    NAT_PROTOCOL,
    PROLOGUE,
    KeyPair,
    NoiseHandshake,
    TransportError,
    make_payload,
)
from hmpnode.store import mesh as ms

if TYPE_CHECKING:
    from hmpnode.net.host import Host

__all__ = ["Connections", "PEER_PATH", "CIRCUIT_PATH"]

log = logging.getLogger("hmpnode.mesh")
#: a static peer that answers as another DID: said once an hour per address and DID
wrong_did = LogLimiter(log, 3600.0)

#: the peer protocol's WebSocket path: a later version gets its own path next to it
PEER_PATH = "/hmp/v2/peer"
#: a circuit relay's path (docs/protocol.md 34.3): ?to=<did> from a dialer, ?accept=<token> from the reserving node
CIRCUIT_PATH = "/hmp/v2/circuit"


class Connections:
    """Peer connections: our Noise static key, the HTTP client that dials, admission."""

    def __init__(self, host: Host, admission: Admission, announce_bytes: Callable[[], bytes],
                 greet: Callable[[Link], Awaitable[None]], wake_outbox: asyncio.Event) -> None:
        self.host, self.admission = host, admission
        self._announce_bytes, self._greet, self._wake_outbox = announce_bytes, greet, wake_outbox
        #: our Noise static key for this run (signed by our identity in every handshake)
        self._static = KeyPair.generate(nacl.utils.random)
        #: what dials (set by the driver's start, closed by its stop)
        self.client: aiohttp.ClientSession | None = None
        #: direct connections' TCP endpoints: (the peer's address as we see it, our local port)
        #: for `observed` (docs/protocol.md 34.1); a relayed connection has none
        self.endpoints: weakref.WeakKeyDictionary[Link, tuple[str, int]] = weakref.WeakKeyDictionary()

    def _refused(self, reason: str) -> None:
        self.host.node.refuse("peer", reason)
        self.host.counters[f"refused_{reason}"] += 1

    async def _disconnect(self, link: Link, reason: str, detail: str) -> None:
        """Close a connection the node no longer wants (its slot is free at once)."""
        link.closed = True
        link.session.send_error(reason, detail)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(link.flush(closing=True), 2.0)
        await close_quietly(link.ws)

    def _ban_address(self, key: str, reason: str) -> None:
        """Ban an address (or IPv6 /64; `ban_key`) minting DIDs: close its unpinned connections."""
        seconds = self._ban([key])
        self.host.counters["banned_addresses"] += 1
        self.host.node.refuse("peer", reason)
        log.warning("address %s banned for %.0f s: %s", key, seconds, reason)
        for link in list(self.host.sessions.values()):
            if key in (link.address, link.subnet) and not link.pinned and not link.closed:
                self.host.spawn(self._disconnect(link, "banned", "this address is ignored for a while"))

    def _ban(self, keys: list[str]) -> float:
        """Ban DIDs or address keys and write the bans to the store; the length of the last one."""
        now_us = self.host.node.now_us()
        rows = self.admission.ban(keys, time.monotonic(), now_us)
        cap = self.admission.bans.max_entries
        self.host.spawn(self.host.node.db.write(lambda conn: ms.save_bans(conn, rows, now_us, cap)))
        return (rows[-1][1] - now_us) / 1e6

    def _claim_refusal(self, claimed: str, role: str, ip: str, via: str | None = None) -> str | None:
        """The handshake's early check of the claimed DID (Admission.claim_refusal)."""
        reason, ban = self.admission.claim_refusal(claimed, role, ip, self.host.sessions.values(), time.monotonic(),
                                                   via)
        if ban is not None:
            self._ban_address(ban, "did_churn")
        return reason

    def cut_off(self, link: Link) -> None:
        """Ban a peer that crossed its strike threshold (Admission.cut_off)."""
        self._ban(self.admission.cut_off(link, time.monotonic()))
        self.host.counters["banned"] += 1
        log.warning("peer %s (%s) cut off: %s", link.did, link.ip, dict(link.session.strikes.by_reason))

    # -- connections --------------------------------------------------------------------------

    async def accept(self, request: web.Request) -> web.StreamResponse:
        ip = request.remote or ""
        refusal = self.admission.accept(ip, self.host.sessions.values(), time.monotonic())
        if refusal is not None:
            self._refused(refusal)
            if refusal == "banned":
                return web.json_response({"error": "banned", "detail": "this address is ignored for a while"},
                                         status=403)
            detail = "too many handshakes in progress" if refusal == "pending" else "no peer slot for you"
            return web.json_response({"error": "busy", "reason": refusal, "detail": detail}, status=503)
        try:
            ws = web.WebSocketResponse(max_msg_size=self.wire_limit(), heartbeat=30, autoping=True)
            await ws.prepare(request)
            link = await self._handshake(ws, "responder", ip)
        finally:
            self.admission.handshake_ended(ip)
        if link is not None:
            self._note_endpoints(link, request.transport)
            await self._run_session(link)
        else:
            await ws.close()
        return ws

    async def dial(self, addr: str, expect_did: str | None = None, *, origin: D.Origin,
                   require_did: bool = False) -> Link | None:
        """Connect to a peer's `tcp://` address, or through the circuit relay of its
        `relay://` address (docs/protocol.md 34.3; `expect_did` is then required: it is
        who the circuit goes to), learnt from `origin`; the link, or None.
        `require_did`: a peer that proves another DID than `expect_did` is refused (a static
        peer's, hmpnode.net.addresses), otherwise it is only logged.

        The dial rule is checked here once more, at the socket: callers pass only
        vetted addresses, so `dial_off_rule` counts a path that forgot to (and the
        address is still not dialled)."""
        reason = D.check(addr, origin, self.host.dialer.policy, schemes=("tcp", "relay"))
        if reason is None and addr.startswith("relay://") and expect_did is None:
            reason = "malformed"
        if reason is not None:
            self.host.counters["dial_off_rule"] += 1
            self.host.node.refuse("dial", reason)
            return None
        scheme, host, port = parse_addr(addr)
        if self.client is None:
            return None
        self.host.counters["dial_attempts"] += 1
        began = time.monotonic()
        url = f"http://{host}:{port}{PEER_PATH}"  # an IPv6 host keeps its brackets
        timeout, via = self.host.settings.dialing.timeout, None
        if scheme == "relay":
            # the relay answers once the peer came to accept (within its accept_seconds)
            via = parse_relay_addr(addr)[2]
            url, timeout = f"http://{host}:{port}{CIRCUIT_PATH}?to={quote(str(expect_did))}", 2 * timeout
            self.host.counters["dial_relayed"] += 1
        try:
            ws = await asyncio.wait_for(
                self.client.ws_connect(url, max_msg_size=self.wire_limit(), heartbeat=30, autoping=True), timeout)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            self.host.counters["dial_failed"] += 1
            return None
        peer_ip = None
        if via is not None and (peer_ip := await self.read_hello(ws)) is None:
            return None
        link = await self._handshake(ws, "initiator", host.strip("[]"), via,
                                     expect_did=expect_did if require_did or via else None, addr=addr)
        if link is None:
            await ws.close()
            return None
        if peer_ip is not None:
            self.host.punching.relay_reported(link.did, peer_ip)
            # from the dial to an admitted relayed session (/v1/status circuits.relayed_dial_ms)
            self.host.circuits.dialled((time.monotonic() - began) * 1000)
        if expect_did is not None and link.did != expect_did:
            log.info("%s answered as %s, not %s", addr, link.did, expect_did)
        self._note_endpoints(link, ws)
        self.host.spawn(self._run_session(link))
        return link

    def _note_endpoints(self, link: Link, carrier) -> None:
        """Record a direct connection's endpoints (`carrier`: its socket's get_extra_info)."""
        if carrier is None:  # the connection is already gone
            return
        peer, local = carrier.get_extra_info("peername"), carrier.get_extra_info("sockname")
        ip = parse_ip(peer[0]) if peer else None
        if ip is not None and local:
            self.endpoints[link] = (format_addr(str(ip), peer[1]), local[1])

    async def answer(self, ws, ip: str, via: str, peer_ip: str) -> Link | None:
        """A circuit we opened to the relay `via` (at `ip`) for a dialer the relay sees at
        `peer_ip`: the handshake as its responder (docs/protocol.md 34.3), then the session;
        the link, or None."""
        link = await self._handshake(ws, "responder", ip, via)
        if link is None:
            await close_quietly(ws)
            return None
        self.host.punching.relay_reported(link.did, peer_ip)
        self.host.spawn(self._run_session(link))
        return link

    async def read_hello(self, ws) -> str | None:
        """The relay's first message on a circuit (circuit.hello): the IP it sees the other
        end at; None (counted, `ws` closed) when it is missing or malformed."""
        try:
            msg = await asyncio.wait_for(ws.receive(), self.host.settings.dialing.timeout)
            peer_ip = parse_hello(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else None
        except (asyncio.TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError):
            peer_ip = None
        if peer_ip is None:
            self.host.counters["circuit_no_hello"] += 1
            await close_quietly(ws)
        return peer_ip

    def wire_limit(self) -> int:
        """The largest WebSocket message: the records of one frame of max_frame_bytes
        (19 bytes per record of at most MAX_FRAGMENT bytes: docs/protocol.md 21.1)."""
        size = self.host.settings.session.max_frame_bytes
        return size + 19 * max(1, -(-size // MAX_FRAGMENT))

    async def adopt(self, carrier, role: str, ip: str, did: str) -> Link | None:
        """A punched stream (hmpnode.net.punching): the v2 handshake on it with `did` only,
        then its session, replacing the relayed one (the one-connection rule)."""
        link = await self._handshake(carrier, role, ip, expect_did=did)
        if link is None:
            await close_quietly(carrier)
            return None
        self.host.spawn(self._run_session(link))
        return link

    async def _handshake(self, ws, role: str, ip: str, via: str | None = None, *, expect_did: str | None = None,
                         addr: str = "") -> Link | None:
        """The v2 handshake over `ws` (hmpnode.net.transport, docs/protocol.md 21.2), then
        the node's admission; the registered link, or None (the caller closes `ws`).
        `via`: the DID of the circuit relay `ws` runs through (`ip` is the relay's; 34.3).

        Refusals before the handshake completes (a banned or fresh DID, no slot for the
        claimed identity) close the WebSocket with CLOSE_REFUSED and our reason code;
        after it completes they are an error frame inside the channel, then the close.
        The responder's first frame is empty when it admits the initiator: the initiator
        waits for it (or the refusal) before it counts itself connected."""
        s = self.host.settings
        gate = AnnounceGate(self.host.node.verifier(), min_difficulty=s.min_difficulty, now=self.host.node.now(),
                            max_age=timedelta(seconds=s.session.mce_max_age_seconds),
                            early=lambda did: self._claim_refusal(did, role, ip, via))
        payload = make_payload(self.host.identity, self._announce_bytes(), self._static.public, HANDSHAKE_VERSIONS)
        hs = NoiseHandshake(role, self._static, PROLOGUE, payload, nacl.utils.random, verify_announce=gate,
                            own_did=self.host.identity.did, expected_did=expect_did,
                            max_frame=s.session.max_frame_bytes)
        opening = Opening(ws, hs, time.monotonic() + s.mesh.handshake_timeout, self.host.counters)
        transport = None
        try:
            opened = await opening.exchange()
            if opened is None:
                return None
            transport, backlog = opened
            if gate.skew is not None:  # the peer's announce says what its clock said
                self.host.skew.add(*gate.skew, jump=gate.clock_skew is not None)
            if gate.clock_skew is not None:
                # not an offence: the authenticated peer is told (inside the channel) and let go
                self.host.counters["handshake_clock_skew"] += 1
                self.host.node.refuse("peer", "clock_skew")
                await self._refuse_channel(ws, transport, "clock_skew", gate.clock_skew)
                return None
            if role == "initiator" and not await opening.verdict(transport, backlog):
                return None
        except TransportError as exc:
            if exc.reason == "bad_announce" and gate.refusal is not None:
                # refused on the claimed DID, before any signature work
                self._refused(gate.refusal)
                with contextlib.suppress(Exception):
                    await ws.close(code=CLOSE_REFUSED, message=gate.refusal.encode())
                return None
            if exc.reason == "unexpected_peer":  # a static peer's address, a punch, a circuit: another node answered
                self._refused("wrong_did")
                wrong_did.log(logging.WARNING, (addr, exc.detail), "%s: %s: connection closed", addr or ip, exc.detail)
                await close_quietly(ws)  # a local choice, not the peer's fault: no error frame (25.2)
                return None
            self.host.counters[f"handshake_{exc.reason}"] += 1
            self.host.node.refuse("peer_handshake", exc.reason)
            return None
        except (asyncio.TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError):
            self.host.counters["handshake_failed"] += 1
            return None
        peer = hs.peer
        assert peer is not None and gate.checked is not None
        check, result = gate.checked
        info = PeerInfo(peer.did, peer.public_key, check, result, peer.static_key, peer.versions)
        mono = time.monotonic()
        channel, address, subnet = self.admission.place(ip, via)
        if self.admission.bans.banned(info.did, mono):
            self._refused("banned")
            await self._refuse_channel(ws, transport, "banned", REFUSALS["banned"])
            return None
        session = PeerSession(self.host.identity, info.did, ip, channel, peer_roles=info.announce.roles,
                              initiator=role == "initiator", limits=s.session,
                              book=self.host.core.ledger.open(), counters=self.host.counters, relaying=self.host.core.relaying,
                              check=self._check_mce, nat=NAT_PROTOCOL in peer.versions)
        link = Link(ws, info, session, mono, address=address, subnet=subnet,
                    pinned=self.admission.is_pinned(info.did, ip, via), transport=transport, backlog=backlog, via=via)
        existing = self.host.sessions.get(info.did)
        if existing is not None and not existing.closed:
            # both dialled at once, or one side twice: both ends keep the same one (21.3)
            if not SE.keeps_new_connection(self.host.identity.did, info.did, new_is_ours=link.initiator,
                                           old_is_ours=existing.initiator, new_hash=transport.handshake_hash,
                                           old_hash=existing.transport.handshake_hash, new_relayed=via is not None,
                                           old_relayed=existing.via is not None):
                self.host.counters["duplicate_connection"] += 1
                await self._refuse_channel(ws, transport, "duplicate_connection", "the other connection is kept")
                return None
        refusal, evict = self.admission.admit(link, self.host.sessions.values())
        if refusal is not None:
            self._refused(refusal)
            await self._refuse_channel(ws, transport, refusal, "no peer slot for you")
            return None
        if evict is not None:
            victim = self.host.sessions.get(evict)
            if victim is not None:
                self._refused("evicted")
                log.info("peer %s (%s) evicted for %s (%s)", victim.did, victim.ip, info.did, ip)
                victim.closed = True
                self.host.spawn(self._disconnect(victim, "evicted", "a peer slot was needed"))
        if existing is not None:
            # its unanswered requests go now, not when its close completes: the new
            # connection's first offer (a relay's, 24.2, made once) must find them released
            self.host.core.ledger.close(existing.session.book)
            if not existing.closed:
                existing.closed = True
                self.host.spawn(existing.ws.close())
        self.host.sessions[info.did] = link
        self.host.counters["connected"] += 1
        if role == "responder":  # admitted: the empty frame tells the initiator (a failed send closes it)
            link.session.admitted()
            await link.flush()
        self.admission.connected(link, mono)
        # through a relay, the connection says nothing of where the peer is: global addresses only
        origin = D.peer_origin(ip, self.host.dialer.interfaces()) if via is None else D.Origin("circuit")
        await self.host.dialer.remember(info.announce, info.verify_result.container, "inbound" if role == "responder" else "dial",
                             origin, contact=True)
        return link

    async def _refuse_channel(self, ws, transport, reason: str, detail: str) -> None:
        """Refuse an authenticated peer: an error frame inside the channel, then the close."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.send_bytes(transport.encrypt(M.error_frame(reason, detail))), 2.0)
        await close_quietly(ws)

    async def _run_session(self, link: Link) -> None:
        """Read frames until the connection ends; sync first. Each frame goes to the
        core (`MeshCore.frame`: the session, then what its events ask)."""
        session = link.session
        try:
            await self._greet(link)  # before sync: the peer filters what it pushes by our interests (33.2)
            if session.initiator:  # the dialer reconciles: it pushes what the peer lacks, asks what it lacks
                await drive.run(self.host.core.start_sync(link), self.host.world)
            await drive.run(self.host.core.offer_held(link), self.host.world)
            self.host.core.outbox_arrived.add(link.did)
            self._wake_outbox.set()
            async for data in link.frames(functools.partial(self._bad_record, link)):
                await drive.run(self.host.core.frame(link, data), self.host.world)
                if session.closed:  # cut off, clock skew
                    break
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("peer session %s failed", link.did)
        finally:
            link.closed = True
            self.host.core.ledger.close(session.book)
            if self.host.sessions.get(link.did) is link:
                del self.host.sessions[link.did]
                self.host.counters["disconnected"] += 1
                now_us = self.host.node.now_us()
                with contextlib.suppress(Exception):
                    await self.host.node.db.write(lambda conn: ms.touch_peer(conn, link.did, now_us))
                self.host.dialer.wake.set()
            with contextlib.suppress(Exception):
                await link.ws.close()

    def _bad_record(self, link: Link, reason: str, cut: bool) -> None:
        """A link's record stream failed (Link.frames): count it and end the session (nothing
        is sent: the channel can no longer be trusted); `cut`: the peer is also cut off."""
        if cut:
            self.cut_off(link)
        link.closed = True
        self.host.counters[f"record_{reason}"] += 1
        self.host.node.refuse("peer", reason)
        log.info("peer %s (%s): session ended: %s", link.did, link.ip, reason)

    def _mce_limits(self):
        """The verifier limits of MCE messages: a compressed payload expands to at most
        one frame's size (peer.max_frame_bytes), never to the 16 MiB of a container."""
        limits = self.host.node.limits
        if limits.max_decompressed_bytes <= self.host.settings.session.max_frame_bytes:
            return limits
        return dataclasses.replace(limits, max_decompressed_bytes=self.host.settings.session.max_frame_bytes)

    def _check_mce(self, container: dict[str, Any], **checked: Any) -> M.Mce:
        """The sessions' MceChecker (on a verify thread): the node's registry and MCE limits."""
        return M.check_mce(self.host.node.verifier(self._mce_limits()), container, **checked)
