"""The driver of observed addresses and dial-backs (docs/protocol.md 34.1, 34.2): it sends
`observed` on each direct connection to a peer that speaks hmp-nat/1, feeds the peers'
reports to `reach.Reachability`, sends the dial-backs it asks for, serves
`GET /hmp/v2/dialback` (where our nonces arrive) and dials back for peers within
`reach.DialbackGate`. The decisions are sans-IO (`hmpnode.net.reach`); this sends.

A dial-back is a plain HTTP GET with no body (a ~100-byte request, no redirect
followed, a connection of its own that is closed after the answer's head): the asker
needs only to see its nonce arrive."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from hmpnode.net.announce import url_host
from hmpnode.net.link import Link
from hmpnode.net.reach import DIALBACK_PATH, DialbackGate, parse_dialback

if TYPE_CHECKING:
    from hmpnode.net.host import Host as Mesh

__all__ = ["Dialback"]

log = logging.getLogger("hmpnode.mesh")

#: seconds between the rounds that send due asks (an `observed` report also starts one)
ROUND_SECONDS = 1.0


class Dialback:
    """The module docstring; built by the mesh, which routes DIALBACK_PATH to `serve`."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.reach, self.counters = mesh, mesh.reach, mesh.counters
        self.limits = mesh.settings.dialback
        self.gate = DialbackGate(self.limits, time.monotonic)
        self._client: aiohttp.ClientSession | None = None
        #: connections whose peer already sent its `observed` (one report per connection)
        self._reported: weakref.WeakSet[Link] = weakref.WeakSet()
        for op, handler in (("observed", self._on_observed), ("dialback", self._on_dialback),
                            ("dialback_result", self._on_result)):
            mesh.nat.register(op, handler)

    async def start(self) -> None:
        # a connection per dial-back, closed after it: a pooled one would prove nothing
        connector = aiohttp.TCPConnector(force_close=True, limit=self.limits.concurrent)
        self._client = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.limits.timeout_seconds),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _direct(self, link: Link) -> tuple[str, int] | None:
        """(the peer's address as we see it, our local port) of a direct connection; None when relayed."""
        return self.mesh.connections.endpoints.get(link)

    # -- observed (34.1) --------------------------------------------------------------------

    def admitted(self, link: Link) -> None:
        """Tell a peer that speaks hmp-nat/1 where we see it (not over a relayed connection):
        queued, the mesh's greeting flushes it."""
        endpoints = self._direct(link)
        if endpoints is not None:
            link.session.send_nat("observed", addr=endpoints[0])

    async def _on_observed(self, link: Link, message: dict[str, Any]) -> None:
        endpoints = self._direct(link)
        if endpoints is None or link in self._reported:
            self.counters["observed_ignored"] += 1  # relayed: not about our address; or a second report
            return
        self._reported.add(link)
        if self.reach.observed(link.did, message.get("addr"), endpoints[1], peer_ip=link.ip,
                               channel=str(link.channel)):
            await self.ask_round()

    # -- asking (34.2) ------------------------------------------------------------------------

    async def ask_round(self) -> None:
        """Send the dial-backs `reach` asks for now, each on its peer's connection."""
        links = {did: link for did, link in self.mesh.sessions.items()
                 if not link.closed and link.session.nat and self._direct(link) is not None}
        for ask in self.reach.asks(links):
            link = links[ask.peer]
            if link.session.send_nat("dialback", id=ask.id, addr=ask.addr, nonce=ask.nonce) and await link.flush():
                continue
            self.reach.unsent(ask)

    async def loop(self) -> None:
        """Asks come due (re-checks, peers reconnected) without a new report: look each second."""
        while True:
            await asyncio.sleep(ROUND_SECONDS)
            try:
                await self.ask_round()
            except Exception:
                log.exception("dial-back round failed")

    async def serve(self, request: web.Request) -> web.Response:
        """GET DIALBACK_PATH?nonce=...: 204 whatever the nonce (a prober learns nothing)."""
        if not self.reach.arrived(request.query.get("nonce"), request.remote or ""):
            self.mesh.node.refuse("dialback", "unasked")
        return web.Response(status=204)

    async def _on_result(self, link: Link, message: dict[str, Any]) -> None:
        self.reach.result(link.did, message.get("id"), message.get("ok"), message.get("reason"))

    # -- serving (34.2) -----------------------------------------------------------------------

    async def _on_dialback(self, link: Link, message: dict[str, Any]) -> None:
        parsed = parse_dialback(message)
        if parsed is None:
            ask_id = message.get("id")
            self.counters["dialback_malformed"] += 1
            if type(ask_id) is int and 0 <= ask_id < 2**53:
                await self._refuse(link, ask_id, "malformed")
            return
        ask_id, ip, port, nonce = parsed
        reason = self.gate.admit(link.did, link.ip, self._direct(link) is not None, ip)
        if reason is not None:
            await self._refuse(link, ask_id, reason)
            return
        self.mesh.spawn(self._dial(link, ask_id, ip, port, nonce))

    async def _dial(self, link: Link, ask_id: int, ip: str, port: int, nonce: str) -> None:
        """Open a connection to the asker's own IP and send the nonce; then the result frame."""
        url = f"http://{url_host(ip)}:{port}{DIALBACK_PATH}?nonce={nonce}"
        ok = False
        try:
            assert self._client is not None
            async with self._client.get(url, allow_redirects=False):
                ok = True  # any HTTP answer: the asker's port took the request
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            pass
        finally:
            self.gate.done()
        self.counters["dialback_served"] += 1
        await self._answer(link, ask_id, ok, "" if ok else "unreachable")

    async def _refuse(self, link: Link, ask_id: int, reason: str) -> None:
        self.counters[f"dialback_refused_{reason}"] += 1
        self.mesh.node.refuse("dialback", reason)
        await self._answer(link, ask_id, False, reason)

    async def _answer(self, link: Link, ask_id: int, ok: bool, reason: str) -> None:
        if not link.closed and link.session.send_nat("dialback_result", id=ask_id, ok=ok, reason=reason):
            await link.flush()
