"""The node's DHT at scale, in virtual time: N real `hmpnode.net.dht.Dht` nodes (the
`kademlia` package with our hardened protocol and `dhtrecords` policy) on an in-memory
UDP network (`hmpnode.sim.dgram`), with churn, and lookups measured.

A run (`run_dht_sim`), all in simulated time on `hmpnode.sim.vtime`:

1. `seeds` bootstrap nodes start, then the others join at random times in
   `join_window`, each through the seeds (the node's configured bootstrap list),
   and publishes what a starting node publishes: its `peer` record, and a
   `provider` record for each of its `providers` containers.
2. After `settle` seconds, the churn window opens: `churn` x N of the non-seed nodes
   each leave at a random time in its first half (the process stops: its routing
   table and its store are gone) and come back `down` seconds later (a new
   Kademlia id, as the node draws one per start; bootstrap through the seeds;
   its `peer` record published again; its provider records are not: the node's
   provide list is on disk with its next publish time, and replicas still hold them).
3. `lookups` reads at random times in the window, each from a random node that is
   up, of a random published record: a peer record (`find_peer`) or a provider
   record (`find_providers`, success when the publisher's DID is among them).

Everything random comes from `seed`: identities, Kademlia ids, message ids, the
library's refresh ids, latencies, the schedule. The same seed therefore gives the
same datagrams at the same virtual times, and the same `digest`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import kademlia.protocol
import kademlia.routing

from hmpnode.container.did import container_did_for
from hmpnode.identity.keys import Identity
from hmpnode.net.announce import make_address_record
from hmpnode.net.dht import Dht, DhtLimits
from hmpnode.net.dhtrecords import peer_key
from hmpnode.sim import vtime
from hmpnode.sim.dgram import DatagramNetwork

__all__ = ["DhtSim", "DhtSimConfig", "DhtSimResult", "SimNode", "kademlia_on_loop", "run_dht_sim"]

#: the virtual clock's 0 as a wall date (records carry RFC 3339 times)
EPOCH = datetime(2025, 1, 1, tzinfo=timezone.utc)
DHT_PORT = 4001
PEER_PORT = 4000


class _LoopClock:
    """`time.monotonic()` for kademlia.routing: the running loop's clock."""

    @staticmethod
    def monotonic() -> float:
        return asyncio.get_running_loop().time()


@contextlib.contextmanager
def kademlia_on_loop(rng: random.Random) -> Iterator[None]:
    """Point the `kademlia` package's module-level clock and RNG at the running loop and
    `rng` (restored on exit). `kademlia.routing` reads `time.monotonic()` (bucket
    ages, lonely buckets); `kademlia.protocol` draws refresh ids from `random`. The
    other modules read neither in the code the node uses (`network.py` draws a node id
    only when none is given, `storage.py` is replaced by our `RecordStore`, rpcudp's
    message ids are drawn by `HardenedProtocol` from the Dht's `rng`)."""
    saved = kademlia.routing.time, kademlia.protocol.random
    kademlia.routing.time, kademlia.protocol.random = _LoopClock, rng  # type: ignore[assignment]
    try:
        yield
    finally:
        kademlia.routing.time, kademlia.protocol.random = saved


@dataclass(frozen=True, slots=True)
class DhtSimConfig:
    nodes: int = 100
    seed: int = 1
    #: share of the nodes (seeds excepted) that leave and come back in the window
    churn: float = 0.3
    lookups: int = 200
    #: provider records each node publishes
    providers: int = 1
    #: bootstrap nodes (never churned)
    seeds: int = 4
    latency: tuple[float, float] = (0.020, 0.080)
    loss: float = 0.0
    #: seconds (simulated): joins spread over join_window, then settle, then the
    #: churn and lookup window
    join_window: float = 60.0
    settle: float = 30.0
    window: float = 120.0
    #: seconds a churned node stays away
    down: tuple[float, float] = (20.0, 60.0)
    limits: DhtLimits = field(default_factory=DhtLimits)

    def __post_init__(self) -> None:
        if self.nodes < 2 or not 1 <= self.seeds <= self.nodes:
            raise ValueError("nodes must be >= 2 and seeds in 1..nodes")
        if not 0 <= self.churn <= 1:
            raise ValueError("churn must be in [0, 1]")
        if self.lookups < 0 or self.providers < 0:
            raise ValueError("lookups and providers must be >= 0")
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be in [0, 1)")


