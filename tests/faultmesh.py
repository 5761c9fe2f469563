"""Directed delivery through a relay while links fail, on real nodes (tests and
scripts/fault_delivery): a sender S, a relay R and a recipient B as `hmpnode run`
processes, each peer link behind a FaultProxy (tests/faultproxy.py).

The topology: LAN discovery and the DHT are off. S and B each know one peer, R, at
the address of their own proxy to R (`meshutil.seed_peer(held=True)`: R's announce
in the handshake never replaces it), and R dials nobody (target 0). So S never
learns of B, and its mail for B goes to R (a relay that takes directed mail) while
B fetches it from R; the proxies listen and dial from PROXY_HOST, so a session with
any other address went around them (`Trio.bypassed`). R listens on a fixed port so
that a restarted R is behind the same proxies; every restart keeps the store.

What an agent sees of delivery is its event stream (`AgentStream`: B's, opened
before the first container and resumed across B's restarts); `converge` measures,
from the moment faults stop, when each link is back, when S's outbox is empty and
when B's agent has seen every container, and what waited in the outbox then.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hmpnode.client import Client, ClientError
from hmpnode.container.encoding import parse_time
from tests.faultproxy import FaultProxy
from tests.meshutil import MeshNode, mesh_env, seed_peer, wait_for
from tests.nodeproc import NodeProcess, Nodes

__all__ = ["PROXY_HOST", "Trio", "AgentStream", "Fault", "fault_plan", "Report", "relay_restart", "faults_then_heal"]

#: where the proxies listen and dial from (a loopback address no node uses)
PROXY_HOST = "127.0.0.2"
RELAY_ROLES = "relay,mailman"
#: the two links, by the node on R's far side
LINKS = ("s", "b")
NAMES = {"s": "sender", "r": "relay", "b": "recipient"}
#: longest wait between dial rounds to R: a link is back within a few seconds of the
#: faults stopping, whatever failed before (default 900 s); the outbox is what is measured
DIAL_BACKOFF_MAX = "2"
#: how often the measurement looks (seconds)
POLL = 0.2


def fixed_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range: while R is down, no connection
    on this host is given it as its local port, so R can listen on it again. Drawn
    from the OS's entropy, not a run's seed: parallel runs draw different ones."""
    rng = random.SystemRandom()
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(50):
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in 10000-{low} after 50 tries")


