"""A peer our agent has mail for is kept trying (peers.Peers.reach_for_mail): mail that went
on through a relay's store-and-forward, because the recipient could not be reached when it
was sent, must not leave the two agents without a session for good (in the NAT lab one pair
in 140 never connected that way). Real nodes on 127.0.0.1: R a relay (and the DHT's way in),
A and B its peers, no LAN discovery; B is offline when A mails it."""

from __future__ import annotations

import asyncio

from tests.meshutil import MeshNode, mesh_env, wait_for


async def test_a_recipient_reached_through_a_relay_is_connected_later_by_itself(nodes, tmp_path):
    lonely = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_TARGET_PEERS": "0",
              "HMPNODE_PEER_MIN_OUTBOUND": "0"}
    r = MeshNode(nodes(tmp_path / "r", env=mesh_env(HMPNODE_NODE_ROLES="relay", **lonely)))
    join = {**lonely, "HMPNODE_PEER_STATIC": f"{r.did}@tcp://127.0.0.1:{r.info['peer']['port']}",
            "HMPNODE_PEER_BOOTSTRAP": f"127.0.0.1:{r.info['peer']['dht_port']}"}
    # B's identity exists before A mails it; B itself runs only afterwards
    first = nodes(tmp_path / "b", env=mesh_env(**join))
    b_did = first.wait_ready()["did"]
    await asyncio.to_thread(first.stop)
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env(**join)))
    b = None
    try:
        await wait_for(lambda: _connected(a, r.did), 30, "A to connect to its static peer R")
        did = (await a.client.create("note", {"text": "for B, offline"}, recipients=[b_did]))["did"]
        await wait_for(lambda: r.holds(did), 30, "R to hold A's mail for B")  # B unknown to A: mailed via R
        b = MeshNode(nodes(tmp_path / "b", env=mesh_env(**join)))
        await wait_for(lambda: b.holds(did), 60, "B to get the mail from R")
        # nothing is left to send, nobody dials for its own sake (target_peers 0): A keeps trying
        # to reach the peer it had mail for, finds B's DHT record and connects (before: never)
        await wait_for(lambda: _connected(a, b_did), 90, "A to connect to B by itself")
        assert (await a.client.status())["mesh"]["counters"].get("dht_found", 0) >= 1
    finally:
        for node in (r, a, b):
            if node is not None:
                await node.close()


async def _connected(node: MeshNode, did: str) -> bool:
    return did in await node.connected()
