"""Hole punching between two real nodes on 127.0.0.1 (docs/protocol.md 34.4), through a real
circuit relay: R (role circuit), N reserved on it, A that knows N only by its relay://
address. Loopback is no NAT, so `dial_allow = 127.0.0.0/8` lets the address R sees each of
them at count as public (34.1); everything else is the real path: the relayed session, N
(the side that accepted) starts, the frames go through the session, the relay vouched for
each side's IP (its hello), both sides dial at the synchronised moment, the v2 handshake
runs on the raw stream (A initiator), and the direct link replaces the relayed one by the
one-connection rule. (Behind real NATs: tests/test_natlab.py.)"""

from __future__ import annotations

import os

from tests.meshutil import MeshNode, mesh_env, start_seeded, wait_for

#: no DHT, no LAN discovery: the nodes meet only as the test seeds them
QUIET = {"HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_LAN_DISCOVERY": "false",
         "HMPNODE_PEER_DIAL_ALLOW": "127.0.0.0/8"}


def _entry(peers: list[dict], did: str) -> dict | None:
    return next((p for p in peers if p["did"] == did and p.get("connected")), None)


async def test_a_relayed_session_is_punched_to_a_direct_link(nodes, tmp_path):
    r = MeshNode(nodes(tmp_path / "r", env=mesh_env(HMPNODE_NODE_ROLES="circuit", HMPNODE_PEER_TARGET_PEERS="0",
                                                    **QUIET)))
    r_addr = f"tcp://127.0.0.1:{r.info['peer']['port']}"
    n = await start_seeded(nodes, tmp_path / "n", mesh_env(HMPNODE_PEER_CIRCUIT_RESERVE="always", **QUIET),
                           [(r.did, r_addr)])

    async def relayed_address():
        circuits = (await n.client.status())["mesh"]["circuits"]
        return circuits["relayed_addresses"][0] if circuits["relayed_addresses"] else None

    relayed = await wait_for(relayed_address, 30, "N to hold a reservation on R")
    a = await start_seeded(nodes, tmp_path / "a", mesh_env(HMPNODE_PEER_CIRCUIT_RESERVE="never", **QUIET),
                           [(r.did, r_addr), (n.did, relayed)])
    try:
        async def direct():
            entry_a, entry_n = _entry(await a.peers(), n.did), _entry(await n.peers(), a.did)
            punched = [e for e in (entry_a, entry_n) if e and e.get("punch") and e["punch"]["state"] == "direct"]
            return (entry_a, entry_n) if len(punched) == 2 and entry_a["via"] is None and entry_n["via"] is None \
                else None

        entry_a, entry_n = await wait_for(direct, 60, "A and N to punch their relayed session to a direct link")
        assert entry_n["punch"]["reason"] is None and entry_n["punch"]["attempts"] >= 1
        counters = {name: (await node.client.status())["mesh"]["counters"] for name, node in (("a", a), ("n", n))}
        assert counters["n"].get("punch_direct", 0) >= 1 and counters["a"].get("punch_direct", 0) >= 1
        assert counters["a"].get("dial_relayed", 0) >= 1  # A met N through R first
        assert counters["a"].get("nat_received_punch_sync", 0) >= 1  # N started (it accepted), A answered
        # the session goes on over the punched stream: a broadcast crosses it
        tag = "tag" + os.urandom(6).hex()
        made = await a.client.create("note", {"text": "over the punched stream"}, tags=[tag], broadcast=True)
        await wait_for(lambda: n.holds(made["did"]), 20, "N to receive A's broadcast over the direct link")
        assert (await r.client.status())["mesh"]["circuits"]["relay"]["circuits"] == 0  # the circuit closed
    finally:
        for node in (r, n, a):
            await node.close()
