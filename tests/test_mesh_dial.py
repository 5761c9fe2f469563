"""What an announce can make a real node dial and remember (issue 10 line 4).

On loopback: a flood of LAN announces from thousands of fresh DIDs leaves the
peers table within its cap and the node's failed dials within its dial rate.
In network namespaces (tests/netns.py): a LAN neighbour naming an off-subnet
address and a host name, and a peer outside the node's subnets naming loopback
and private addresses in its handshake, make the node connect to none of them;
counted by listeners in namespaces the test built, and by the node's counters."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hmpnode.container.verify import encode_wire
from hmpnode.identity import Identity
from hmpnode.net.announce import build_peer_announce
from hmpnode.net.lan import utc_now
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.netns import NetLab, netns_unavailable
from tests.nodeproc import LOOPBACK_MESH, node_env

_NETNS = netns_unavailable()
needs_netns = pytest.mark.skipif(_NETNS is not None and not os.environ.get("HMPNODE_REQUIRE_NETNS"),
                                 reason=_NETNS or "")

PEERS_MAX = 1000  # the default [peer] peers_max
DIALS_PER_SECOND, DIAL_BURST = 2, 16  # the defaults


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_flood_of_fresh_dids_leaves_the_peers_table_and_the_dial_rate_bounded(nodes, tmp_path):
    """3 000 signed announces from distinct DIDs, each naming a dead loopback port: at
    most `peers_max` rows, and failed dials within the node-wide dial budget (before:
    3 001 rows, ~18 failed dials/s, forever)."""
    env = mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_MIN_DIFFICULTY="1")
    node = MeshNode(nodes(tmp_path / "n", env=env))
    port = int(LOOPBACK_MESH["HMPNODE_PEER_DISCOVERY_PORT"])
    dead = f"tcp://127.0.0.1:{_closed_port()}"
    try:
        start = time.monotonic()
        failed_before = (await node.client.status())["mesh"]["counters"].get("dial_failed", 0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            sent = 0
            while sent < 3000:  # ~180/s: under the LAN receiver's 200/s, so none is dropped
                tick = time.monotonic()
                for _ in range(90):
                    data = encode_wire(build_peer_announce(Identity.generate(), addresses=[dead], now=utc_now(),
                                                           difficulty=1, protocols=["hmp-peer/2"]))
                    s.sendto(data, ("127.255.255.255", port))
                    sent += 1
                await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - tick)))

        async def taken():
            lan = (await node.client.status())["mesh"]["lan"]["filter"]
            return lan["accepted"] + lan["ignored"].get("overloaded", 0) >= 3000 or None

        await wait_for(taken, 30, "the node to take the 3 000 announces")
        await asyncio.sleep(2.0)  # what the node does with them
        peers = await node.peers()
        status = (await node.client.status())["mesh"]
        elapsed = time.monotonic() - start
        failed = status["counters"].get("dial_failed", 0) - failed_before
        print(f"flood: {len(peers)} peers rows, {failed} failed dials in {elapsed:.1f} s")  # the figure (-s)
        assert len(peers) <= PEERS_MAX, f"{len(peers)} rows in the peers table"
        assert failed <= DIAL_BURST + DIALS_PER_SECOND * (elapsed + 1), (failed, elapsed)
        assert status["peers_table"] == {"size": len(peers), "cap": PEERS_MAX}
        assert status["dials"]["attempts"] <= DIAL_BURST + DIALS_PER_SECOND * (elapsed + 1)
        assert status["dials"]["off_rule"] == 0
        assert status["counters"].get("peers_evicted", 0) >= 2000
    finally:
        await node.close()


# -- network namespaces ----------------------------------------------------------------

_COUNTER = r"""
import socket, sys, time
# Accept and count TCP connections on each host:port given, for a while; print the counts.
socks = []
for spec in sys.argv[2:]:
    host, port = spec.rsplit(":", 1)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, int(port))); s.listen(64); s.setblocking(False); socks.append((spec, s))
counts = {spec: 0 for spec, _ in socks}
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    for spec, s in socks:
        try:
            c, _ = s.accept()
        except BlockingIOError:
            continue
        counts[spec] += 1
        c.close()
    time.sleep(0.01)