class Trio:
    """S, R and B with a proxy on each of the links S-R and B-R (module docstring)."""

    def __init__(self, nodes: Nodes, base: Path, *, rng: random.Random):
        self.factory, self.base = nodes, Path(base)
        self.r_port = fixed_port()
        quiet = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false",
                 "HMPNODE_PEER_DIAL_BACKOFF_MAX_SECONDS": DIAL_BACKOFF_MAX}
        self.env = {
            "s": mesh_env(**quiet), "b": mesh_env(**quiet),
            "r": mesh_env(**quiet, HMPNODE_PEER_PORT=str(self.r_port), HMPNODE_PEER_TARGET_PEERS="0",
                          HMPNODE_PEER_MIN_OUTBOUND="0"),
        }
        self.args = {"s": (), "b": (), "r": ("--roles", RELAY_ROLES)}
        self.proxies = {link: FaultProxy(self.r_port, host=PROXY_HOST, rng=random.Random(rng.random()), name=link)
                        for link in LINKS}
        self.node: dict[str, MeshNode] = {}
        self.proc: dict[str, NodeProcess] = {}
        self.restarts = Counter[str]()
        #: a kill waits for a start in progress, and the other way round
        self._locks = {name: asyncio.Lock() for name in NAMES}

    def dir(self, name: str) -> Path:
        return self.base / NAMES[name]

    async def _run(self, name: str) -> MeshNode:
        proc = self.factory(self.dir(name), *self.args[name], env=self.env[name])
        await asyncio.to_thread(proc.wait_ready)  # the proxies run on this loop meanwhile
        self.proc[name] = proc
        self.node[name] = MeshNode(proc)
        return self.node[name]

    async def start(self) -> None:
        relay = await self._run("r")
        for proxy in self.proxies.values():
            await proxy.start()
        # a first run makes the store, whose peers table then gets R at the proxy
        await asyncio.gather(*(self._run(name) for name in LINKS))
        for name in LINKS:
            await self.stop(name)
            seed_peer(self.dir(name), relay.did, self.proxies[name].address, roles=tuple(RELAY_ROLES.split(",")),
                      held=True)
        await asyncio.gather(*(self._run(name) for name in LINKS))
        await wait_for(self.linked, 60, "S and B to connect to R through their proxies", every=POLL)

    def up(self, name: str) -> bool:
        return name in self.proc and self.proc[name].alive()

    async def stop(self, name: str) -> None:
        """SIGTERM, and wait for the exit."""
        async with self._locks[name]:
            await self.node[name].close()
            await asyncio.to_thread(self.proc[name].stop)

    async def kill(self, name: str) -> None:
        """SIGKILL (the store stays as the kill left it); nothing when it is down."""
        async with self._locks[name]:
            if self.up(name):
                await self._kill(name)

    async def _kill(self, name: str) -> None:
        await self.node[name].close()
        self.proc[name].kill()
        await asyncio.to_thread(self.proc[name].wait)

    async def restart(self, name: str) -> None:
        """SIGKILL if up, then start again on the same store."""
        async with self._locks[name]:
            if self.up(name):
                await self._kill(name)
            self.restarts[name] += 1
            await self._run(name)

    async def _connected(self, name: str) -> set[str]:
        if not self.up(name):
            return set()
        try:
            return await self.node[name].connected()
        except (ClientError, OSError):
            return set()

    async def link_up(self, link: str) -> bool:
        """A session between `link` (S or B) and R, seen by both."""
        if not (self.up(link) and self.up("r")):
            return False
        return (self.node["r"].did in await self._connected(link)
                and self.node[link].did in await self._connected("r"))

    async def linked(self) -> bool:
        return all([await self.link_up(link) for link in LINKS])

    async def bypassed(self) -> list[str]:
        """What says a session went around the proxies: S knowing B at all, a row for R
        naming another address than the proxy's, a session from another address."""
        found = []
        if self.node["b"].did in await self.node["s"].known():
            found.append("S knows B")
        for name in ("s", "r", "b"):
            for peer in await self.node[name].peers():
                if name in LINKS and peer["did"] == self.node["r"].did \
                        and peer.get("addresses") != [self.proxies[name].address]:
                    found.append(f"{NAMES[name]} has R at {peer.get('addresses')}")
                if peer["connected"] and peer.get("ip") != PROXY_HOST:
                    found.append(f"{NAMES[name]} has a session with {peer['did']} from {peer.get('ip')}")
        return found

    def heal(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()

    async def close(self) -> None:
        for node in self.node.values():
            await node.close()
        for proxy in self.proxies.values():
            await proxy.close()


class AgentStream:
    """B's agent: its event stream, every container B stores, in store order, read from
    before the first one S sends and resumed (Last-Event-ID) across B's restarts."""

    def __init__(self, data_dir: Path):
        self.client = Client.from_data_dir(data_dir)
        self.seen: list[str] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Subscribe, then make notes of B's own until one is on the stream (a note made
        before the subscription took effect is not): from then on the stream has a
        cursor and misses nothing."""
        self._task = asyncio.ensure_future(self._read())
        for i in range(20):
            marker = (await self.client.create("note", {"text": f"B's agent listens from here ({i})"}))["did"]

            async def seen(marker=marker) -> bool:
                return marker in self.seen

            with contextlib.suppress(AssertionError):
                await wait_for(seen, 2, "B's agent to see its own note", every=POLL)
                return
        raise AssertionError("B's event stream showed none of 20 notes")

    async def _read(self) -> None:
        # B is down a few seconds at a time: retries every <= 0.5 s, for minutes at most
        async for event in self.client.events(max_retries=400, backoff=0.1, max_backoff=0.5):
            if event.get("event") == "container":
                self.seen.append(event["did"])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ClientError):
                await self._task
        await self.client.close()


async def send(trio: Trio, count: int, *, per_second: float | None = None) -> list[str]:
    """S's agent makes `count` containers for B (encrypted to B), at most `per_second`."""
    to = [{"public_key": trio.node["b"].public_key, "did": trio.node["b"].did}]
    client = trio.node["s"].client
    start, made = time.monotonic(), []
    for i in range(count):
        if per_second:
            await asyncio.sleep(max(0.0, start + i / per_second - time.monotonic()))
        made.append((await client.create("note", {"n": i, "for": "B"}, encrypt_for=to))["did"])
    return made


