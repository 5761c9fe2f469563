"""The driver of circuit relays (docs/protocol.md 34.3): the relay's side (the `reserve`
op, the `CIRCUIT_PATH` requests, the splice of two WebSockets) and the reserving side (a
node that cannot be dialled holds reservations on the circuit relays it is connected to,
announces their `relay://` addresses, and comes to accept the circuits they announce).
The dialer's side is `Connections.dial` of a `relay://` address.

The bookkeeping and the limits are `circuit.CircuitRelay`'s (sans-IO); this carries them
out. A circuit costs the relay two WebSockets and at most one message in flight per
direction: each direction reads the next message only once the last one was sent
(aiohttp pauses reading a socket whose queue is full), so a fast sender waits for the
slow receiver instead of filling the relay's memory.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from hmpnode.container.structure import DID_RE
from hmpnode.net.admission import CIRCUIT_KEY
from hmpnode.net.announce import parse_addr, parse_relay_addr, relay_addr, url_host
from hmpnode.net.circuit import REFUSALS, TOKEN_HEX, Circuit, CircuitRelay, hello
from hmpnode.net.connections import CIRCUIT_PATH
from hmpnode.net.link import Link, close_quietly

if TYPE_CHECKING:
    from hmpnode.net.connections import Connections
    from hmpnode.net.host import Host

__all__ = ["Circuits", "CIRCUIT_ROLE"]

log = logging.getLogger("hmpnode.mesh")
#: dials through a relay whose time to an admitted session /v1/status shows
RECENT_DIALS = 64

#: the role of a node that relays circuits
CIRCUIT_ROLE = "circuit"
_TOKEN = re.compile(f"[0-9a-f]{{{TOKEN_HEX}}}")
#: HTTP status of each refusal of a circuit request
_STATUS = {"not_a_circuit_relay": 404, "no_reservation": 404, "expired": 404, "malformed": 400,
           "circuit_limit": 503, "relay_busy": 503}
#: a `reserve` left unanswered this long is given up (asked again at the next round)
ASK_SECONDS = 10.0
#: after a refused reservation, the relay is not asked again for this long
REFUSED_BACKOFF = 60.0


@dataclass(slots=True)
class Held:
    """A reservation this node holds on a relay."""

    addr: str
    expires: float
    #: when it is renewed (half its duration)
    renew: float


def _refusal(reason: str) -> web.Response:
    return web.json_response({"error": reason, "detail": REFUSALS[reason]}, status=_STATUS.get(reason, 503))


class Circuits:
    """Both sides of circuit relays for one node (the module docstring)."""

    def __init__(self, host: Host, connections: Connections, rng: random.Random) -> None:
        self.host, self.connections = host, connections
        self.limits = host.settings.circuit
        #: the relay's bookkeeping; None when this node does not have the role `circuit`
        self.relay = (CircuitRelay(self.limits, random.Random(rng.getrandbits(128)), host.counters)
                      if CIRCUIT_ROLE in host.settings.roles else None)
        #: pending circuits: token -> the future the accepting WebSocket arrives by
        self._waiting: dict[str, asyncio.Future] = {}
        #: reserving side: relay DID -> our reservation; request id -> (relay DID, when asked)
        self.held: dict[str, Held] = {}
        self._asked: dict[int, tuple[str, float]] = {}
        self._refused_until: dict[str, float] = {}
        self._next_id = 1
        #: milliseconds of our last dials through a relay to an admitted session
        self._dial_ms: collections.deque[float] = collections.deque(maxlen=RECENT_DIALS)
        self._accepting = 0
        host.nat.register("reserve", self._on_reserve)
        host.nat.register("reserved", self._on_reserved)
        host.nat.register("connect", self._on_connect)

    # -- what the node announces ------------------------------------------------------------

    def addresses(self) -> list[str]:
        """The relayed addresses of the reservations held now."""
        return [h.addr for h in self.held.values()]

    def dialled(self, ms: float) -> None:
        """A dial through a circuit relay reached an admitted session after `ms` (the last
        RECENT_DIALS are kept for /v1/status)."""
        self._dial_ms.append(round(ms, 1))

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reserved_on": sorted(self.held), "relayed_addresses": self.addresses(),
                               "relayed_links": sum(1 for x in self.host.sessions.values() if x.via is not None),
                               "relayed_dial_ms": list(self._dial_ms)}
        if self.relay is not None:
            out["relay"] = self.relay.status()
        return out

    # -- the relay's side -------------------------------------------------------------------

    def _own_ip(self) -> str:
        """The IP the relay names in the relayed addresses it hands out: the first address
        reachability confirmed public, else the first global one it announces, else the first."""
        ips = list(self.host.reach.public_ips())
        hosts = [parse_addr(a)[1] for a in self.host.addresses if a.startswith("tcp://")]
        for ip in ips + [h for h in hosts if ipaddress.ip_address(h).is_global] + hosts:
            return ip
        return "127.0.0.1"

    async def _on_reserve(self, link: Link, message: dict[str, Any]) -> None:
        rid = message.get("id")
        if type(rid) is not int or not 0 <= rid < 2**53:
            self.host.counters["circuit_malformed"] += 1
            return
        if self.relay is None or link.via is not None:  # no role, or a relayed session: no reservation through it
            link.session.send_nat("reserved", id=rid, ok=False, reason="not_a_circuit_relay")
        else:
            seconds, reason = self.relay.reserve(link.did, link.ip, time.monotonic())
            if reason is not None:
                link.session.send_nat("reserved", id=rid, ok=False, reason=reason)
            else:
                link.session.send_nat("reserved", id=rid, ok=True, expires_s=int(seconds),
                                      addr=relay_addr(self._own_ip(), self.host.port, self.host.identity.did))
        await link.flush()

    async def serve(self, request: web.Request) -> web.StreamResponse:
        """`CIRCUIT_PATH`: `?to=<did>` from a dialer, `?accept=<token>` from the reserving node."""
        if self.relay is None:
            self.host.counters["circuit_refused_not_a_circuit_relay"] += 1
            return _refusal("not_a_circuit_relay")
        token, to = request.query.get("accept"), request.query.get("to")
        if token is not None:
            return await self._accept(request, token)
        if to is None or len(to) > 512 or DID_RE.fullmatch(to) is None:
            return _refusal(self.relay.refused("malformed")[1])
        return await self._dialled(request, to)

    async def _dialled(self, request: web.Request, to: str) -> web.StreamResponse:
        """A dialer wants `to`: tell it the token, wait for it to accept, then splice."""
        assert self.relay is not None
        target = self.host.sessions.get(to)
        if target is None or target.closed:
            self.relay.drop(to)
        circuit, reason = self.relay.open(to, time.monotonic())
        if reason is not None:
            return _refusal(reason)
        assert circuit is not None and target is not None
        arrived = asyncio.get_running_loop().create_future()
        self._waiting[circuit.token] = arrived
        try:
            target.session.send_nat("connect", circuit=circuit.token)
            await target.flush()
            accepted, done = await asyncio.wait_for(asyncio.shield(arrived), self.limits.accept_seconds)
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            self.relay.close(circuit)
            return _refusal(self.relay.refused("expired")[1])
        finally:
            self._waiting.pop(circuit.token, None)
        try:
            ws = web.WebSocketResponse(max_msg_size=self.connections.wire_limit(), heartbeat=30, autoping=True)
            await ws.prepare(request)
            # each end learns the IP we see the other at (a punch dials only vouched IPs, 34.4)
            await ws.send_str(hello(target.ip))
            await accepted.send_str(hello(request.remote or ""))
            await self._splice(circuit, ws, accepted)
            return ws
        finally:
            self.relay.close(circuit)
            if not done.done():  # the accepting handler may have been cancelled (the node stopping)
                done.set_result(None)

    async def _accept(self, request: web.Request, token: str) -> web.StreamResponse:
        """The reserving node came for its circuit: hand its WebSocket to the dialer's handler
        and stay until the splice ended (the WebSocket lives as long as this handler)."""
        assert self.relay is not None
        arrived = self._waiting.get(token) if _TOKEN.fullmatch(token) else None
        circuit, reason = self.relay.refused("expired") if arrived is None or arrived.done() else \
            self.relay.accept(token, time.monotonic())
        if reason is not None:
            return _refusal(reason)
        ws = web.WebSocketResponse(max_msg_size=self.connections.wire_limit(), heartbeat=30, autoping=True)
        await ws.prepare(request)
        done = asyncio.get_running_loop().create_future()
        arrived.set_result((ws, done))
        await done
        return ws

    async def _splice(self, circuit: Circuit, a: Any, b: Any) -> None:
        """Forward binary messages both ways until either side closes, sends anything else,
        or the circuit reaches its byte or time limit; then close both."""
        assert self.relay is not None
        relay = self.relay

        async def pump(src, dst) -> None:
            async for msg in src:
                if msg.type != aiohttp.WSMsgType.BINARY or not relay.carry(circuit, len(msg.data)):
                    return
                await dst.send_bytes(msg.data)  # the next message is read once this one is sent

        tasks = [asyncio.ensure_future(pump(a, b)), asyncio.ensure_future(pump(b, a))]
        try:
            done, _ = await asyncio.wait(tasks, timeout=max(0.0, circuit.deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                self.host.counters["circuit_cut_seconds"] += 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(close_quietly(a), close_quietly(b))

    # -- the reserving side -----------------------------------------------------------------

    def reserving(self) -> bool:
        """Does this node want reservations? `reserve`: always, never, or (auto) when its
        reachability is not confirmed public (hmpnode.net.reach)."""
        mode = self.limits.reserve
        if mode != "auto":
            return mode == "always"
        return self.host.reach.verdict != "public"

    async def loop(self) -> None:
        """Once a second: the relay's expiries; our reservations asked, renewed, dropped."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.maintain(time.monotonic())
            except Exception:
                log.exception("circuits maintenance failed")

    async def maintain(self, now: float) -> None:
        live = {d: x for d, x in self.host.sessions.items() if not x.closed}
        if self.relay is not None:
            self.relay.expire(now)
            self.relay.keep_only(set(live))
        before = self.addresses()
        for did in [d for d, h in self.held.items() if d not in live or h.expires <= now or not self.reserving()]:
            del self.held[did]
        self._asked = {i: a for i, a in self._asked.items() if a[0] in live and now - a[1] < ASK_SECONDS}
        if self.reserving():
            asked = {did for did, _ in self._asked.values()}
            relays = [x for x in live.values() if CIRCUIT_ROLE in x.roles and x.session.nat and x.via is None
                      and x.did not in asked and self._refused_until.get(x.did, 0.0) <= now]
            renew = [x for x in relays if x.did in self.held and self.held[x.did].renew <= now]
            room = self.limits.relays - len(self.held) - len(asked)
            new = [x for x in relays if x.did not in self.held][:max(0, room)]
            for link in renew + new:
                rid, self._next_id = self._next_id, self._next_id + 1
                if link.session.send_nat("reserve", id=rid):
                    self._asked[rid] = (link.did, now)
                    await link.flush()
        if self.addresses() != before:
            self._announce()

    def _announce(self) -> None:
        """Our relayed addresses changed: the DHT peer record says so at once (the announce
        reads them each time it is made)."""
        self.host.counters["circuit_addresses_changed"] += 1
        if self.host.dht is not None:
            self.host.spawn(self.host.publisher.dht_publish())

    async def _on_reserved(self, link: Link, message: dict[str, Any]) -> None:
        asked = self._asked.get(message.get("id"))  # type: ignore[arg-type]
        if asked is None or asked[0] != link.did:
            self.host.counters["circuit_reserved_unasked"] += 1
            return
        del self._asked[message["id"]]
        now = time.monotonic()
        ok, addr, seconds = message.get("ok"), message.get("addr"), message.get("expires_s")
        if ok is not True:
            reason = message.get("reason")
            self.host.counters[f"circuit_reserve_refused_{reason if reason in REFUSALS else 'other'}"] += 1
            self._refused_until[link.did] = now + REFUSED_BACKOFF
            return
        try:
            if parse_relay_addr(addr)[2] != link.did:
                raise ValueError("another relay's address")
            if type(seconds) is not int or seconds <= 0:
                raise ValueError("expires_s")
        except ValueError:
            self.host.counters["circuit_malformed"] += 1
            return
        before = self.addresses()
        self.held[link.did] = Held(addr, now + seconds, now + seconds / 2)
        self.host.counters["circuit_reserved"] += 1
        if self.addresses() != before:
            self._announce()

    async def _on_connect(self, link: Link, message: dict[str, Any]) -> None:
        token = message.get("circuit")
        if not isinstance(token, str) or _TOKEN.fullmatch(token) is None:
            self.host.counters["circuit_malformed"] += 1
            return
        if link.did not in self.held:
            self.host.counters["circuit_connect_unreserved"] += 1
            return
        if self._accepting >= self.limits.max_circuits_per_reservation * max(1, self.limits.relays):
            self.host.counters["circuit_connect_busy"] += 1
            return
        self._accepting += 1
        self.host.spawn(self._answer(link, token))

    async def _answer(self, relay: Link, token: str) -> None:
        """Open the circuit the relay announced and run the handshake as its responder."""
        try:
            if self.connections.admission.bans.banned(CIRCUIT_KEY + relay.did, time.monotonic()):
                self.host.counters["circuit_connect_banned"] += 1
                return
            _host, port, _did = parse_relay_addr(self.held[relay.did].addr)
            ip = relay.ip
            url = f"http://{url_host(ip)}:{port}{CIRCUIT_PATH}?accept={quote(token)}"
            client = self.connections.client
            if client is None:
                return
            try:
                ws = await asyncio.wait_for(client.ws_connect(url, max_msg_size=self.connections.wire_limit(),
                                                              heartbeat=30, autoping=True),
                                            self.host.settings.dialing.timeout)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                self.host.counters["circuit_accept_failed"] += 1
                return
            peer_ip = await self.connections.read_hello(ws)
            if peer_ip is None:
                return
            self.host.counters["circuit_accepting"] += 1
            await self.connections.answer(ws, ip, relay.did, peer_ip)
        except KeyError:  # the reservation went meanwhile
            return
        finally:
            self._accepting -= 1
