"""What a node announces ([peer] announce, no_announce, announce_interfaces), its static
peers ([peer] static, `hmpnode peers add/remove/list`, /v1/peers/static) and its stable
ports (api.port / peer.port "auto"): the rules alone, then real nodes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from pathlib import Path

import aiohttp
import pytest

from hmpnode.client import ApiError
from hmpnode.config import ConfigError, load_settings
from hmpnode.net import dialing as D
from hmpnode.net.addresses import (AnnounceEntry, StaticError, StaticPeer, StaticPeers, own_addresses, parse_announce,
                                   parse_static)
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.nodeproc import hmp

# -- the rules -----------------------------------------------------------------------


def test_announce_entries_parse() -> None:
    assert parse_announce("tcp://203.0.113.7") == AnnounceEntry("tcp", "203.0.113.7", None)
    assert parse_announce("tcp://203.0.113.7:7420") == AnnounceEntry("tcp", "203.0.113.7", 7420)
    assert parse_announce("udp://[2001:db8::1]:9") == AnnounceEntry("udp", "2001:db8::1", 9)
    assert parse_announce("tcp://[2001:db8::1]") == AnnounceEntry("tcp", "2001:db8::1", None)
    for bad in ("tcp://node.example.org:7420", "http://1.2.3.4:80", "tcp://1.2.3.4:0", "tcp://1.2.3.4:70000",
                "tcp://2001:db8::1", "1.2.3.4:7420", "tcp://", "tcp://1.2.3.4/x"):
        with pytest.raises(ValueError):
            parse_announce(bad)


def test_own_addresses_rule() -> None:
    """Announced entries first (without a port: our own), their IPs on the DHT port when no
    udp:// is given, then the interfaces' unless replaced; no_announce hides any of them."""
    entries = [parse_announce("tcp://198.51.100.7"), parse_announce("tcp://[2001:db8::7]:7000")]
    hosts = ["172.17.0.2", "10.1.2.3"]
    got = own_addresses(interface_hosts=hosts, port=7420, dht_port=7421, announce=entries)
    assert got == ["tcp://198.51.100.7:7420", "tcp://[2001:db8::7]:7000", "udp://198.51.100.7:7421",
                   "udp://[2001:db8::7]:7421", "tcp://172.17.0.2:7420", "tcp://10.1.2.3:7420",
                   "udp://172.17.0.2:7421", "udp://10.1.2.3:7421"]
    bridge = (ipaddress.ip_network("172.17.0.0/16"),)
    got = own_addresses(interface_hosts=hosts, port=7420, dht_port=None, announce=entries, no_announce=bridge)
    assert got == ["tcp://198.51.100.7:7420", "tcp://[2001:db8::7]:7000", "tcp://10.1.2.3:7420"]
    # an explicit udp:// entry: no udp address derived from the tcp ones
    udp = [entries[0], parse_announce("udp://198.51.100.7:9000")]
    got = own_addresses(interface_hosts=hosts, port=7420, dht_port=7421, announce=udp, announce_interfaces=False)
    assert got == ["tcp://198.51.100.7:7420", "udp://198.51.100.7:9000"]
    # nothing left: loopback, since peers refuse an announce without an address
    everything = (ipaddress.ip_network("0.0.0.0/0"),)
    assert own_addresses(interface_hosts=hosts, port=7420, dht_port=7421, no_announce=everything) == \
        ["tcp://127.0.0.1:7420"]
    # the default: the interfaces', as before
    assert own_addresses(interface_hosts=["127.0.0.1"], port=5, dht_port=6) == ["tcp://127.0.0.1:5", "udp://127.0.0.1:6"]


def _load(tmp_path: Path, **env: str):
    return load_settings(data_dir=tmp_path, config_file=None, env={f"HMPNODE_PEER_{k.upper()}": v for k, v in env.items()},
                         overrides={})