@dataclass
class Report:
    """What a run saw. Times are seconds from the moment faults stopped (None: not
    within the wait); `*_after_link` from when the path concerned was back."""

    scenario: str
    sent: int
    seed: int | None = None
    faults: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    #: each link: when it had a session again, both ends
    link_up: dict[str, float | None] = field(default_factory=dict)
    outbox_empty: float | None = None
    delivered: float | None = None
    #: S's outbox when the S-R link was back, and by when its own retry times made the last of it due
    waiting_at_link: int | None = None
    last_due_after_link: float | None = None
    #: S's outbox this many seconds after the S-R link was back
    waiting_after: dict[str, int] = field(default_factory=dict)
    #: B's agent: containers not seen when the wait ended, seen more than once; B's store: those held for B
    missing: int = 0
    repeated: int = 0
    stored_at_b: int = 0
    relay_held: int | None = None
    #: flips made, how many ended their connection, and the longest a flipped one lasted after it
    flips: int = 0
    flips_ended: int = 0
    flip_to_end_max: float | None = None
    bypassed: list[str] = field(default_factory=list)

    @property
    def outbox_after_link(self) -> float | None:
        up = self.link_up.get("s")
        return None if up is None or self.outbox_empty is None else round(self.outbox_empty - up, 3)

    @property
    def delivered_after_links(self) -> float | None:
        ups = list(self.link_up.values())
        if self.delivered is None or not ups or None in ups:
            return None
        return round(max(0.0, self.delivered - max(ups)), 3)  # 0: all there before the links were

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outbox_after_link": self.outbox_after_link,
                "delivered_after_links": self.delivered_after_links}


async def _outbox(trio: Trio) -> list[dict[str, Any]]:
    return (await trio.node["s"].client.request("GET", "/v1/mesh/queues", params={"limit": "1000"}))["outbox"]


def _until(text: str) -> float:
    return parse_time(text).timestamp() - time.time()


async def converge(trio: Trio, stream: AgentStream, sent: list[str], report: Report, *, healed: float,
                   wait: float, links_within: float = 30.0, start_b: bool = False) -> None:
    """Watch from `healed` (monotonic: faults stopped) until every link is up, S's
    outbox is empty and B's agent saw all of `sent`; give up `wait` s after the links
    were back (or `links_within` s after `healed` if they never were). `start_b`: B is
    started once the S-R link is back (the relay scenario)."""
    want = set(sent)
    since = lambda: round(time.monotonic() - healed, 3)  # noqa: E731
    marks = (5, 10, 20)
    b_task: asyncio.Task | None = None
    try:
        while True:
            for link in LINKS:
                if report.link_up.get(link) is None and await trio.link_up(link):
                    report.link_up[link] = since()
                    if link == "s":
                        waiting = await _outbox(trio)
                        report.waiting_at_link = len(waiting)
                        report.last_due_after_link = round(max((_until(e["next_attempt"]) for e in waiting),
                                                               default=0.0), 1)
                        if start_b and not trio.up("b"):
                            b_task = asyncio.ensure_future(trio.restart("b"))
            s_up = report.link_up.get("s")
            if s_up is not None:
                outbox = (await trio.node["s"].client.status())["mesh"]["outbox"]
                for mark in marks:
                    if since() - s_up >= mark and str(mark) not in report.waiting_after:
                        report.waiting_after[str(mark)] = outbox
                if outbox == 0 and report.outbox_empty is None:
                    report.outbox_empty = since()
            if report.delivered is None and want.issubset(stream.seen):
                report.delivered = since()
            ups = [report.link_up.get(link) for link in LINKS]
            if None not in ups and report.outbox_empty is not None and report.delivered is not None:
                return
            limit = links_within if None in ups else max(ups) + wait
            if since() > limit:
                return
            await asyncio.sleep(POLL)
    finally:
        if b_task is not None:
            await b_task


