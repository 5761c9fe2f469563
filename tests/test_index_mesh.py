"""Mesh-wide versions over the container index on request (docs/protocol.md 31), on real
`hmpnode run` processes on 127.0.0.1: node A holds the chain v1 -> v2, node B holds v3 (a
new version of v2) that A does not (A forgot it); `versions?mesh=1` on A returns v1..v3
with v3 marked remote (from B), without fetching it. What A may not send B (addressed
to someone else, a LAN scope B is outside of) never shows in B's view of A's index. A
connected peer that never answers leaves the result partial (complete false), not broken."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from hmpnode.identity import Identity
from hmpnode.client import ApiError
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.nodeproc import hmp
from tests.peerclient import authenticate

DAVE = Identity(bytes([77]) * 32)


def by_did(answer: dict) -> dict[str, dict]:
    return {d["did"]: d for d in answer["descendants"]}


async def test_versions_across_the_mesh_mark_remote_and_never_leak(nodes, tmp_path):
    env = mesh_env(HMPNODE_PEER_DHT="false")
    a = MeshNode(nodes(tmp_path / "a", env=env))
    b = MeshNode(nodes(tmp_path / "b", env=env))
    try:
        await wait_for(lambda: _connected(a, b), 30, "A and B to connect")
        v1 = (await a.client.create("note", {"text": "v1"}, broadcast=True))["did"]
        v2 = (await a.client.create("note", {"text": "v2"}, broadcast=True, related={"previous_version": v1}))["did"]
        # versions of v2 A may not give B: addressed to someone else; a LAN scope loopback is outside of
        secret = (await a.client.create("note", {"text": "for dave"}, recipients=[DAVE.did],
                                        related={"previous_version": v2}))["did"]
        lan = (await a.client.create("note", {"text": "lan only"}, broadcast=True, network="lan:10.99.0.0/16",
                                     related={"previous_version": v2}))["did"]
        await wait_for(lambda: b.holds(v2), 30, "v2 at B")
        v3 = (await b.client.create("note", {"text": "v3"}, broadcast=True, related={"previous_version": v2}))["did"]
        await wait_for(lambda: a.holds(v3), 30, "v3 at A")
        assert (await a.client.forget(did=v3))["forgotten"] == 1  # A no longer holds v3; B does

        local = await a.client.versions(v1)
        assert set(by_did(local)) == {v2, secret, lan}  # what A holds itself
        merged = await a.client.versions(v1, mesh=True)
        found = by_did(merged)
        assert set(found) == {v2, secret, lan, v3}
        assert found[v3]["local"] is False and found[v3]["peers"] == [b.did] and found[v3]["parent"] == v2
        assert found[v2]["local"] is True and found[v2]["peers"] == [b.did]  # B's index lists v2 too
        assert found[secret]["local"] is True and "peers" not in found[secret]
        assert merged["complete"] is True and merged["mesh"] == {"asked": [b.did], "answered": [b.did]}
        assert await _gone(a, v3)  # listed, not fetched back

        # B's view of A's index: v2 (A lists it) but never what A may not send B
        seen = await b.client.versions(v1, mesh=True)
        found_b = by_did(seen)
        assert set(found_b) == {v2, v3} and found_b[v2]["peers"] == [a.did] and found_b[v3]["local"] is True
        assert secret not in json.dumps(seen) and lan not in json.dumps(seen)
        assert seen["complete"] is True
        # ... and browsing A's whole index from B, one entry a page: every page, never those two
        pages, cursor, listed = 0, None, {}
        while True:
            page = await b.client.peer_index(a.did, limit=1, cursor=cursor)
            assert page["status"] == "processed" and len(page["entries"]) <= 1
            listed.update(page["entries"])
            pages, cursor = pages + 1, page["cursor"]
            if page["complete"]:
                break
            assert pages < 50
        assert {v1, v2} <= set(listed) and secret not in listed and lan not in listed
        assert listed[v2]["related"] == {"previous_version": v1} and listed[v2]["head"]["sender_did"] == a.did
        narrowed = await b.client.peer_index(a.did, related=v2, relation="previous_version")
        assert narrowed["complete"] and narrowed["entries"] == {}  # A forgot v3; the other two it may not give B
        browsed = await asyncio.to_thread(hmp, "peer-index", a.did, "--related", v1, "--data-dir",
                                          str(b.proc.data_dir), env=env)
        assert browsed.returncode == 0, browsed.stderr.decode()
        assert list(json.loads(browsed.stdout)["entries"]) == [v2]

        shown = await asyncio.to_thread(hmp, "versions", v1, "--mesh", "--data-dir", str(a.proc.data_dir), env=env)
        assert shown.returncode == 0, shown.stderr.decode()
        assert by_did(json.loads(shown.stdout))[v3]["local"] is False

        # a connected peer that never answers: the result is still given, flagged partial
        async with aiohttp.ClientSession() as http:
            silent = Identity.generate()
            ws = await authenticate(http, a.info["peer"]["port"], silent)
            assert not isinstance(ws, (int, str)), ws
            try:
                await wait_for(lambda: _knows(a, silent.did), 30, "A to count the silent peer connected")
                partial = await a.client.versions(v1, mesh=True)
                assert partial["complete"] is False
                assert silent.did in partial["mesh"]["asked"] and silent.did not in partial["mesh"]["answered"]
                assert by_did(partial)[v3]["peers"] == [b.did]  # B's answer still counts
            finally:
                await ws.close()
        status = await a.client.request("GET", "/v1/status")
        assert status["refused"].get("index:rate_limited", 0) == 0
    finally:
        await a.close()
        await b.close()


async def test_mesh_flag_and_peer_index_are_validated(nodes, tmp_path):
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env(HMPNODE_PEER_DHT="false")))
    try:
        v1 = (await a.client.create("note", {"text": "v1"}))["did"]
        alone = await a.client.versions(v1, mesh=True)  # no peers: the local answer, complete
        assert alone["descendants"] == [] and alone["complete"] is True and alone["mesh"]["asked"] == []
        for path, params, name in ((f"/v1/containers/{v1}/versions", {"mesh": "maybe"}, "mesh"),
                                   (f"/v1/peers/{a.did}/index", {"cursor": "x1"}, "cursor")):
            status, reason, detail = await _error(a.client.request("GET", path, params=params))
            assert (status, reason) == (400, "bad_request") and name in detail, detail
        assert (await _error(a.client.peer_index("did:hmp:agent:nobody")))[:2] == (404, "peer_not_connected")
    finally:
        await a.close()


async def _error(call) -> tuple[int, str, str]:
    try:
        answer = await call
    except ApiError as exc:
        return exc.status, exc.reason, exc.detail
    raise AssertionError(f"answered: {answer!r:.200}")


async def _connected(a: MeshNode, b: MeshNode) -> bool:
    return b.did in await a.connected() and a.did in await b.connected()


async def _gone(node: MeshNode, did: str) -> bool:
    try:
        await node.client.get(did)
    except ApiError as exc:
        return exc.status == 410
    return False


async def _knows(node: MeshNode, did: str) -> bool:
    return did in await node.connected()
