"""container_delta `modified` and `removed` between real nodes (docs/protocol.md 32).

An evaluation made on one node reaches a peer holding the container through a
`modified` entry and the peer's block request; a container whose ttl passes is
announced `removed`; a key revocation makes the containers its key signed later
removed: announced, no longer served, relay holdings of them dropped; and a peer's
`removed` for a valid container of someone else changes nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import orjson

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from hmpnode.net.mce import build_mce
from tests.meshutil import MeshNode, mesh_env, start_nodes, wait_for
from tests.test_mesh import _connected_to
from tests.peerclient import PeerSocket, authenticate


async def _counters(node: MeshNode) -> dict[str, int]:
    return (await node.client.status())["mesh"]["counters"]


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


async def _mce(ws: PeerSocket, me: Identity, node: MeshNode, class_: str, payload: dict[str, Any]) -> None:
    message = build_mce(me, class_, payload, peer_did=node.did, now=datetime.now(timezone.utc))
    await ws.send_json({"type": "mce", "container": message})


async def _available(ws: PeerSocket, me: Identity, node: MeshNode, did: str) -> list[str]:
    """Ask `node` for `did` as a peer: the DIDs of its `container_response`."""
    await _mce(ws, me, node, "container_request", {"request_container": [did]})
    for _ in range(200):  # bounded: the answer comes within the frames that follow
        msg = await ws.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        value = orjson.loads(msg.data)
        if value["type"] == "mce":
            body = value["container"]["hmp_container"]
            if body["head"]["class"] == "container_response":
                return [a["container_did"] for a in body["payload"]["available"]]
    raise AssertionError("no container_response")


async def test_an_evaluation_reaches_a_peer_through_modified_and_a_block_request(nodes, tmp_path):
    a, b = start_nodes(nodes, tmp_path, 2)
    try:
        await wait_for(lambda: _connected_to(a, b.did), 30, "a connection")
        did = (await a.client.create("note", {"text": "rate me"}, broadcast=True))["did"]
        await wait_for(lambda: b.holds(did), 30, "the container at b")
        await a.client.evaluate(did, "usefulness", 0.5)

        async def b_has_it():
            return [i for i in (await b.client.evaluations(did)).get("items") or [] if i["agent_did"] == a.did]

        (item,) = await wait_for(b_has_it, 30, "a's evaluation at b")
        assert item["value"] == 0.5
        assert (await _counters(a)).get("delta_modified_sent", 0) >= 1
        got = await _counters(b)
        assert got.get("delta_modified_received", 0) >= 1 and got.get("delta_blocks_asked", 0) >= 1

        # a reply b never receives (addressed to someone else) grows the container's
        # referenced-by on a: b is told and asks for the block
        asked = got["delta_blocks_asked"]
        await a.client.create("note", {"text": "a private reply"}, recipients=[Identity.generate().did],
                              related={"in_reply_to": [did]})

        async def b_asked_again():
            return (await _counters(b)).get("delta_blocks_asked", 0) > asked

        await wait_for(b_asked_again, 30, "b asking for the new referenced-by block")
    finally:
        for n in (a, b):
            await n.close()


async def test_a_node_announces_an_evaluation_it_took_onwards_but_not_back_to_where_it_came_from(nodes, tmp_path):
    """Three nodes, all connected: a evaluates; b and c each take the evaluation from a
    peer and announce the change in one `modified` entry to the one peer it did not come
    from (an entry back to the source as well would make two)."""
    mesh = start_nodes(nodes, tmp_path, 3)
    a, b, c = mesh
    try:
        for n in mesh:
            await wait_for(lambda n=n: _full_mesh(n, mesh), 30, "a full mesh")
        did = (await a.client.create("note", {"text": "rate me"}, broadcast=True))["did"]
        for n in (b, c):
            await wait_for(lambda n=n: n.holds(did), 30, "the container everywhere")
        await a.client.evaluate(did, "usefulness", 1)
        for n in (b, c):
            async def sent_once(n=n):
                return (await _counters(n)).get("delta_modified_sent", 0) >= 1

            await wait_for(sent_once, 30, "the change announced onwards")
            assert (await _counters(n))["delta_modified_sent"] == 1
        assert (await _counters(a))["delta_modified_sent"] == 2
    finally:
        for n in mesh:
            await n.close()


async def _full_mesh(node: MeshNode, mesh: list[MeshNode]) -> bool:
    return {n.did for n in mesh if n is not node} <= await node.connected()


async def test_an_expired_container_is_announced_removed(nodes, tmp_path):
    a, b = start_nodes(nodes, tmp_path, 2)
    try:
        await wait_for(lambda: _connected_to(a, b.did), 30, "a connection")
        ttl = (_now() + timedelta(seconds=4)).isoformat().replace("+00:00", "Z")
        did = (await a.client.create("note", {"text": "soon gone"}, broadcast=True, ttl=ttl))["did"]
        await wait_for(lambda: b.holds(did), 30, "the container at b")

        async def b_was_told():
            return (await _counters(b)).get("delta_removed_expired", 0) >= 1

        await wait_for(b_was_told, 30, "a's removed (expired) at b")
        assert (await _counters(a)).get("delta_removed_sent", 0) >= 1
        assert await b.holds(did)  # kept, marked expired: a removal deletes nothing
    finally:
        for n in (a, b):
            await n.close()


async def test_a_revoked_key_makes_its_later_containers_removed_unserved_and_no_longer_relayed(nodes, tmp_path):
    """A stolen key K signs a broadcast X and a container Y for an offline recipient; a
    relay holds Y. K's owner revokes K as of before both: every node stops serving X,
    the relay drops Y, and the revoking node announced both as removed."""
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env()))
    relay = MeshNode(nodes(tmp_path / "relay", "--roles", "relay,mailman", env=mesh_env()))
    stolen, offline, asker = Identity.generate(), Identity.generate(), Identity.generate()
    async with aiohttp.ClientSession() as http:
        try:
            await wait_for(lambda: _connected_to(a, relay.did), 30, "a connection")
            now = _now()
            x = build_container(stolen, "note", {"text": "forged"}, now=now, broadcast=True)
            y = build_container(stolen, "note", {"text": "forged mail"}, now=now, recipients=[offline.did])
            x_did, y_did = (c["hmp_container"]["head"]["container_did"] for c in (x, y))
            await a.client.import_containers([x, y])
            await wait_for(lambda: relay.holds(x_did), 30, "the broadcast at the relay")

            async def held(n: int):
                return (await relay.client.status())["mesh"]["relay"]["held"] == n

            await wait_for(lambda: held(1), 30, "the relay holding the mail for the offline recipient")
            ws = await authenticate(http, relay.info["peer"]["port"], asker)
            assert isinstance(ws, PeerSocket), ws
            assert await _available(ws, asker, relay, x_did) == [x_did]  # served before the revocation
            assert x_did in (await a.client.peer_index(relay.did))["entries"]  # and listed in its index

            revoke = build_container(stolen, "peer_announce", {"addresses": [], "key_is_falsified": True},
                                     now=now - timedelta(seconds=60), broadcast=True)
            await a.client.import_containers([revoke])
            await wait_for(lambda: held(0), 30, "the relay dropping the revoked mail")
            assert not await relay.holds(y_did)  # held only for someone else: gone with the holding
            assert await relay.holds(x_did)  # a broadcast it holds itself: kept, flagged by nobody's word

            async def relay_heard_of_it():
                got = await _counters(relay)
                return sum(got.get(f"delta_removed_{v}", 0) for v in ("revoked", "unverified", "not_held")) >= 1

            await wait_for(relay_heard_of_it, 30, "a's removed at the relay")
            assert (await _counters(a)).get("delta_removed_sent", 0) >= 1
            assert await _available(ws, asker, relay, x_did) == []  # no longer served
            listed = await a.client.peer_index(relay.did)
            assert listed["status"] == "processed" and x_did not in listed["entries"]  # nor listed
            await ws.close()
        finally:
            for n in (a, relay):
                await n.close()


async def test_a_hostile_removed_for_a_valid_foreign_container_changes_nothing(nodes, tmp_path):
    a, b = start_nodes(nodes, tmp_path, 2)
    attacker, asker = Identity.generate(), Identity.generate()
    async with aiohttp.ClientSession() as http:
        try:
            await wait_for(lambda: _connected_to(a, b.did), 30, "a connection")
            did = (await a.client.create("note", {"text": "mine, valid"}, broadcast=True))["did"]
            await wait_for(lambda: b.holds(did), 30, "the container at b")
            ws = await authenticate(http, b.info["peer"]["port"], attacker)
            assert isinstance(ws, PeerSocket), ws
            await _mce(ws, attacker, b, "container_delta", {
                "since": "2026-11-29T10:00:00Z", "removed": [did],
                "removed_reasons": {did: {"reason": "revoked", "revocation": "did:hmp:container:made-up"}}})

            async def judged():
                return (await _counters(b)).get("delta_removed_unverified", 0) >= 1

            await wait_for(judged, 30, "b to judge the removal")
            assert await b.holds(did)
            other = await authenticate(http, b.info["peer"]["port"], asker)
            assert isinstance(other, PeerSocket), other
            assert await _available(other, asker, b, did) == [did]  # still served to everyone else
            assert (await b.client.status())["mesh"]["counters"].get("relay_dropped_removed", 0) == 0
            await ws.close()
            await other.close()
        finally:
            for n in (a, b):
                await n.close()


async def test_the_outbox_stops_delivering_a_revoked_container(nodes, tmp_path):
    """A container the agent imported for an unreachable recipient waits in the outbox;
    once its signer's key is revoked as of before it, the entry ends as an expired one does."""
    (a,) = start_nodes(nodes, tmp_path, 1)
    stolen, offline = Identity.generate(), Identity.generate()
    try:
        now = _now()
        mail = build_container(stolen, "note", {"text": "forged mail"}, now=now, recipients=[offline.did])
        await a.client.import_containers([mail])

        async def outbox(n: int) -> bool:
            return (await a.client.status())["mesh"]["outbox"] == n

        await wait_for(lambda: outbox(1), 30, "the entry in the outbox")
        revoke = build_container(stolen, "peer_announce", {"addresses": [], "key_is_falsified": True},
                                 now=now - timedelta(seconds=60))
        await a.client.import_containers([revoke])
        await wait_for(lambda: outbox(0), 30, "the outbox to let the revoked mail go")
    finally:
        await a.close()