async def tally(trio: Trio, stream: AgentStream, sent: list[str], report: Report) -> None:
    """Exactly once: what B's agent saw and B stores of `sent`, after a second more for
    anything late; the relay's queue; whether anything went around the proxies."""
    await asyncio.sleep(1.0)
    seen = Counter(d for d in stream.seen if d in set(sent))
    report.missing = len(set(sent) - set(seen))
    report.repeated = sum(1 for n in seen.values() if n > 1)
    if trio.up("b"):
        b = trio.node["b"]
        report.stored_at_b = len({item["did"] async for item in b.client.iterate(recipient=b.did, limit=500)}
                                 & set(sent))
    if trio.up("r"):
        report.relay_held = (await trio.node["r"].client.status())["mesh"]["relay"]["held"]
    flips = [(conn, at) for proxy in trio.proxies.values() for conn, at in proxy.flips]
    ended = [conn.ended - at for conn, at in flips if conn.ended is not None]
    report.flips, report.flips_ended = len(flips), len(ended)
    report.flip_to_end_max = round(max(ended), 3) if ended else None
    report.restarts = {NAMES[k]: v for k, v in trio.restarts.items()}
    report.bypassed = await trio.bypassed()


async def relay_restart(trio: Trio, stream: AgentStream, count: int, *, down: float, wait: float) -> Report:
    """B is offline; S sends half of `count`, R is SIGKILLed while S still pushes them to
    it, S sends the other half; R stays down `down` s from the kill, then comes back
    (store kept); once S is connected to it again, B comes online. The clock starts at R's restart."""
    report = Report("relay_restart", count)
    await trio.stop("b")
    sent = await send(trio, count // 2)
    killed = time.monotonic()
    await trio.kill("r")
    sent += await send(trio, count - count // 2)
    await asyncio.sleep(max(0.0, killed + down - time.monotonic()))
    healed = time.monotonic()
    await trio.restart("r")
    await converge(trio, stream, sent, report, healed=healed, wait=wait, start_b=True)
    await tally(trio, stream, sent, report)
    return report


# -- the faults ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """One fault of a plan: at `at` s, `kind` on `target` (a link, or "r"/"b" for a kill)."""

    at: float
    kind: str
    target: str
    #: how long it lasts (latency, stall, partition, kill: the time down); inf: until the faults stop
    seconds: float = 0.0
    #: latency: (delay, jitter); partition: mode; flip: towards R?
    value: Any = None


KINDS = ("latency", "stall", "reset", "partition", "flip")


def fault_plan(rng: random.Random, seconds: float, *, restarts: int = 2, tail: float = 0.0) -> list[Fault]:
    """Faults for `seconds` from a seeded `rng`: one every 0.5-2.5 s on a random link,
    and `restarts` SIGKILL + restart of R and of B each, spread over the time; then
    for `tail` s both links partitioned (until the faults stop), so that mail waits
    for a path when they do."""
    plan = []
    at = rng.uniform(0.2, 1.0)
    while at < seconds:
        kind, target = rng.choice(KINDS), rng.choice(LINKS)
        if kind == "latency":
            plan.append(Fault(at, kind, target, rng.uniform(2, 8), (rng.uniform(0, 0.3), rng.uniform(0, 0.2))))
        elif kind == "stall":
            plan.append(Fault(at, kind, target, rng.uniform(0.5, 4)))
        elif kind == "partition":
            plan.append(Fault(at, kind, target, rng.uniform(1, 5), rng.choice(("refuse", "blackhole"))))
        elif kind == "flip":
            plan.append(Fault(at, kind, target, value=rng.random() < 0.5))
        else:
            plan.append(Fault(at, kind, target))
        at += rng.uniform(0.5, 2.5)
    for node in ("r", "b"):
        for i in range(restarts):
            plan.append(Fault(seconds * (i + rng.uniform(0.15, 0.85)) / restarts, "kill", node, rng.uniform(1, 4)))
    if tail > 0:
        plan += [Fault(seconds, "partition", link, math.inf, rng.choice(("refuse", "blackhole"))) for link in LINKS]
    return sorted(plan, key=lambda f: f.at)


async def _apply(trio: Trio, fault: Fault, undo: list[asyncio.Task], healed: asyncio.Event) -> None:
    if fault.kind == "kill":
        if trio.up(fault.target):
            await trio.kill(fault.target)
            undo.append(asyncio.ensure_future(_restart_after(trio, fault.target, fault.seconds, healed)))
        return
    proxy = trio.proxies[fault.target]
    if fault.kind == "latency":
        proxy.latency(*fault.value)
        undo.append(asyncio.get_running_loop().call_later(fault.seconds, proxy.latency, 0.0))
    elif fault.kind == "stall":
        proxy.stall(fault.seconds)
    elif fault.kind == "reset":
        proxy.reset()
    elif fault.kind == "partition":
        proxy.partition(fault.value)
        if math.isfinite(fault.seconds):
            undo.append(asyncio.get_running_loop().call_later(fault.seconds, proxy.partition, None))
    elif fault.kind == "flip":
        proxy.flip(fault.value)


async def _restart_after(trio: Trio, name: str, seconds: float, healed: asyncio.Event) -> None:
    """Down for `seconds`, or until the faults stop."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(healed.wait(), seconds)
    await trio.restart(name)


async def faults_then_heal(trio: Trio, stream: AgentStream, count: int, *, seed: int, seconds: float,
                           restarts: int, wait: float, tail: float = 5.0) -> Report:
    """S sends `count` containers to B while the seeded plan's faults run for `seconds`
    s and then both links are partitioned for `tail` s (sending is paced to end half
    way through the tail; the faults go on until the last is sent); then every fault
    stops (the clock starts), and R and B come back at once if down."""
    report = Report("faults", count, seed=seed)
    plan = fault_plan(random.Random(seed), seconds, restarts=restarts, tail=tail)
    sending = asyncio.ensure_future(send(trio, count, per_second=count / (seconds + tail / 2)))
    undo: list = []  # timer handles (latency, partition) and the restarts after kills
    healed = asyncio.Event()
    start = time.monotonic()
    try:
        for fault in plan:
            await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
            await _apply(trio, fault, undo, healed)
            report.faults[fault.kind] = report.faults.get(fault.kind, 0) + 1
        await asyncio.sleep(max(0.0, start + seconds + tail - time.monotonic()))
        sent = await sending
    finally:
        sending.cancel()
        for handle in undo:
            if isinstance(handle, asyncio.TimerHandle):
                handle.cancel()
        trio.heal()
        healed.set()
        healed_at = time.monotonic()
        # the restarts after kills, at once now (also on the way out: no node starts after cleanup)
        restarted = await asyncio.gather(*(u for u in undo if isinstance(u, asyncio.Task)), return_exceptions=True)
    for outcome in restarted:
        if isinstance(outcome, BaseException):
            raise outcome
    await asyncio.gather(*(trio.restart(n) for n in ("r", "b") if not trio.up(n)))
    await converge(trio, stream, sent, report, healed=healed_at, wait=wait)
    await tally(trio, stream, sent, report)
    return report
