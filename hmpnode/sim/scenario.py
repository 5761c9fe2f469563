"""Seeded simulation runs of the mesh and the invariants checked after each.

`run(Scenario(...))` builds `nodes` simulated nodes (hmpnode.sim.mesh) on a virtual-time
loop, lets them connect, publishes broadcasts and directed mail from random nodes while
the faults of the scenario happen (nodes leaving and coming back, relays crashing and
restarting with their store, connections dropping, a partition, chosen frames lost on
live connections, clock skew), stops the faults, lets the mesh settle for `settle`
simulated seconds and checks the invariants (`Report.violations`):

- every broadcast reached every node; a `localhost`-scoped one never left its origin;
- every directed container reached its recipient, stored there exactly once, none lost;
- a container a node's agent forgot was never stored there again;
- per-node bounds held (the ledger's entries, connections);
- no node was cut off (every node here is honest) and no task failed.

The same seed gives the same run: `Report.digest` hashes every frame, open and close in
order with its virtual time. A failing run names its seed and the command replaying it.
"""

from __future__ import annotations

import dataclasses
import random
import resource
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import nacl.bindings
import nacl.signing

from hmpnode.container.build import build_container
from hmpnode.identity.keys import Identity
from hmpnode.net.dialing import DialLimits
from hmpnode.net.settings import MeshLimits, MeshSettings
from hmpnode.net.session import SessionLimits
from hmpnode.net.slots import SlotLimits
from hmpnode.sim import vtime
from hmpnode.sim.dgram import DatagramNetwork
from hmpnode.sim.dht import kademlia_on_loop
from hmpnode.sim.mesh import DHT_PORT, LinkModel, SimNet, SimNode

__all__ = ["Scenario", "Report", "run", "replay_command"]


