"""The node's DHT in virtual time (hmpnode.sim.dht): real `Dht` nodes on the in-memory
datagram network, churn, lookups, and a replayable trace digest."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest

from hmpnode.net.dht import Dht
from hmpnode.sim import vtime
from hmpnode.sim.dgram import DatagramNetwork
from hmpnode.sim.dht import DhtSim, DhtSimConfig, kademlia_on_loop, run_dht_sim

SMALL = dict(nodes=60, lookups=100, join_window=20.0, settle=10.0, window=60.0, down=(10.0, 30.0))


def test_lookups_succeed_while_30_percent_churn():
    result = run_dht_sim(DhtSimConfig(seed=1, **SMALL))
    assert result.churned == round(0.3 * (60 - 4))
    assert result.down_peak >= 1
    assert result.lookups == 100 and len(result.rounds) == 100
    assert result.success >= 0.99, (result.found, result.lookups)
    assert result.rounds[-1] >= 1  # lookups went to the network, not only to the local store


TINY = dict(nodes=20, lookups=20, join_window=10.0, settle=5.0, window=30.0, down=(5.0, 10.0))


def test_same_seed_same_digest_other_seed_other_digest():
    first = run_dht_sim(DhtSimConfig(seed=3, **TINY))
    again = run_dht_sim(DhtSimConfig(seed=3, **TINY))
    assert again.digest == first.digest
    assert (again.found, again.rounds, again.latencies) == (first.found, first.rounds, first.latencies)
    assert run_dht_sim(DhtSimConfig(seed=4, **TINY)).digest != first.digest


def test_digest_does_not_depend_on_the_hash_seed():
    """Sets of str/bytes iterate in PYTHONHASHSEED order: the trace must not depend on it."""
    code = ("from hmpnode.sim.dht import DhtSimConfig, run_dht_sim; "
            f"print(run_dht_sim(DhtSimConfig(seed=3, **{TINY!r})).digest)")
    digests = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": h}, capture_output=True, text=True,
                       check=True, timeout=120).stdout
        for h in ("1", "2")
    }
    assert len(digests) == 1, digests


def test_lookup_fails_when_every_holder_is_down_and_succeeds_when_back():
    async def main():
        sim = DhtSim(DhtSimConfig(nodes=30, seed=5, join_window=10.0))
        await sim.join_all()
        await asyncio.sleep(10)
        target = sim.nodes[7]
        holders = [n for n in sim.nodes if n.holds_peer_record(target.did)]
        origin = next(n for n in sim.nodes if n not in holders)
        assert target in holders and len(holders) >= 10  # the publisher and its replicas
        found_before = (await origin.lookup(target, None))[0]
        for n in holders:
            sim.network.set_down(n.host)
        found_down = (await origin.lookup(target, None))[0]
        for n in holders:
            sim.network.set_down(n.host, False)
        found_after = (await origin.lookup(target, None))[0]
        await sim.stop_all()
        return found_before, found_down, found_after

    with kademlia_on_loop(random.Random(0)):
        assert vtime.run(main()) == (True, False, True)


def test_datagram_network_latency_loss_and_down_hosts():
    class Sink(asyncio.DatagramProtocol):
        def __init__(self):
            self.got: list[tuple[float, bytes]] = []

        def datagram_received(self, data, addr):
            self.got.append((asyncio.get_running_loop().time(), data))

    async def main():
        net = DatagramNetwork(random.Random(1), latency=(0.02, 0.08))
        a, _ = await net.create_datagram_endpoint(Sink, local_addr=("10.0.0.1", 1))
        _, sink = await net.create_datagram_endpoint(Sink, local_addr=("10.0.0.2", 1))
        with pytest.raises(OSError):
            await net.create_datagram_endpoint(Sink, local_addr=("10.0.0.2", 1))
        for i in range(50):
            a.sendto(bytes([i]), ("10.0.0.2", 1))
        await asyncio.sleep(1)
        net.set_down("10.0.0.2")
        a.sendto(b"lost", ("10.0.0.2", 1))
        await asyncio.sleep(1)
        lossy = DatagramNetwork(random.Random(1), loss=0.5)
        b, _ = await lossy.create_datagram_endpoint(Sink, local_addr=("10.0.0.3", 1))
        _, sink2 = await lossy.create_datagram_endpoint(Sink, local_addr=("10.0.0.4", 1))
        for i in range(200):
            b.sendto(b"x", ("10.0.0.4", 1))
        await asyncio.sleep(1)
        return sink.got, net.counters, len(sink2.got)

    got, counters, lossy_got = vtime.run(main())
    assert len(got) == 50 and all(0.02 <= t <= 0.08 for t, _ in got)
    assert sorted(d for _, d in got) != [d for _, d in got]  # latencies differ: reordered, as UDP may
    assert counters["dropped_down"] == 1
    assert 60 < lossy_got < 140


def test_dht_binds_through_an_injected_endpoint():
    """The seam the simulator uses: `Dht(endpoint=...)` instead of the loop's UDP socket."""
    from hmpnode.identity.keys import Identity

    async def main():
        net = DatagramNetwork(random.Random(2))
        a = Dht(Identity(b"a" * 32), host="10.0.0.1", port=7, endpoint=net.create_datagram_endpoint,
                rng=random.Random(1).randbytes)
        b = Dht(Identity(b"b" * 32), host="10.0.0.2", port=7, endpoint=net.create_datagram_endpoint,
                rng=random.Random(2).randbytes)
        await a.start()
        await b.start([("10.0.0.1", 7)])
        sizes = (a.routing_size(), b.routing_size(), a.port)
        await b.stop()
        await a.stop()
        return sizes, net.counters["delivered"]

    with kademlia_on_loop(random.Random(0)):
        (size_a, size_b, port), delivered = vtime.run(main())
    assert (size_a, size_b, port) == (1, 1, 7) and delivered >= 4


def test_dhtrecords_imports_no_io():
    """The record policy is sans-IO: a core calls it directly, without asyncio, sockets or a database."""
    code = ("import sys, hmpnode.net.dhtrecords; "
            "print(sorted(m for m in ('asyncio', 'socket', 'sqlite3', 'kademlia', 'rpcudp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_scripts_sim_dht_command():
    """`./scripts/sim dht` prints the figures, the seed and the digest; bad input is exit 2, one line."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "sim.py"
    run = subprocess.run([sys.executable, str(script), "dht", "--nodes", "20", "--lookups", "20", "--seed", "3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "lookups: 20 / 20 found" in run.stdout and "seed 3 digest " in run.stdout
    bad = subprocess.run([sys.executable, str(script), "dht", "--nodes", "3"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "seeds" in bad.stderr
