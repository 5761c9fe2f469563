"""Circuit relays between real nodes on loopback (docs/protocol.md 34.3): a relay R (role
circuit), a node N connected to R that reserves there (circuit_reserve "always": this host
has no NAT to make it private), and a node A that knows N only at its relayed address and
reaches it through R."""

from __future__ import annotations


import aiohttp

from tests.meshutil import MeshNode, mesh_env, start_seeded, wait_for

#: no DHT, no dialling of its own unless told: the nodes meet only as each test seeds them
QUIET = {"HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_LAN_DISCOVERY": "false"}


async def _status(node: MeshNode) -> dict:
    return await node.client.status()


def _mesh_status(status: dict) -> dict:
    return status["mesh"]


async def _relayed_address(n: MeshNode) -> str | None:
    circuits = _mesh_status(await _status(n))["circuits"]
    return circuits["relayed_addresses"][0] if circuits["relayed_addresses"] else None


async def _trio(nodes, tmp_path) -> tuple[MeshNode, MeshNode, MeshNode, str]:
    r = MeshNode(nodes(tmp_path / "r", env=mesh_env(HMPNODE_NODE_ROLES="circuit", HMPNODE_PEER_TARGET_PEERS="0",
                                                    **QUIET)))
    r_addr = f"tcp://127.0.0.1:{r.info['peer']['port']}"
    n = await start_seeded(nodes, tmp_path / "n", mesh_env(HMPNODE_PEER_CIRCUIT_RESERVE="always", **QUIET),
                           [(r.did, r_addr)])
    relayed = await wait_for(lambda: _relayed_address(n), 30, "N to hold a reservation on R")
    a = await start_seeded(nodes, tmp_path / "a", mesh_env(HMPNODE_PEER_CIRCUIT_RESERVE="never", **QUIET),
                           [(n.did, relayed)])
    return r, n, a, relayed


async def test_a_node_known_only_by_its_relayed_address_is_reached_through_the_relay(nodes, tmp_path):
    r, n, a, relayed = await _trio(nodes, tmp_path)
    try:
        assert relayed == f"relay://127.0.0.1:{r.info['peer']['port']}/{r.did}"

        async def via(node: MeshNode, peer: MeshNode) -> str | None:
            return next((p.get("via") for p in await node.peers() if p["did"] == peer.did and p["connected"]), None)

        assert await wait_for(lambda: via(a, n), 30, "A to connect to N through R") == r.did
        assert await wait_for(lambda: via(n, a), 10, "N to see A through R") == r.did
        assert await via(n, r) is None  # N's own session with R is direct
        # a directed container from A arrives at N over the circuit (R holds no copy: not a relay)
        did = (await a.client.create("note", {"text": "through the circuit"}, recipients=[n.did]))["did"]
        await wait_for(lambda: n.holds(did), 30, "the directed container to reach N")
        assert not await r.holds(did)
        circuits = _mesh_status(await _status(r))["circuits"]["relay"]
        assert circuits["reservations"] == 1 and circuits["circuits"] == 1 and circuits["bytes"] > 0
        assert _mesh_status(await _status(n))["circuits"]["relayed_links"] == 1
    finally:
        for node in (r, n, a):
            await node.close()


async def test_the_relay_refuses_circuits_it_cannot_carry_with_stable_codes(nodes, tmp_path):
    """A circuit to a node without a reservation, an accept with an unknown token, a request
    that names neither, and the path on a node without the role: JSON refusals, no upgrade."""
    r = MeshNode(nodes(tmp_path / "r", env=mesh_env(HMPNODE_NODE_ROLES="circuit", **QUIET)))
    plain = MeshNode(nodes(tmp_path / "p", env=mesh_env(**QUIET)))
    try:
        async with aiohttp.ClientSession() as http:
            async def ask(node: MeshNode, query: str) -> tuple[int, str]:
                url = f"http://127.0.0.1:{node.info['peer']['port']}/hmp/v2/circuit{query}"
                async with http.get(url) as resp:
                    return resp.status, (await resp.json())["error"]

            assert await ask(r, f"?to={plain.did}") == (404, "no_reservation")
            assert await ask(r, "?accept=" + "ab" * 16) == (404, "expired")
            assert await ask(r, "?accept=nothex") == (404, "expired")
            assert await ask(r, "") == (400, "malformed")
            assert await ask(plain, f"?to={r.did}") == (404, "not_a_circuit_relay")
        refused = _mesh_status(await _status(r))["circuits"]["relay"]["refused"]
        assert refused["no_reservation"] == 1 and refused["expired"] == 2
    finally:
        await r.close()
        await plain.close()