@dataclass(frozen=True)
class Scenario:
    nodes: int = 200
    seed: int = 1
    #: outbound connections each node keeps, and how many peers it knows to choose from
    degree: int = 4
    known: int = 16
    broadcasts: int = 20
    #: directed containers (sender and recipient at random), through `relays` relay nodes
    directed: int = 0
    relays: int = 0
    #: directed mail is sent in this first fraction of the fault phase
    mail_window: float = 0.6
    #: fraction of recipients offline when their mail is sent (back before the faults end)
    offline: float = 0.0
    #: fraction of nodes that leave and come back during the fault phase
    churn: float = 0.0
    #: fraction of relays that crash and restart (with their store) during the fault phase
    relay_crashes: float = 0.0
    #: every relay is down from the first to the second fraction of the fault phase
    outage: tuple[float, ...] = ()
    #: connections dropped at random during the fault phase
    drops: int = 0
    #: the nodes split in two halves for part of the fault phase
    partition: bool = False
    #: each node's clock is off by up to this many seconds
    skew: float = 0.0
    #: named frame losses on live connections (see LOSSES), each once per matching connection
    lose: tuple[str, ...] = ()
    #: seconds of the fault phase (publishing happens in it), and of settling after it
    active: float = 30.0
    settle: float = 30.0
    fanout: int = 4
    latency: tuple[float, float] = (0.020, 0.080)
    #: the relays' re-offer interval and the recipients' request deadline (seconds)
    reoffer: float = 15.0
    request_timeout: float = 10.0
    #: "real" (Ed25519, as the node) or "plain" (hmpnode.sim.standin: for the largest runs)
    crypto: str = "real"
    #: a relay's peer slots (`peer.max_peers` of the relays; an operator raises it from 64)
    relay_slots: int = 512
    #: each node runs its DHT (hmpnode.net.dht on a simulated UDP network) and a sender looks a
    #: recipient it does not know up there; off: the lookup answers at once with the latest record
    dht: bool = False

    def __post_init__(self) -> None:
        """A scenario the simulation can run, or ValueError saying what is wrong."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(what)

        need(self.nodes >= 2, "--nodes must be at least 2")
        need(0 <= self.relays <= self.nodes - 2, "--relays must leave at least 2 nodes that are not relays")
        need(self.degree >= 1 and self.known >= 1, "--degree and --known must be at least 1")
        need(min(self.broadcasts, self.directed, self.drops) >= 0, "counts must not be negative")
        for name in ("offline", "churn", "relay_crashes", "mail_window"):
            need(0.0 <= getattr(self, name) <= 1.0, f"--{name.replace('_', '-')} is a fraction from 0 to 1")
        need(self.active > 0 and self.settle >= 0 and self.skew >= 0, "--active must be > 0, --settle and --skew >= 0")
        need(len(self.latency) == 2 and 0 < self.latency[0] <= self.latency[1],
             "--latency is two seconds, low,high, with 0 < low <= high")
        need(not self.outage or (len(self.outage) == 2 and 0 <= self.outage[0] < self.outage[1] <= 1),
             "--outage is two fractions of the fault phase, from,to, with 0 <= from < to <= 1")
        need(self.relay_slots >= 8, "--relay-slots must be at least 8")
        need(self.fanout >= 1 and self.reoffer > 0 and self.request_timeout > 0,
             "--fanout, --reoffer and --request-timeout must be positive")
        unknown = [name for name in self.lose if name not in LOSSES]
        need(not unknown, f"unknown loss {unknown[0]!r} (known: {', '.join(LOSSES)})" if unknown else "")
        need(self.crypto in ("real", "plain"), f"--crypto is real or plain, not {self.crypto!r}")


@dataclass
class Report:
    scenario: Scenario
    digest: str = ""
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    #: every (broadcast, node) propagation delay in simulated seconds, sorted (the CDF)
    delays: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def replay_command(scenario: Scenario) -> str:
    """The one command that replays this run."""
    defaults = Scenario()
    args = []
    for f in dataclasses.fields(Scenario):
        value = getattr(scenario, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag)
        elif isinstance(value, tuple):
            args.append(f"{flag} {','.join(str(v) for v in value)}")
        else:
            args.append(f"{flag} {value}")
    return "./scripts/sim mesh " + " ".join(args)


#: frame losses on live connections: (who sends, what class) -> predicate(src, dst, kind, net)
LOSSES = {
    # the relay's offer to a connected recipient (container_delta from a relay to a non-relay)
    "relay_offer": lambda net, src, dst, kind: kind == "container_delta" and net.is_relay(src)
    and not net.is_relay(dst),
    # the recipient's request to its relay
    "recipient_request": lambda net, src, dst, kind: kind == "container_request" and net.is_relay(dst),
    # the containers a relay hands to its recipient
    "relay_containers": lambda net, src, dst, kind: kind == "containers" and net.is_relay(src)
    and not net.is_relay(dst),
}


def _settings(scenario: Scenario, node: SimNode) -> MeshSettings:
    relay = bool(node.roles)
    return MeshSettings(
        roles=node.roles,
        mesh=MeshLimits(fanout=scenario.fanout, ledger_session_entries=2000, ledger_max_entries=40_000,
                        sync_snapshot_seconds=0.0),
        session=SessionLimits(request_timeout_seconds=scenario.request_timeout, relay_reoffer_seconds=scenario.reoffer),
        dialing=DialLimits(target_peers=max(scenario.degree, 32) if relay else scenario.degree),
        slots=SlotLimits(max_peers=scenario.relay_slots if relay else 64),
    )


def run(scenario: Scenario) -> Report:
    with kademlia_on_loop(random.Random(scenario.seed)):  # the DHT's clock and rng: the run's (when it has one)
        return vtime.run(_run(scenario))


async def _run(sc: Scenario) -> Report:
    import asyncio

    loop = asyncio.get_running_loop()
    rng = random.Random(sc.seed)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    settings_cache: dict[str, MeshSettings] = {}

    def settings(node: SimNode) -> MeshSettings:
        got = settings_cache.get(node.did)
        if got is None:
            got = settings_cache[node.did] = _settings(sc, node)
        return got

    net = SimNet(loop, rng, settings, model=LinkModel(latency=sc.latency), verify=sc.crypto)
    if sc.dht:
        net.dgram = DatagramNetwork(random.Random(rng.random()), latency=sc.latency)
    report = Report(sc)
    relay_ids = set(range(sc.relays))
    nodes: list[SimNode] = []
    for i in range(sc.nodes):
        identity = Identity(rng.randbytes(32))
        roles = ("relay",) if i in relay_ids else ()
        node = SimNode(net, i, identity, roles=roles, skew=rng.uniform(-sc.skew, sc.skew))
        nodes.append(node)
    for node in nodes:
        net.add(node)
    relay_dids = [n.did for n in nodes if n.roles]
    net.bootstrap = [(n.ip, DHT_PORT) for n in nodes[:4]]
    for node in nodes:
        others = [n.did for n in nodes if n is not node]
        if node.roles:
            known = others  # a relay reconnects to anyone it knows when it comes back
        else:
            known = rng.sample(others, min(sc.known, len(others)))
            known += [d for d in relay_dids if d not in known]
        net.set_known(node, known)

    for rule in sc.lose:
        predicate = LOSSES[rule]
        net.losses.append([lambda src, dst, kind, p=predicate: p(net, src, dst, kind), 10**9])
        # once per connection direction: a per-(src, dst) budget keeps the loss single
        seen: set[tuple[str, str]] = set()

        def once(src, dst, kind, p=predicate, seen=seen):
            if (src, dst) in seen or not p(net, src, dst, kind):
                return False
            seen.add((src, dst))
            return True

        net.losses[-1][0] = once

    # -- bookkeeping for the invariants -------------------------------------------------------
    stored = Counter()  # (node index, did) -> times stored
    published: dict[str, tuple[float, int, str]] = {}  # did -> (time, origin index, kind)
    forgot: dict[tuple[int, str], float] = {}
    scoped_leaks: list[str] = []

    forget_next: list[bool] = []

    def on_stored(node: SimNode, did: str) -> None:
        stored[node.index, did] += 1
        info = published.get(did)
        if forget_next and info is not None and info[2] == "broadcast" and node.index != info[1]:
            # while its peers still announce it: the offers that follow must not fetch it again
            forget_next.pop()
            forgot[node.index, did] = loop.time()
            loop.call_soon(node.forget, did)
            return
        if (node.index, did) in forgot and node.stored_at.get(did, 0) > forgot[node.index, did]:
            report.violations.append(f"node {node.index} stored {did[:24]}... again after its agent forgot it")
        if info is not None and info[2] == "scoped" and node.index != info[1]:
            scoped_leaks.append(did)

    net.stored_hooks.append(on_stored)

    # -- start ------------------------------------------------------------------------------
    for node in nodes:
        node.start()
    warm = 10.0
    await asyncio.sleep(warm)
    t0 = loop.time()

    def alive() -> list[SimNode]:
        return [n for n in nodes if n.alive]

    #: node index -> (when it went down, when it came back): what it missed is repaired after
    away: dict[int, list[float]] = {}

    def restart(node: SimNode) -> None:
        if node.index in away:
            away[node.index][1] = loop.time()
        node.start()

    # -- the fault phase: publishing and faults, scheduled at random times ---------------------
    events: list[tuple[float, str, Any]] = []
    for i in range(sc.broadcasts):
        events.append((rng.uniform(0, sc.active * 0.6), "broadcast", i))
    for i in range(max(1, sc.broadcasts // 10) if sc.broadcasts else 0):
        events.append((rng.uniform(0, sc.active * 0.6), "scoped", i))
    plain = [n for n in nodes if not n.roles]
    offline = rng.sample(plain, int(sc.offline * len(plain))) if sc.directed else []  # a list: in seed order
    for node in offline:  # away from the start, back in the last third of the fault phase
        node.stop()
        events.append((rng.uniform(sc.active * 0.7, sc.active * 0.9), "up", node))
    for i in range(sc.directed):
        events.append((rng.uniform(0, sc.active * sc.mail_window), "directed", i))
    for node in rng.sample(plain, int(sc.churn * len(plain))):
        down = rng.uniform(0, sc.active * 0.6)
        events.append((down, "down", node))
        events.append((rng.uniform(down + 2, sc.active * 0.9), "up", node))
    relays = [n for n in nodes if n.roles]
    for node in rng.sample(relays, int(round(sc.relay_crashes * len(relays)))):
        down = rng.uniform(0, sc.active * 0.5)
        events.append((down, "down", node))
        events.append((rng.uniform(down + 5, sc.active * 0.9), "up", node))
    if sc.outage:
        for node in relays:
            events.append((sc.outage[0] * sc.active, "down", node))
            events.append((sc.outage[1] * sc.active, "up", node))
    for i in range(sc.drops):
        events.append((rng.uniform(0, sc.active * 0.9), "drop", i))
    if sc.partition:
        events.append((sc.active * 0.2, "split", None))
        events.append((sc.active * 0.6, "heal", None))
    events.append((sc.active * 0.3, "forget", None))
    events.sort(key=lambda e: (e[0], e[1]))

    for at, what, arg in events:
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        now = loop.time()
        if what in ("broadcast", "scoped"):
            origin = rng.choice(alive())
            c = build_container(origin.identity, "note", {"text": f"{what} {arg} seed {sc.seed}"}, now=origin.now(),
                                broadcast=True, **({"network": "localhost"} if what == "scoped" else {}))
            result = origin.publish(c)
            published[result.did] = (now, origin.index, what)
        elif what == "directed":
            senders = [n for n in alive() if not n.roles]
            sender = rng.choice(senders)
            recipient = rng.choice([n for n in plain if n is not sender])
            c = build_container(sender.identity, "note", {"text": f"mail {arg} seed {sc.seed}"}, now=sender.now(),
                                recipients=[recipient.did])
            result = sender.publish(c)
            published[result.did] = (now, sender.index, "directed:" + recipient.did)
        elif what == "down":
            if arg.alive:
                arg.stop()
                away[arg.index] = [now, now]
        elif what == "up":
            if not arg.alive:
                restart(arg)
        elif what == "drop":
            links = [link for n in alive() for link in n.core.live()]
            if links:
                net.close(rng.choice(links), "dropped")
        elif what == "split":
            half = {n.did: (0 if n.index % 2 else 1) for n in nodes}
            net.partition = half
            for n in alive():
                for link in n.core.live():
                    if half[link.did] != half[n.did]:
                        net.close(link, "partition")
        elif what == "heal":
            net.partition = None
        elif what == "forget":
            forget_next.append(True)  # the next node to store a broadcast from a peer forgets it at once
    faults_end = t0 + sc.active
    if loop.time() < faults_end:
        await asyncio.sleep(faults_end - loop.time())
    for node in nodes:  # everyone is back for the settling phase
        if not node.alive:
            restart(node)
    await asyncio.sleep(sc.settle)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0

    # -- invariants -----------------------------------------------------------------------------
    v = report.violations
    for did, (at, origin, kind) in published.items():
        if kind == "broadcast":
            missing = [n.index for n in nodes if did not in n.store.by_did and (n.index, did) not in forgot]
            if missing:
                v.append(f"broadcast {did[:24]}... from node {origin} missing at {len(missing)} nodes "
                         f"(e.g. {missing[:5]})")
        elif kind.startswith("directed:"):
            recipient = net.nodes[kind[9:]]
            times = stored[recipient.index, did]
            if times != 1:
                v.append(f"directed {did[:24]}... from node {origin} stored {times} times at its recipient "
                         f"node {recipient.index}")
            if (did, recipient.did) in nodes[origin].store.outbox:
                v.append(f"directed {did[:24]}... still in node {origin}'s outbox although delivered")
    for did in set(scoped_leaks):
        v.append(f"localhost-scoped {did[:24]}... left its origin")
    for node in nodes:
        core = node.core
        if core.ledger.entries > core.ledger.max_entries:
            v.append(f"node {node.index}: ledger {core.ledger.entries} entries over {core.ledger.max_entries}")
        held = node.store.holds.values()
        limits = core.relay_limits
        if sum(h.size for h in held) > limits.max_total_bytes or any(
                n > limits.max_per_recipient for n in Counter(h.recipient for h in held).values()):
            v.append(f"node {node.index}: relay holdings over the relay limits")
        if len(core.links) > settings(node).slots.max_peers:
            v.append(f"node {node.index}: {len(core.links)} connections over max_peers")
        if node.counters["banned"]:
            v.append(f"node {node.index} cut off {node.counters['banned']} honest peers")
    for index, failure in net.failures[:10]:
        v.append(f"node {index}: task failed: {failure}")

    # -- figures ---------------------------------------------------------------------------------
    report.digest = net.digest.hexdigest()
    delays = []
    duplicates = 0
    n_broadcasts = 0
    for did, (at, origin, kind) in published.items():
        if kind != "broadcast":
            continue
        n_broadcasts += 1
        for n in nodes:
            t = n.stored_at.get(did)
            if t is not None and n.index != origin:
                delays.append(t - at)
            duplicates += max(0, n.received[did] - 1)
    directed_delays = [nodes_stored_at(net, kind[9:], did) - at for did, (at, origin, kind) in published.items()
                       if kind.startswith("directed:") and nodes_stored_at(net, kind[9:], did) is not None]
    frames = sum(net.frames.values())
    f = report.figures
    f.update(nodes=sc.nodes, seed=sc.seed, crypto=sc.crypto, broadcasts=n_broadcasts, directed=sc.directed,
             wall_s=round(wall, 2), cpu_s=round(cpu, 2),
             peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             simulated_s=round(loop.time(), 1), frames=frames, frame_bytes=sum(net.frame_bytes.values()))
    # repair: a node that was away gets what was broadcast meanwhile; how long after it came back
    repairs = []
    for index, (down, up) in away.items():
        n = nodes[index]
        for did, (at, origin, kind) in published.items():
            if kind == "broadcast" and down <= at <= up and origin != index and did in n.stored_at:
                repairs.append(n.stored_at[did] - up)
    if repairs:
        repairs.sort()
        f["repair_p50_s"] = round(repairs[len(repairs) // 2], 2)
        f["repair_max_s"] = round(repairs[-1], 2)
        f["repaired"] = len(repairs)
    f["deliveries"] = len(delays)
    delays.sort()
    report.delays = delays
    if delays:
        f["propagation_p50_ms"] = round(1000 * delays[len(delays) // 2], 1)
        f["propagation_p99_ms"] = round(1000 * delays[min(len(delays) - 1, int(len(delays) * 0.99))], 1)
        f["propagation_max_ms"] = round(1000 * delays[-1], 1)
    if n_broadcasts:
        f["duplicates_per_node_per_broadcast"] = round(duplicates / (n_broadcasts * sc.nodes), 3)
        # once the tree has formed: the broadcasts after the first tenth (in publishing order)
        later = sorted((at, did) for did, (at, origin, kind) in published.items() if kind == "broadcast")
        later = [did for _, did in later[max(1, len(later) // 10):]]
        if later:
            f["duplicates_after_first_tenth"] = round(
                sum(max(0, n.received[did] - 1) for did in later for n in nodes) / (len(later) * sc.nodes), 3)
    if directed_delays:
        f["directed_p50_s"] = round(statistics.median(directed_delays), 2)
        f["directed_max_s"] = round(max(directed_delays), 2)
    f["frames_by_kind"] = dict(net.frames.most_common())
    f["bytes_by_kind"] = dict(net.frame_bytes.most_common())
    return report


def nodes_stored_at(net: SimNet, did_of_node: str, did: str) -> float | None:
    return net.nodes[did_of_node].stored_at.get(did)


def raw_verify_seconds(n: int = 2000) -> float:
    """One raw libsodium Ed25519 verify (the CPU figure's unit), measured now."""
    key = nacl.signing.SigningKey(b"\x01" * 32)
    signed = key.sign(b"x" * 200)
    pk = bytes(key.verify_key)
    start = time.process_time()
    for _ in range(n):
        nacl.bindings.crypto_sign_open(signed, pk)
    return (time.process_time() - start) / n
