"""Tolerant reading (profile section 13) on real nodes: what another implementation may
send a node over the peer protocol, and what the node then does with it."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import aiohttp
import orjson

from hmpnode import vectors
from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import sha256_tag
from hmpnode.identity import Identity
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import authenticate


def _signed(identity: Identity, class_: str, payload: dict, **head: object) -> dict:
    """A broadcast of `class_` carrying `payload` as given (no class-schema check), with
    extra head members set before signing."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    hmp = build_container(identity, "note", {"text": "stand-in"}, now=now, broadcast=True)["hmp_container"]
    hmp["head"].update(head, **{"class": class_, "payload_hash": sha256_tag(canonical_json(payload))})
    hmp["payload"] = payload
    return {"hmp_container": vectors.resign(hmp, identity)}


def _did(container: dict) -> str:
    return container["hmp_container"]["head"]["container_did"]


async def _ack(ws, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = orjson.loads((await ws.receive(timeout=timeout)).data)
        if value["type"] == "mce" and value["container"]["hmp_container"]["head"]["class"] == "container_ack":
            return value["container"]["hmp_container"]["payload"]
    raise AssertionError("no container_ack")


async def test_peer_sends_what_the_spec_allows(nodes, tmp_path):
    """A peer (a made-up implementation) sends a broadcast with a `network` form the node does
    not know, a goal whose payload breaks the goal schema, a vote whose payload breaks its
    schema, and an ordinary note. The node keeps the first two (both were refused before),
    refuses the vote (a class it acts on), and relays the goal and the note to its other
    peer unchanged, but never the container of unknown scope."""
    target = MeshNode(nodes(tmp_path / "target", env=mesh_env()))
    other = MeshNode(nodes(tmp_path / "other", env=mesh_env()))
    sender = Identity.generate()
    unknown_scope = _signed(sender, "note", {"text": "for one LAN"}, network="lan:192.168.10.0")
    odd_goal = _signed(sender, "goal", {"title": 5, "status": "whatever"})
    odd_vote = _signed(sender, "vote", {"target_did": 5})
    plain = _signed(sender, "note", {"text": "for everyone"})
    async with aiohttp.ClientSession() as http:
        try:
            await wait_for(lambda: _connected(target, other.did), 30, "the two nodes connected")
            ws = await authenticate(http, target.info["peer"]["port"], sender)
            assert not isinstance(ws, (int, str)), ws
            await ws.send_str(orjson.dumps({"type": "containers",
                                            "items": [unknown_scope, odd_goal, odd_vote, plain]}).decode())
            ack = await _ack(ws)
            assert sorted(ack["acknowledged"]) == sorted([_did(unknown_scope), _did(odd_goal), _did(plain)])
            assert [(r["container_did"], r["reason"]) for r in ack.get("rejected", [])] == \
                [(_did(odd_vote), "class_schema")]
            kept = await target.client.get(_did(odd_goal))
            assert kept["store_and_forward"] == ["class_schema"]
            assert kept["container"]["hmp_container"] == odd_goal["hmp_container"]
            assert await target.holds(_did(unknown_scope))

            await wait_for(lambda: other.holds(_did(plain)), 30, "the note relayed")
            await wait_for(lambda: other.holds(_did(odd_goal)), 30, "the odd goal relayed")
            relayed = await other.client.get(_did(odd_goal))
            assert relayed["container"]["hmp_container"] == odd_goal["hmp_container"]
            assert relayed["store_and_forward"] == ["class_schema"]
            assert not await other.holds(_did(unknown_scope))
            await ws.close()
        finally:
            for node in (target, other):
                await node.close()


async def _connected(node: MeshNode, did: str) -> bool:
    return did in await node.connected()