import json; print(json.dumps(counts), flush=True)
"""

_ANNOUNCER = r"""
import socket, sys, time
from hmpnode.container.verify import encode_wire
from hmpnode.identity import Identity
from hmpnode.net.announce import build_peer_announce
from hmpnode.net.lan import utc_now
# Broadcast a signed peer_announce naming the given addresses, every 0.5 s, `count` times.
broadcast, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
identity = Identity(bytes([77]) * 32)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    for _ in range(count):
        s.sendto(encode_wire(build_peer_announce(identity, addresses=sys.argv[4:], now=utc_now(), protocols=["hmp-peer/2"])), (broadcast, port))
        time.sleep(0.5)
print(identity.did, flush=True)
"""


def _peers(lab: NetLab, ns, data_dir: Path) -> tuple[dict[str, dict], dict]:
    """`hmpnode peers` of the node in `ns`: its peers table by DID, and its mesh status."""
    proc = lab.run(ns, [sys.executable, "-m", "hmpnode", "peers", "--data-dir", str(data_dir)], env=node_env(),
                   timeout=30, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    return {p["did"]: p for p in out["peers"]}, out["mesh"]


def _counter(lab: NetLab, ns, seconds: float, *specs: str):
    proc = lab.popen(ns, [sys.executable, "-c", _COUNTER, str(seconds), *specs], stdout=subprocess.PIPE,
                     text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _counts(proc) -> dict[str, int]:
    out, _ = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


@needs_netns
def test_lan_announce_cannot_point_the_node_off_its_subnet_or_at_a_host_name(nodes, tmp_path):
    """docs/protocol.md 20.6. Node A has two links: 10.77.8.0/24 to B, 10.77.9.0/24 to C.
    B broadcasts an announce naming its own address, C's address (a subnet the datagram
    did not come by) and a host name that resolves to C inside A's namespace. A dials B
    (more than once: it keeps trying, backed off) and never C (before: C got a
    connection per dial round, for the address and for the name)."""
    with NetLab() as lab:
        a, b, c = lab.namespace("a"), lab.namespace("b"), lab.namespace("c")
        lab.link(a, "10.77.8.1/24", b, "10.77.8.2/24")
        lab.link(a, "10.77.9.1/24", c, "10.77.9.2/24")
        lab.hosts(a, {"offsubnet.test": "10.77.9.2"})
        env = node_env(HMPNODE_PEER_HOST="0.0.0.0", HMPNODE_PEER_DISCOVERY_INTERFACES="",
                       HMPNODE_PEER_DISCOVERY_PORT="47474", HMPNODE_PEER_DHT="false")
        node = nodes(tmp_path / "A", env=env, prefix=["ip", "netns", "exec", a.name])
        node.wait_ready()
        b_counter = _counter(lab, b, 15, "10.77.8.2:7420")
        c_counter = _counter(lab, c, 15, "10.77.9.2:7420", "10.77.9.2:7421")
        announcer = lab.run(b, [sys.executable, "-c", _ANNOUNCER, "10.77.8.255", "47474", "24",
                                "tcp://10.77.8.2:7420", "tcp://10.77.9.2:7420", "tcp://offsubnet.test:7421"],
                            env=node_env(), timeout=40, text=True)
        assert announcer.returncode == 0, announcer.stderr
        peers, status = _peers(lab, a, node.data_dir)
        b_counts, c_counts = _counts(b_counter), _counts(c_counter)
        assert b_counts["10.77.8.2:7420"] >= 2, (b_counts, status["counters"])  # the legit address, retried
        assert c_counts == {"10.77.9.2:7420": 0, "10.77.9.2:7421": 0}, c_counts
        refused = status["dials"]["refused"]
        assert refused.get("off_subnet", 0) >= 1 and refused.get("hostname", 0) >= 1, refused
        assert status["dials"]["off_rule"] == 0
        assert [p["addresses"] for p in peers.values()] == [["tcp://10.77.8.2:7420"]]


_OUTSIDER = r"""
import asyncio, sys, time
from datetime import datetime, timezone
import aiohttp
from hmpnode.identity import Identity
from hmpnode.net.announce import make_address_record
from hmpnode.net.dht import Dht
from tests.peerclient import PeerSocket, authenticate

# A peer outside the node's subnets (source address `src`): publishes a DHT peer record of
# agent X naming `dht_addrs`, then passes a handshake as agent Y announcing `hs_addrs` and
# hangs up; stays in the DHT for `linger` seconds.
a_ip, peer_port, dht_port, src, linger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
hs_addrs, dht_addrs = sys.argv[6].split(","), sys.argv[7].split(",")

