"""Hole punching between two real nodes on 127.0.0.1 (docs/protocol.md 34.4).

There is no NAT and no relay on one host, so both nodes run with the test-only setting
[peer] punch_test_loopback: their WebSocket connection counts as relayed (`Link.via` is
a marker) and a punch offers the peer host's own address. Everything else is the real
path: N (the side that accepted) starts, the frames go through the session, both sides
dial at the synchronised moment, the v2 handshake runs on the raw stream (A initiator),
and the direct link replaces the "relayed" one by the one-connection rule."""

from __future__ import annotations

import os

from tests.meshutil import MeshNode, mesh_env, wait_for


def _punch(peers: list[dict], did: str) -> dict | None:
    return next((p.get("punch") for p in peers if p["did"] == did and p.get("connected")), None)


async def test_a_punch_moves_the_session_to_a_direct_link(nodes, tmp_path):
    env = mesh_env(HMPNODE_PEER_PUNCH_TEST_LOOPBACK="true")
    a, b = (MeshNode(nodes(tmp_path / name, env=env)) for name in ("a", "b"))

    async def both_direct():
        pa, pb = _punch(await a.peers(), b.did), _punch(await b.peers(), a.did)
        return (pa, pb) if pa and pb and pa["state"] == pb["state"] == "direct" else None

    pa, pb = await wait_for(both_direct, 30, "both nodes to report the punch direct")
    assert pa["attempts"] >= 1 and pa["reason"] is None
    counters = [(await n.client.status())["mesh"]["counters"] for n in (a, b)]
    for c in counters:
        assert c.get("punch_direct", 0) >= 1 and c.get("punch_started", 0) >= 1
        assert c.get("connected", 0) >= 2  # the WebSocket, then the punched stream admitted beside it
    # one side started it as N (it accepted), the other answered as A (it had dialled)
    assert sum(c.get("nat_received_punch_sync", 0) for c in counters) >= 1
    # the session goes on over the punched stream: a broadcast crosses it
    tag = "tag" + os.urandom(6).hex()
    made = await a.client.create("note", {"text": "over the punched stream"}, tags=[tag], broadcast=True)
    await wait_for(lambda: b.holds(made["did"]), 20, "B to receive A's broadcast over the direct link")
    assert b.did in await a.connected() and a.did in await b.connected()


async def test_a_punch_the_peer_does_not_answer_fails_and_the_session_stays(nodes, tmp_path):
    """N (test-only "relayed", never dials) is dialled by a node for which the connection is
    direct: that node ignores the punch (only an A over a relayed connection answers), so
    N's attempts time out, it says so in /v1/peers and the counters, and the session goes on."""
    n = MeshNode(nodes(tmp_path / "n", env=mesh_env(
        HMPNODE_PEER_PUNCH_TEST_LOOPBACK="true", HMPNODE_PEER_TARGET_PEERS="0", HMPNODE_PEER_MIN_OUTBOUND="0",
        HMPNODE_PEER_PUNCH_ATTEMPTS="2", HMPNODE_PEER_PUNCH_ANSWER_MS="300")))
    other = MeshNode(nodes(tmp_path / "other", env=mesh_env()))

    async def failed():
        punch = _punch(await n.peers(), other.did)
        return punch if punch and punch["state"] == "failed" else None

    punch = await wait_for(failed, 30, "N to give the punch up")
    assert punch == {"state": "failed", "attempts": 2, "reason": "timeout"}
    counters = (await n.client.status())["mesh"]["counters"]
    assert counters["punch_failed_timeout"] == 1 and "punch_direct" not in counters
    assert (await other.client.status())["mesh"]["counters"]["punch_unexpected"] == 2
    tag = "tag" + os.urandom(6).hex()
    made = await other.client.create("note", {"text": "still over the first connection"}, tags=[tag],
                                     broadcast=True)
    await wait_for(lambda: n.holds(made["did"]), 20, "N to receive a broadcast over the kept session")