def test_config_refuses_bad_addresses_in_one_line(tmp_path: Path) -> None:
    for key, value, says in (
        ("announce", "tcp://node.example.org", 'must list "tcp://IP[:port]" or "udp://IP[:port]" entries'),
        ("no_announce", "172.17.0.0", "must list CIDRs"),
        ("static", "tcp://1.2.3.4", 'must list "tcp://host:port" or "did:...@tcp://host:port" entries'),
        ("static", "nodid@tcp://1.2.3.4:5", 'must list "tcp://host:port"'),
        ("static", "udp://1.2.3.4:5", 'must list "tcp://host:port"'),
    ):
        with pytest.raises(ConfigError) as err:
            _load(tmp_path, **{key: value})
        assert f"peer.{key} = " in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"peer\.announce = 'tcp://172\.17\.0\.5' .*inside peer\.no_announce"):
        _load(tmp_path, announce="tcp://172.17.0.5", no_announce="172.17.0.0/16")
    with pytest.raises(ConfigError, match=r"peer\.announce .*17 entries; at most 16"):
        _load(tmp_path, announce=",".join(f"tcp://198.51.100.{i}" for i in range(17)))
    with pytest.raises(ConfigError, match=r"peer\.static .*3 entries; at most peer\.static_max = 2"):
        _load(tmp_path, static="tcp://a:1,tcp://b:2,tcp://c:3", static_max="2")
    s = _load(tmp_path, announce="tcp://198.51.100.7,udp://198.51.100.7:9", no_announce="172.17.0.0/16",
              static="tcp://relay.example.org:7420,did:hmp:agent:x@tcp://10.0.0.9:7420", announce_interfaces="no")
    a = s.peer.address_settings()
    assert a.announce == (AnnounceEntry("tcp", "198.51.100.7", None), AnnounceEntry("udp", "198.51.100.7", 9))
    assert a.static == (StaticPeer("tcp://relay.example.org:7420"), StaticPeer("tcp://10.0.0.9:7420", "did:hmp:agent:x"))
    assert not a.announce_interfaces and a.no_announce == (ipaddress.ip_network("172.17.0.0/16"),)


def test_static_peers_list() -> None:
    configured = parse_static("did:hmp:agent:abc@tcp://[2001:db8::1]:7420")
    assert configured == StaticPeer("tcp://[2001:db8::1]:7420", "did:hmp:agent:abc")
    peers = StaticPeers([configured], max_entries=3)
    added = parse_static("tcp://relay.example.org:7420")
    assert peers.add(added) and not peers.add(added)
    assert peers.runtime() == ["tcp://relay.example.org:7420"]
    peers.seen[added.spec] = "did:hmp:agent:seen"
    assert peers.dids() == {"did:hmp:agent:abc", "did:hmp:agent:seen"}
    peers.add(parse_static("tcp://10.0.0.1:1"))
    with pytest.raises(StaticError) as err:
        peers.add(parse_static("tcp://10.0.0.2:1"))
    assert err.value.reason == "static_full"
    for key, reason in (("did:hmp:agent:abc", "configured"), ("tcp://nowhere:1", "not_found")):
        with pytest.raises(StaticError) as err:
            peers.remove(key)
        assert err.value.reason == reason
    assert peers.remove("did:hmp:agent:seen") == [added]  # by the DID it proved
    assert peers.dids() == {"did:hmp:agent:abc"}


def test_the_operators_addresses_pass_the_dial_rule() -> None:
    """What the operator wrote may be a host name or a private address; never what cannot
    be a peer. The same addresses from a DHT record are refused."""
    for addr in ("tcp://relay.example.org:7420", "tcp://10.0.0.9:7420", "tcp://127.0.0.1:7420", "tcp://[fd00::1]:1"):
        assert D.check(addr, D.OPERATOR, schemes=("tcp",)) is None, addr
        assert D.check(addr, D.dht_origin(False), schemes=("tcp",)) is not None, addr
    assert D.check("tcp://0.0.0.0:7420", D.OPERATOR) == "special"
    assert D.check("tcp://224.0.0.1:7420", D.OPERATOR) == "special"


# -- real nodes -------------------------------------------------------------------------

#: no LAN discovery, no DHT, no dialling of their own: two nodes meet only through static peers
ALONE = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_TARGET_PEERS": "0"}