async def main():
    x, y = Identity(bytes([88]) * 32), Identity(bytes([99]) * 32)
    dht = Dht(x, host=src, port=0)
    await dht.start([(a_ip, dht_port)])
    replicas = await dht.publish_peer([make_address_record(x.did, a, difficulty=3) for a in dht_addrs])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(src, 0))) as http:
        ws = await authenticate(http, peer_port, y, a_ip, addresses=hs_addrs)
        done = isinstance(ws, PeerSocket)
        if done:
            await ws.close()
    print(f"{replicas} {done} {x.did}={x.public_key_b58}", flush=True)
    await asyncio.sleep(linger)
    await dht.stop()

asyncio.run(main())
"""


@needs_netns
def test_a_peer_or_dht_record_from_outside_cannot_point_the_node_at_loopback_or_private(nodes, tmp_path):
    """Node A (10.77.10.1) is reached by a peer at 192.0.2.7, outside A's subnets (routed
    through B). Its handshake announce names its own address (dialled, as a control),
    A's loopback and a private host of A's other link (C); its DHT record for another
    agent names the same kinds. A's agent sends that agent a container, so A looks it up
    in the DHT. A never connects to the loopback or private listeners (before: every dial
    round did, from both sources)."""
    with NetLab() as lab:
        a, b, c = lab.namespace("a"), lab.namespace("b"), lab.namespace("c")
        _, vb = lab.link(a, "10.77.10.1/24", b, "10.77.10.2/24")
        lab.link(a, "10.77.11.1/24", c, "10.77.11.2/24")
        lab.run(b, ["ip", "addr", "add", "192.0.2.7/32", "dev", vb])
        lab.run(a, ["ip", "route", "add", "192.0.2.7/32", "via", "10.77.10.2"])
        env = node_env(HMPNODE_PEER_HOST="0.0.0.0", HMPNODE_PEER_DISCOVERY_INTERFACES="",
                       HMPNODE_PEER_DISCOVERY_PORT="47476", HMPNODE_PEER_DHT="true")
        node = nodes(tmp_path / "A", env=env, prefix=["ip", "netns", "exec", a.name])
        info = node.wait_ready()
        a_loop = _counter(lab, a, 20, "127.0.0.1:7430", "127.0.0.1:7432")
        c_private = _counter(lab, c, 20, "10.77.11.2:7430", "10.77.11.2:7432")
        b_own = _counter(lab, b, 20, "192.0.2.7:7431")
        outsider = lab.popen(b, [sys.executable, "-c", _OUTSIDER, "10.77.10.1", str(info["peer"]["port"]),
                                 str(info["peer"]["dht_port"]), "192.0.2.7", "14",
                                 "tcp://192.0.2.7:7431,tcp://127.0.0.1:7430,tcp://10.77.11.2:7430",
                                 "tcp://127.0.0.1:7432,tcp://10.77.11.2:7432"],
                             env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = outsider.stdout.readline().split()
        assert len(line) == 3 and line[1] == "True", (line, outsider.stderr.read() if not line else "")
        assert int(line[0]) >= 1, "the DHT record reached A"
        payload = tmp_path / "payload.json"
        payload.write_text('{"x": 1}')
        sent = lab.run(a, [sys.executable, "-m", "hmpnode", "send", "--class", "note", "--payload", str(payload),
                           "--to", line[2], "--data-dir", str(node.data_dir)], env=node_env(), timeout=30, text=True)
        assert sent.returncode == 0, sent.stderr

        def looked_up():
            return _peers(lab, a, node.data_dir)[1]["counters"].get("dht_found", 0) >= 1

        deadline = time.monotonic() + 60
        while not looked_up():
            assert time.monotonic() < deadline, "A never looked the agent up in the DHT"
            time.sleep(0.3)
        peers, status = _peers(lab, a, node.data_dir)
        loop_counts, private_counts, own_counts = _counts(a_loop), _counts(c_private), _counts(b_own)
        assert own_counts["192.0.2.7:7431"] >= 1, (own_counts, status["counters"])  # the control: A dials
        assert loop_counts == {"127.0.0.1:7430": 0, "127.0.0.1:7432": 0}, loop_counts
        assert private_counts == {"10.77.11.2:7430": 0, "10.77.11.2:7432": 0}, private_counts
        refused = status["dials"]["refused"]
        assert refused.get("loopback", 0) >= 2 and refused.get("private", 0) >= 2, refused
        assert status["dials"]["off_rule"] == 0
        y = Identity(bytes([99]) * 32).did
        assert peers[y]["addresses"] == ["tcp://192.0.2.7:7431"]
        outsider.communicate(timeout=30)