@dataclass(frozen=True, slots=True)
class DhtSimResult:
    config: DhtSimConfig
    lookups: int
    found: int
    #: FIND_VALUE rounds of each lookup (`Dht.stats()["read_rounds"]`), sorted
    rounds: list[int]
    #: simulated seconds of each lookup, sorted
    latencies: list[float]
    churned: int
    #: most nodes down at one time
    down_peak: int
    datagrams: int
    sim_seconds: float
    wall_seconds: float
    peak_rss_mb: float
    digest: str

    @property
    def success(self) -> float:
        return self.found / self.lookups if self.lookups else 1.0


def _derive(seed: int, *parts: object) -> bytes:
    return hashlib.sha256(repr((seed, *parts)).encode()).digest()


class SimNode:
    """One simulated node: its identity, address, containers and (while up) its `Dht`."""

    def __init__(self, index: int, config: DhtSimConfig, network: DatagramNetwork, clock):
        self.index = index
        self.config = config
        self.network = network
        self.clock = clock
        self.identity = Identity(_derive(config.seed, "identity", index))
        # one /24 per node (the record store counts sources per /24)
        self.host = f"10.{(index >> 8) & 255}.{index & 255}.{1 + (index >> 16)}"
        self.address_records = [make_address_record(self.identity.did, f"tcp://{self.host}:{PEER_PORT}")]
        self.containers = [container_did_for(_derive(config.seed, "container", index, j))
                           for j in range(config.providers)]
        self.rng = random.Random(_derive(config.seed, "rng", index))
        self.dht: Dht | None = None
        self.ready = False
        self.busy = False

    @property
    def did(self) -> str:
        return self.identity.did

    async def start(self, bootstrap: list[tuple[str, int]], *, provide: bool) -> None:
        self.dht = Dht(self.identity, host=self.host, port=DHT_PORT, clock=self.clock, limits=self.config.limits,
                       rng=self.rng.randbytes, endpoint=self.network.create_datagram_endpoint)
        await self.dht.start([a for a in bootstrap if a != (self.host, DHT_PORT)])
        await self.dht.publish_peer(self.address_records)
        if provide:
            for container in self.containers:
                await self.dht.publish_provider(container)
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        dht, self.dht = self.dht, None
        if dht is not None:
            await dht.stop()

    async def lookup(self, target: SimNode, container: str | None) -> tuple[bool, int]:
        """Read `target`'s peer record (or its provider record of `container`):
        (found, FIND_VALUE rounds)."""
        dht = self.dht
        assert dht is not None
        self.busy = True
        try:
            before = dht.stats().get("read_rounds", 0)
            if container is None:
                record = await dht.find_peer(target.did)
                found = record is not None
            else:
                found = target.did in await dht.find_providers(container)
            return found, dht.stats().get("read_rounds", 0) - before
        finally:
            self.busy = False

    def holds_peer_record(self, did: str) -> bool:
        return self.dht is not None and bool(self.dht.held(peer_key(did)))