async def _fetch_announce(peer_port: int) -> list[str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{peer_port}/hmp/v1/announce") as resp:
            container = await resp.json()
    return [record["addr"] for record in container["hmp_container"]["payload"]["addresses"]]


async def _peer_row(node: MeshNode, did: str) -> dict | None:
    return next((p for p in await node.peers() if p["did"] == did), None)


async def _counter(node: MeshNode, name: str) -> int:
    return (await node.client.status())["mesh"]["counters"].get(name, 0)


async def test_a_node_announces_exactly_what_announce_and_no_announce_say(nodes, tmp_path):
    """The announce served on the peer port, /v1/status and the peer's /v1/peers row list the
    announced addresses (the DHT's derived from them) and not the hidden loopback ones
    (before: only the interfaces' addresses, 127.0.0.1 here)."""
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env(
        HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_TARGET_PEERS="0",
        HMPNODE_PEER_ANNOUNCE="tcp://198.51.100.7,tcp://[2001:db8::7]:7000",
        HMPNODE_PEER_NO_ANNOUNCE="127.0.0.0/8")))
    port, dht = a.info["peer"]["port"], a.info["peer"]["dht_port"]
    expected = [f"tcp://198.51.100.7:{port}", "tcp://[2001:db8::7]:7000", f"udp://198.51.100.7:{dht}",
                f"udp://[2001:db8::7]:{dht}"]
    # the peer keeps documentation-range addresses only when allowed to (the dial rule, 20.6)
    b = MeshNode(nodes(tmp_path / "b", env=mesh_env(**ALONE, HMPNODE_PEER_DIAL_PRIVATE="true",
                                                    HMPNODE_PEER_STATIC=f"tcp://127.0.0.1:{port}")))
    try:
        assert await _fetch_announce(port) == expected
        assert (await a.client.status())["mesh"]["addresses"] == expected == a.info["peer"]["addresses"]

        async def row():
            found = await _peer_row(b, a.did)
            # connected, and known as the static entry's node (its DID is learnt from the handshake)
            return found if found and found["connected"] and found["static"] else None

        seen = await wait_for(row, 30, "b to connect to its static peer a")
        assert seen["addresses"] == expected and seen["static"] is True
    finally:
        await a.close()
        await b.close()


async def test_static_peers_connect_and_a_wrong_did_does_not(nodes, tmp_path):
    """With LAN discovery and the DHT off and no dialling of their own, b reaches a only
    through its static peer (a loopback address, refused from any other source), and c,
    whose entry names another DID at a's address, never connects: counted and backed off."""
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env(**ALONE)))
    addr = f"tcp://127.0.0.1:{a.info['peer']['port']}"
    b = MeshNode(nodes(tmp_path / "b", env=mesh_env(**ALONE, HMPNODE_PEER_STATIC=f"{a.did}@{addr}")))
    c = MeshNode(nodes(tmp_path / "c", env=mesh_env(**ALONE, HMPNODE_PEER_STATIC=f"{b.did}@{addr}")))
    try:
        await wait_for(lambda: _connected(b, a.did), 30, "b to connect to its static peer a")
        assert (await _peer_row(b, a.did))["static"] is True
        assert (await _peer_row(a, b.did))["static"] is False  # a did not name b

        async def refused():
            return await _counter(c, "refused_wrong_did") >= 2  # tried again after the back-off
        await wait_for(refused, 40, "c to refuse a, which is not the DID it names")
        assert a.did not in await c.connected() and c.did not in await a.connected()
        [entry] = (await c.client.static_peers())["static"]
        assert entry["did"] == b.did and not entry["connected"] and entry["failures"] >= 1 and entry["configured"]
        # configured entries are not removed at run time; bad requests are 4xx with a reason
        for method, body, status, reason in (("DELETE", {"peer": b.did}, 409, "configured"),
                                             ("POST", {"peer": 5}, 400, "bad_request"),
                                             ("POST", {"peer": "tcp://h:1", "x": 1}, 400, "unknown_field"),
                                             ("POST", {"peer": "did:x@udp://h:1"}, 400, "bad_static"),
                                             ("DELETE", {"peer": "tcp://h:1"}, 404, "not_found")):
            with pytest.raises(ApiError) as err:
                await c.client.request(method, "/v1/peers/static", body=body)
            assert (err.value.status, err.value.reason) == (status, reason), (body, err.value)
    finally:
        for n in (a, b, c):
            await n.close()


