"""Mesh-wide versions over the container index on request (docs/protocol.md 31), on real
`hmpnode run` processes on 127.0.0.1: node A holds the chain v1 -> v2, node B holds v3 (a
new version of v2) that A does not (A forgot it); `versions?mesh=1` on A returns v1..v3
with v3 marked remote (from B), without fetching it. What A may not send B (addressed
to someone else, a LAN scope B is outside of) never shows in B's view of A's index. A
connected peer that never answers leaves the result partial (complete false), not broken."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone

import aiohttp
import orjson

from hmpnode.container.build import build_container
from hmpnode.container.schema import SchemaSet, default_schemas
from hmpnode.identity import Identity
from hmpnode.net import index as IX
from hmpnode.net.mce import build_mce
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
    b = MeshNode(nodes(tmp_path / "b", env={**env, "HMPNODE_PEER_INDEX_PAGE": "1"}))  # A follows B's cursor
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

        # a root A never held (B sent it only to Dave), a later version A holds: without mesh 404;
        # with mesh the descendants known here and at B, the author unknown (31.6)
        w1 = (await b.client.create("note", {"text": "w1 for dave"}, recipients=[DAVE.did]))["did"]
        w2 = (await b.client.create("note", {"text": "w2"}, broadcast=True, related={"previous_version": w1}))["did"]
        await wait_for(lambda: a.holds(w2), 30, "w2 at A")
        assert not await a.holds(w1)
        try:
            await a.client.versions(w1)
            raise AssertionError("versions of a container A does not hold, without mesh")
        except ApiError as exc:
            assert exc.status == 404
        rootless = await a.client.versions(w1, mesh=True)
        assert rootless["author"] is None and rootless["latest"] == [w2] and rootless["foreign"] == []
        assert by_did(rootless)[w2]["local"] is True and by_did(rootless)[w2]["peers"] == [b.did]
        try:  # forgotten stays gone, mesh or not
            await a.client.versions(v3, mesh=True)
            raise AssertionError("versions of a forgotten container")
        except ApiError as exc:
            assert exc.status == 410

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


async def test_the_answer_on_the_wire_and_a_peer_answering_garbage(nodes, tmp_path):
    """A made-up peer H: its own index request is answered as section 31.3 says (both
    messages in reply to it, entries with related, the closing response); when A asks H,
    an answer that breaks the container_index schema is refused (bad_mce) and one that
    says nothing readable about its end leaves A's versions answer complete: false."""
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env(HMPNODE_PEER_DHT="false")))
    async with aiohttp.ClientSession() as http:
        h = Identity.generate()
        ws = await authenticate(http, a.info["peer"]["port"], h)
        assert not isinstance(ws, (int, str)), ws
        try:
            v1 = (await a.client.create("note", {"text": "v1"}, broadcast=True))["did"]
            v2 = (await a.client.create("note", {"text": "v2"}, broadcast=True,
                                        related={"previous_version": v1}))["did"]
            ask = build_mce(h, "container_request", {"request_container_selection": [
                {"related_to": v1, "relation": "previous_version", "mood": "x"}], "index_nonce": "h1"},
                peer_did=a.did, now=_now())
            await ws.send_json({"type": "mce", "container": ask})
            request = ask["hmp_container"]["head"]["container_did"]
            index, done = await _answer_to(ws, request)
            assert list(index["payload"]) == [v2] and index["payload"][v2]["related"] == {"previous_version": v1}
            assert done["payload"]["selection_status"] == "processed" and done["payload"]["complete"] is True
            assert done["payload"]["selection_ignored"] == ["mood"] and done["payload"]["index_cursor"].isdigit()

            for garbage in ("schema", "ending"):
                versions = asyncio.ensure_future(a.client.versions(v1, mesh=True))
                theirs = await _request_of(ws)
                if garbage == "schema":  # an entry without a head: the class schema refuses the message
                    bare = SchemaSet(default_schemas().base_schema, {})
                    bad = build_container(h, "container_index", {"did:hmp:container:x": {"meta": {}}}, now=_now(),
                                          recipients=[a.did], related={"in_reply_to": theirs}, schemas=bare)
                    await ws.send_json({"type": "mce", "container": bad})
                else:  # a claimed version, then a response whose `complete` is no boolean
                    v3 = build_container(h, "note", {"text": "v3"}, now=_now(), related={"previous_version": v2})
                    claim = {v3["hmp_container"]["head"]["container_did"]: IX.entry_of(v3["hmp_container"])}
                    for class_, payload in (("container_index", claim), ("container_response", {
                            "available": [], "selection_status": "processed", "complete": "yes"})):
                        message = build_mce(h, class_, payload, peer_did=a.did, now=_now(), in_reply_to=theirs)
                        await ws.send_json({"type": "mce", "container": message})
                answer = await asyncio.wait_for(versions, 30)
                assert answer["complete"] is False and h.did in answer["mesh"]["asked"]
                found = by_did(answer)
                assert found[v2]["local"] is True
                if garbage == "schema":
                    assert set(found) == {v2} and h.did not in answer["mesh"]["answered"]
                else:  # what H's index claims is listed as its claim, not fetched
                    assert found[list(claim)[0]]["peers"] == [h.did] and found[list(claim)[0]]["local"] is False
            counters = (await a.client.status())["mesh"]["counters"]
            assert counters.get("strike_bad_mce", 0) >= 1
        finally:
            await ws.close()
            await a.close()


def _now() -> datetime:
    return datetime.now(timezone.utc)


async def _frames(ws, timeout: float = 20):
    """The MCE messages A sends H (other frames skipped), for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await ws.receive(timeout=max(0.05, deadline - time.monotonic()))
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        frame = orjson.loads(msg.data)
        if frame.get("type") == "mce":
            yield frame["container"]["hmp_container"]
    raise AssertionError("no such message from the node in time")


async def _answer_to(ws, request: str) -> tuple[dict, dict]:
    """A's container_index and container_response answering `request`."""
    index = None
    async for message in _frames(ws):
        if (message.get("related") or {}).get("in_reply_to") != request:
            continue
        if message["head"]["class"] == "container_index":
            index = message
        elif message["head"]["class"] == "container_response":
            assert index is not None, "the response came before the index"
            return index, message
    raise AssertionError("unreachable")


async def _request_of(ws) -> str:
    """The DID of A's next index request to H."""
    async for message in _frames(ws):
        if message["head"]["class"] == "container_request" and "index_nonce" in message["payload"]:
            return message["head"]["container_did"]
    raise AssertionError("unreachable")


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