class DhtSim:
    """The nodes and the network of one run; `run_dht_sim` drives it."""

    def __init__(self, config: DhtSimConfig):
        self.config = config
        self.rng = random.Random(_derive(config.seed, "schedule"))
        self.network = DatagramNetwork(random.Random(_derive(config.seed, "network")), latency=config.latency,
                                       loss=config.loss)
        loop = asyncio.get_running_loop()
        self.clock = lambda: EPOCH + timedelta(seconds=loop.time())
        self.nodes = [SimNode(i, config, self.network, self.clock) for i in range(config.nodes)]
        self.bootstrap = [(n.host, DHT_PORT) for n in self.nodes[: config.seeds]]

    async def join_all(self) -> None:
        """Seeds first, then every other node at a random time in `join_window`."""
        for node in self.nodes[: self.config.seeds]:
            await node.start(self.bootstrap, provide=True)
        loop = asyncio.get_running_loop()
        start = loop.time()
        times = sorted((self.rng.uniform(0, self.config.join_window), node) for node in self.nodes[self.config.seeds:])
        await asyncio.gather(*(self._at(start + t, node.start(self.bootstrap, provide=True)) for t, node in times))

    @staticmethod
    async def _at(when: float, coro):
        await asyncio.sleep(max(0.0, when - asyncio.get_running_loop().time()))
        return await coro

    async def stop_all(self) -> None:
        for node in self.nodes:
            await node.stop()


async def _simulate(config: DhtSimConfig) -> DhtSimResult:
    loop = asyncio.get_running_loop()
    sim = DhtSim(config)
    rng = sim.rng
    await sim.join_all()
    await asyncio.sleep(config.settle)
    candidates = sim.nodes[config.seeds:]
    churned = rng.sample(candidates, round(config.churn * len(candidates)))
    down_now = 0
    down_peak = 0

    async def churn(node: SimNode, leave: float, away: float) -> None:
        nonlocal down_now, down_peak
        await asyncio.sleep(leave)
        while node.busy:  # a lookup in flight ends first: its result is measured, not aborted
            await asyncio.sleep(0.1)
        await node.stop()
        down_now += 1
        down_peak = max(down_peak, down_now)
        await asyncio.sleep(away)
        down_now -= 1
        await node.start(sim.bootstrap, provide=False)

    plans = [(node, rng.uniform(0, config.window / 2), rng.uniform(*config.down)) for node in churned]
    targets: list[tuple[SimNode, str | None]] = [(n, None) for n in sim.nodes]
    targets += [(n, c) for n in sim.nodes for c in n.containers]
    schedule = sorted(rng.uniform(0, config.window) for _ in range(config.lookups))
    found = 0
    rounds: list[int] = []
    latencies: list[float] = []

    async def one_lookup(when: float) -> None:
        nonlocal found
        await asyncio.sleep(when)
        origins: list[SimNode] = []
        for _ in range(100):  # the seeds never leave: one of them is free within a lookup's time
            origins = [n for n in sim.nodes if n.ready and not n.busy]
            if origins:
                break
            await asyncio.sleep(1.0)
        origin = rng.choice(origins)
        target, container = rng.choice(targets)
        while target is origin:
            target, container = rng.choice(targets)
        began = loop.time()
        ok, hops = await origin.lookup(target, container)
        latencies.append(loop.time() - began)
        rounds.append(hops)
        found += ok

    await asyncio.gather(*(churn(*plan) for plan in plans), *(one_lookup(t) for t in schedule))
    await sim.stop_all()
    return DhtSimResult(
        config=config, lookups=len(schedule), found=found, rounds=sorted(rounds), latencies=sorted(latencies),
        churned=len(churned), down_peak=down_peak, datagrams=sim.network.counters["sent"],
        sim_seconds=loop.time(), wall_seconds=0.0, peak_rss_mb=0.0, digest=sim.network.digest(),
    )


def run_dht_sim(config: DhtSimConfig) -> DhtSimResult:
    """Run one seeded simulation on a fresh virtual loop; its figures and trace digest."""
    began = time.perf_counter()
    with kademlia_on_loop(random.Random(_derive(config.seed, "kademlia"))):
        result = vtime.run(_simulate(config))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return dataclasses.replace(result, wall_seconds=time.perf_counter() - began, peak_rss_mb=rss)