async def _connected(node: MeshNode, did: str) -> bool:
    return did in await node.connected()


def _cli(node_dir: Path, *args: str):
    proc = hmp("peers", *args, "--data-dir", str(node_dir))
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


async def test_static_peers_at_run_time_survive_a_restart_and_stop_on_remove(nodes, tmp_path):
    """`hmpnode peers add` connects (a host name is fine: the operator wrote it), the entry
    survives b's restart, a restarted a comes back on its kept peer port and b dials it again;
    `peers remove` ends the dialling."""
    env_a = mesh_env(**ALONE, HMPNODE_PEER_PORT="auto")
    a = MeshNode(nodes(tmp_path / "a", env=env_a))
    port = a.info["peer"]["port"]
    env_b = mesh_env(**ALONE)
    b = MeshNode(nodes(tmp_path / "b", env=env_b))
    try:
        assert _cli(tmp_path / "b", "add", "tcp:/nowhere")[0] == 2  # the node's 400: one line, exit 2
        code, out, err = _cli(tmp_path / "b", "add", f"tcp://localhost:{port}")
        assert code == 0 and json.loads(out)["added"] is True, err
        await wait_for(lambda: _connected(b, a.did), 30, "b to connect to the peer added at run time")

        b.proc.stop()
        await b.close()
        b = MeshNode(nodes(tmp_path / "b", env=env_b))
        [entry] = json.loads(_cli(tmp_path / "b", "list")[1])["static"]
        assert entry["spec"] == f"tcp://localhost:{port}" and not entry["configured"]
        await wait_for(lambda: _connected(b, a.did), 30, "b to connect again after its restart")

        a.proc.stop()
        await a.close()
        dials = await _counter(b, "static_dials")
        a = MeshNode(nodes(tmp_path / "a", env=env_a))
        assert a.info["peer"]["port"] == port  # peer.port "auto": the port of the first start
        await wait_for(lambda: _connected(b, a.did), 40, "b to dial its static peer back")
        assert await _counter(b, "static_dials") > dials

        code, out, err = _cli(tmp_path / "b", "remove", a.did)  # by the DID it proved
        assert code == 0 and json.loads(out)["removed"] == [f"tcp://localhost:{port}"], err
        assert (await _peer_row(b, a.did))["static"] is False
        a.proc.stop()
        await a.close()
        await wait_for(lambda: _not_connected(b), 20, "b to see a gone")
        dials = await _counter(b, "static_dials")
        await asyncio.sleep(3.0)  # three rounds of the connect loop: a static peer would be dialled
        assert await _counter(b, "static_dials") == dials
        assert _cli(tmp_path / "b", "remove", a.did)[0] == 1  # not_found: one line, exit 1
    finally:
        await a.close()
        await b.close()


async def _not_connected(node: MeshNode) -> bool:
    return not await node.connected()


async def test_api_port_is_kept_across_restarts_and_a_taken_one_is_one_line(nodes, tmp_path):
    """api.port "auto" (no flag, no setting): the port of the first start is recorded in
    the data dir and taken again (before: a new port on every start); when another program
    holds it, the start stops with one line naming it and the ports file."""
    env = mesh_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false")
    first = nodes(tmp_path / "n", env=env, api_port=None)
    port = first.wait_ready()["api"]["port"]
    assert json.loads((tmp_path / "n" / "ports.json").read_bytes())["api"] == port
    assert first.stop() == 0
    second = nodes(tmp_path / "n", env=env, api_port=None)
    assert second.wait_ready()["api"]["port"] == port
    assert second.stop() == 0
    # an explicit 0 still means any free port, and is not recorded
    third = nodes(tmp_path / "n", env=env, api_port="0")
    third.wait_ready()
    assert json.loads((tmp_path / "n" / "ports.json").read_bytes())["api"] == port
    assert third.stop() == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        busy = nodes(tmp_path / "n", env=env, api_port=None)
        assert busy.wait(20) == 2
        lines = [line for line in busy.log().splitlines() if line.strip()]
        assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "ports.json" in lines[0], lines
        assert "Traceback" not in busy.log()
