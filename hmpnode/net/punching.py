"""Hole punching's driver (docs/protocol.md 34.4): the `punch` / `punch_sync` nat ops, the
simultaneous-open dialler and the takeover of a relayed session by the punched stream.

hmpnode.net.punch decides (one `Punch` per peer, `PunchGate`, `vet_addrs`); this binds the
port, sends the frames, dials at the moment the machine names and hands the connected
stream to `Connections.adopt` (the v2 handshake on a `StreamCarrier`, A initiator): the
one-connection rule then makes the direct link replace the relayed one on both ends."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from hmpnode.net import dialing as D
from hmpnode.net import punch as P
from hmpnode.net.announce import parse_addr
from hmpnode.net.carrier import StreamCarrier
from hmpnode.net.link import Link
from hmpnode.net.reach import format_addr

if TYPE_CHECKING:
    from hmpnode.net.connections import Connections
    from hmpnode.net.host import Host

__all__ = ["Punching", "bind_port", "simultaneous_open"]

log = logging.getLogger("hmpnode.mesh")



def bind_port(ip: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (ip, port), not listening: the punch's local port P. Address
    and port reuse let each SYN of the attempt leave from P again after a reset."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((ip, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def simultaneous_open(local: tuple[str, int], addrs: tuple[str, ...], at: float, until: float,
                            max_syns: int) -> tuple[socket.socket | None, str]:
    """Connect from `local` to each of `addrs` at monotonic `at`, until `until` or
    `max_syns` SYNs in all; meanwhile `local` also listens, for the peer's SYN that gets
    through before ours leaves (only from the IPs of `addrs`; anything else is closed).

    The crossing SYNs make one connection (simultaneous open), or one SYN reaches the
    other side's listener: either way each side holds the same single connection. A
    connect refused by a reset (the peer's port was not open yet) is tried again at once.
    The first stream wins, the others are closed: (socket, "") or (None, "refused" when
    every SYN met a reset, else "timeout")."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    peers = {str(ipaddress.ip_address(h)) for _s, h, _p in map(parse_addr, addrs)}
    syns = [0]
    outcomes: list[str] = []
    stop = asyncio.Event()  # set when a stream won: a connect loop must not go on (a cancel may be lost)

    async def one(addr: str) -> socket.socket | None:
        _scheme, host, port = parse_addr(addr)
        while syns[0] < max_syns and time.monotonic() < until and not stop.is_set():
            syns[0] += 1
            try:
                sock = bind_port(local[0], local[1])
            except OSError:
                outcomes.append("timeout")
                await asyncio.sleep(0.01)  # the port is still held by a socket closing: a moment
                continue
            try:
                async with asyncio.timeout(max(0.001, until - time.monotonic())):
                    await loop.sock_connect(sock, (host, port))
                return sock
            except ConnectionRefusedError:
                outcomes.append("refused")
            except (OSError, asyncio.TimeoutError):
                outcomes.append("timeout")
                await asyncio.sleep(0.01)
            sock.close()
        return None

    async def accept(listener: socket.socket) -> socket.socket | None:
        while True:
            conn, addr = await loop.sock_accept(listener)
            if str(ipaddress.ip_address(addr[0])) in peers:
                return conn
            conn.close()  # a stranger on our punch port

    listener = bind_port(local[0], local[1])
    listener.listen(4)
    tasks = [asyncio.ensure_future(one(a)) for a in addrs]
    tasks.append(asyncio.ensure_future(accept(listener)))
    won: socket.socket | None = None
    try:
        pending = set(tasks)
        deadline = until + 0.5  # a connect in flight at `until` ends by then
        while pending and won is None:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for task in done:
                if not task.cancelled() and task.exception() is None and task.result() is not None and won is None:
                    won = task.result()
            if all(t.done() for t in tasks[:-1]) and won is None:
                break  # every connect gave up: the listener alone does not wait on
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                other = await task
                if other is not None and other is not won:
                    other.close()
        listener.close()
    if won is not None:
        return won, ""
    return None, "refused" if outcomes and all(o == "refused" for o in outcomes) else "timeout"


class Punching:
    """The punches of this node: one `Punch` per peer (the last one is kept for
    `/v1/peers`), each run by its own task fed with that peer's punch frames."""

    def __init__(self, host: Host, connections: Connections, limits: P.PunchLimits) -> None:
        self.host, self.connections, self.limits = host, connections, limits
        self.gate = P.PunchGate(limits)
        #: the current or last punch with each peer (dropped when it is no longer connected)
        self.punches: dict[str, P.Punch] = {}
        self._inbox: dict[str, asyncio.Queue[P.PunchFrame]] = {}
        #: the link and task of each running punch (a punch belongs to one connection)
        self._links: dict[str, Link] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        #: the IP a relay reported for a peer (`relay_reported`), which vouches for its punch addresses
        self.seen_ips: dict[str, str] = {}

    def relay_reported(self, did: str, ip: str) -> None:
        """The relay of our circuit with `did` saw it connect from `ip` (34.3): a punch may
        dial that IP. The last 4096 peers' reports are kept."""
        self.seen_ips.pop(did, None)
        self.seen_ips[did] = ip
        while len(self.seen_ips) > 4096:
            del self.seen_ips[next(iter(self.seen_ips))]

    def register(self, nat: Any) -> None:
        nat.register("punch", self.on_frame)
        nat.register("punch_sync", self.on_frame)

    def view(self, did: str) -> dict[str, Any] | None:
        punch = self.punches.get(did)
        return None if punch is None else punch.view()

    @property
    def counters(self):
        return self.host.counters

    # -- starting ---------------------------------------------------------------------------

    def admitted(self, link: Link) -> None:
        """A session was admitted: N (we accepted a relayed connection from a peer that
        speaks hmp-nat/1) starts a punch."""
        for did in [d for d in self.punches if d not in self.host.sessions and d not in self._inbox]:
            del self.punches[did]  # peers gone: what /v1/peers no longer lists
        self._supersede(link)
        if link.via is None or link.initiator or not link.session.nat or link.did in self._inbox:
            return
        reason = self.gate.start(link.did, time.monotonic())
        if reason is not None:
            self.counters[f"punch_{reason}"] += 1
            return
        self._begin(link, P.Punch("n", self.limits))

    def _supersede(self, link: Link) -> None:
        """A punch running over another connection with the same peer (both dialled through
        the relay at once, and this one was kept, 21.3) ends as `closed` now, so that one
        can start over `link`: left running it would keep the peer's slot until its deadline,
        and the kept session would never be punched."""
        old = self._links.get(link.did)
        if old is None or old is link:
            return
        self.counters["punch_superseded"] += 1
        punch = self.punches.get(link.did)
        if punch is not None and not punch.done:
            punch.end("closed")
        task = self._tasks.pop(link.did, None)
        self._inbox.pop(link.did, None)
        del self._links[link.did]
        self.gate.ended(link.did)
        if task is not None:
            task.cancel()

    def _begin(self, link: Link, punch: P.Punch, first: P.PunchFrame | None = None) -> None:
        self.punches[link.did] = punch
        inbox: asyncio.Queue[P.PunchFrame] = asyncio.Queue(maxsize=8)
        if first is not None:
            inbox.put_nowait(first)
        self._inbox[link.did] = inbox
        self._links[link.did] = link
        self.counters["punch_started"] += 1
        self._tasks[link.did] = self.host.spawn(self._run(link, punch, inbox))

    async def on_frame(self, link: Link, message: dict[str, Any]) -> None:
        """A `punch` or `punch_sync` frame: to the peer's running punch, or (a `punch` on a
        relayed connection we dialled) the start of one as A."""
        frame = P.parse_frame(message, self.limits.max_addrs)
        if isinstance(frame, str):
            self.counters["punch_malformed"] += 1
            await self.host.drive(link, link.session.refuse("malformed_frame", f"{message.get('op')}: {frame}",
                                                            time.monotonic()))
            await link.flush()
            return
        if self.host.sessions.get(link.did) is not link:
            return
        self._supersede(link)
        inbox = self._inbox.get(link.did)
        if inbox is not None:
            with contextlib.suppress(asyncio.QueueFull):  # a peer flooding its own punch only loses frames
                inbox.put_nowait(frame)
            return
        if frame.op != "punch" or link.via is None or not link.initiator:
            self.counters["punch_unexpected"] += 1  # only N starts, and only over a relayed connection
            return
        punch = P.Punch("a", self.limits)
        if self.gate.start(link.did, time.monotonic()) is not None:
            self.counters["punch_rate_limited"] += 1
            # answered with a refusal, not started: the machine says so to N
            effects = punch.requested(time.monotonic(), frame, (), (), "refused")
            await self._send(link, effects)
            self.punches[link.did] = punch
            return
        self._begin(link, punch, frame)

    # -- one punch --------------------------------------------------------------------------

    async def _run(self, link: Link, punch: P.Punch, inbox: asyncio.Queue[P.PunchFrame]) -> None:
        """Carry out what the machine says until the punch is done (or the link closed)."""
        run = _Run(link, punch, inbox)
        try:
            pending: list[P.Effect] = self._attempt(run) if punch.role == "n" else []
            while True:
                if pending:  # what the machine said, in order (a refusal is sent, then the punch ends)
                    pending = pending[1:] + await self._carry_out(run, pending[0])
                    continue
                if punch.done:
                    break
                if link.closed:
                    punch.end("closed")
                    break
                pending = await self._wait(run)
        except Exception:
            log.exception("punch with %s failed", link.did)
            if not punch.done:
                punch.end("closed")
        finally:
            run.release()
            if self._links.get(link.did) is link:  # not superseded (then the new run owns these)
                del self._links[link.did]
                self._inbox.pop(link.did, None)
                self._tasks.pop(link.did, None)
                self.gate.ended(link.did)
            self._outcome(run)

    def _attempt(self, run: _Run) -> list[P.Effect]:
        """N: a fresh port and the attempt's `punch` frame."""
        addrs, reason = self._offer(run)
        return run.punch.attempt(time.monotonic(), addrs, reason)

    def _offer(self, run: _Run) -> tuple[list[str], str | None]:
        """Our addresses for this attempt: a freshly bound port P at each public IP peers
        saw us at (the NAT keeps P when it preserves ports), or why we cannot take part."""
        run.release()
        bind_ip = _bind_ip(self.host.settings.host)
        ips, preserving = list(self.host.reach.public_ips()), self.host.reach.port_preserving()  # 34.1
        ips = [ip for ip in ips if _family(ip) == _family(bind_ip)][: self.limits.max_addrs]
        if not ips:
            return [], "no_public_address"
        if preserving is False:
            # our NAT changes ports, so P may not be P outside; we still offer it and dial:
            # our SYNs reach a peer whose NAT forwards every port (1:1) or that listens at P
            self.counters["punch_offer_unpreserved"] += 1
        try:
            run.holder = bind_port(bind_ip)
        except OSError:
            return [], "refused"
        port = run.holder.getsockname()[1]
        return [format_addr(ip, port) for ip in ips], None

    def _vet(self, run: _Run, frame: P.PunchFrame) -> list[str]:
        """What of the peer's addresses we dial (punch.vet_addrs): IPs its connection (when
        direct), its relay's report or its signed announce show, within the dial policy."""
        link = run.link
        vouched = {ip for ip in (_ip_of(a) for a in link.info.announce.addresses) if ip}
        if link.via is None:
            vouched.add(link.ip)
        if link.did in self.seen_ips:
            vouched.add(self.seen_ips[link.did])
        origin = D.peer_origin(link.ip, self.host.dialer.interfaces())
        policy = self.host.settings.dialing.policy
        kept = P.vet_addrs(frame.addrs, vouched, lambda a: D.check(a, origin, policy, schemes=("tcp",)) is None)
        kept = [a for a in kept if _family(_ip_of(a) or "") == _family(_bind_ip(self.host.settings.host))]
        if frame.addrs and not kept:
            self.counters["punch_addrs_refused"] += 1
        return kept

    async def _wait(self, run: _Run) -> list[P.Effect]:
        """The next frame of the peer, or the deadline the machine waits for."""
        punch = run.punch
        timed = punch.waiting in ("answer", "sync", "next")
        timeout = punch.deadline - time.monotonic() if timed else self.limits.answer_seconds
        try:
            frame = run.inbox.get_nowait() if not run.inbox.empty() else \
                await asyncio.wait_for(run.inbox.get(), max(0.001, timeout))
        except asyncio.TimeoutError:
            effects = punch.tick(time.monotonic())
            return effects if timed else punch.end("timeout")
        now = time.monotonic()
        if frame.op == "punch_sync":
            return punch.synced(now, frame) if punch.role == "a" else []
        addrs = self._vet(run, frame)
        if punch.role == "n":
            return punch.answered(now, frame, addrs)
        if frame.id == punch.id:
            return []  # a duplicate
        own, reason = [], "refused"
        if punch.attempts == 0 or self.gate.attempt(now):  # the first attempt was taken with the punch
            own, reason = self._offer(run) if addrs and frame.reason is None else ([], None)
        else:
            self.counters["punch_rate_limited"] += 1
        return punch.requested(now, frame, addrs, own, reason)

    async def _carry_out(self, run: _Run, effect: P.Effect) -> list[P.Effect]:
        punch = run.punch
        if isinstance(effect, P.Send):
            await self._send(run.link, [effect])
            return []
        if isinstance(effect, P.Dial):
            return punch.dialled(time.monotonic(), *await self._dial(run, effect))
        if isinstance(effect, P.Retry):
            await asyncio.sleep(max(0.0, effect.at - time.monotonic()))
            if not self.gate.attempt(time.monotonic()):
                self.counters["punch_rate_limited"] += 1
                punch.end("rate_limited")
                return []
            return self._attempt(run)
        return []  # Done: _outcome says it

    async def _dial(self, run: _Run, dial: P.Dial) -> tuple[bool, str]:
        """The simultaneous open, then the v2 handshake on the stream (A initiator); True
        when the direct link is the peer's session now."""
        if run.holder is None:
            return False, "refused"
        local = run.holder.getsockname()[:2]
        sock, reason = await simultaneous_open(local, dial.addrs, dial.at, dial.until, self.limits.max_syns)
        run.release()
        if sock is None:
            return False, reason
        carrier = await StreamCarrier.over(sock, chunk=65_536)
        peer = carrier.peer
        role = "initiator" if run.punch.role == "a" else "responder"
        direct = await self.connections.adopt(carrier, role, peer[0] if peer else "", run.link.did)
        return direct is not None, "refused"

    async def _send(self, link: Link, effects: list[P.Effect]) -> None:
        for effect in effects:
            if isinstance(effect, P.Send):
                link.session.send_nat(effect.op, **effect.members)
        await link.flush()

    def _outcome(self, run: _Run) -> None:
        """Counters and one log line (the time from the punch's start: relayed to direct)."""
        link, punch = run.link, run.punch
        took = (time.monotonic() - run.started) * 1000
        if punch.state == "direct":
            self.counters["punch_direct"] += 1
            self.counters[f"punch_direct_attempt_{min(punch.attempts, 3)}"] += 1
            log.info("peer %s: hole punched, direct after %.0f ms (attempt %d, rtt %s)", link.did, took,
                     punch.attempts, f"{punch.rtt * 1000:.1f} ms" if punch.rtt is not None else "-")
        else:
            self.counters["punch_failed"] += 1
            self.counters[f"punch_failed_{punch.reason}"] += 1
            log.info("peer %s: hole punching failed after %.0f ms (%s, %d attempts): the session stays relayed",
                     link.did, took, punch.reason, punch.attempts)


class _Run:
    """One running punch: its link, machine, inbox and the socket holding its port P."""

    def __init__(self, link: Link, punch: P.Punch, inbox: asyncio.Queue[P.PunchFrame]) -> None:
        self.link, self.punch, self.inbox = link, punch, inbox
        self.holder: socket.socket | None = None
        self.started = time.monotonic()

    def release(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None


def _ip_of(addr: str) -> str | None:
    try:
        scheme, host, _port = parse_addr(addr)
        return str(ipaddress.ip_address(host)) if scheme == "tcp" else None
    except ValueError:
        return None


def _family(ip: str) -> int:
    return 6 if ":" in ip else 4


def _bind_ip(host: str) -> str:
    """Where P is bound: the peer port's host when it is an IP literal, else every IPv4 address."""
    if host in ("", "0.0.0.0"):
        return "0.0.0.0"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return "0.0.0.0"
