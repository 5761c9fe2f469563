"""The local agent API (hmpnode.api) against a real Node on a temporary directory."""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hmpnode.api import ApiLimits, create_app, dashboard
from hmpnode.api.app import OPENAPI_PATH, PUBLIC_ROUTES, ROUTES
from hmpnode.api.cursor import CursorCodec
from hmpnode.container.build import build_container
from hmpnode.container.encoding import b58encode, b64url_decode, b64url_encode
from hmpnode.container.evaluations import build_evaluation
from hmpnode.container.payload import open_payload
from hmpnode.identity import Identity, ed25519_pk_to_x25519
from hmpnode.node import Node
from tests.conftest import NOW, Clock

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODE_SEED = bytes([7]) * 32
ALICE = Identity(bytes([1]) * 32)
BOB = Identity(bytes([2]) * 32)
CAROL = Identity(bytes([3]) * 32)
UNKNOWN = "did:hmp:container:QmUnknownUnknownUnknownUnknownUnknownUnknown1"



@dataclass
class Api:
    client: TestClient
    node: Node
    clock: Clock

    async def call(self, method: str, path: str, *, json_body: Any = None, data: bytes | None = None,
                   headers: dict[str, str] | None = None, auth: bool = True, params: Any = None) -> tuple[int, Any]:
        hdrs = dict(AUTH) if auth else {}
        if json_body is not None:
            data = orjson.dumps(json_body)
            hdrs["Content-Type"] = "application/json"
        hdrs.update(headers or {})
        async with self.client.request(method, path, data=data, headers=hdrs, params=params) as resp:
            raw = await resp.read()
            if resp.content_type == "application/json":
                body = orjson.loads(raw)
                if resp.status >= 400:
                    assert isinstance(body, dict) and isinstance(body["reason"], str) and isinstance(body["detail"], str)
                return resp.status, body
            assert resp.status < 400, (resp.status, raw[:200])
            return resp.status, raw.decode()

    async def raw(self, method: str, path: str, body: Any = None, params: Any = None) -> bytes:
        """The response's bytes as sent (for byte-for-byte comparisons); a 2xx status."""
        data = orjson.dumps(body) if body is not None else None
        headers = {**AUTH, **({"Content-Type": "application/json"} if data is not None else {})}
        async with self.client.request(method, path, data=data, headers=headers, params=params) as resp:
            assert resp.status < 300, (resp.status, await resp.text())
            return await resp.read()

    async def get(self, path: str, **kw):
        return await self.call("GET", path, **kw)

    async def post(self, path: str, body: Any, **kw):
        return await self.call("POST", path, json_body=body, **kw)

    async def create(self, class_: str = "diary_entry", payload: Any = None, **fields) -> dict[str, Any]:
        body = {"class": class_, "payload": payload if payload is not None else {"title": "t", "content": "c"}, **fields}
        status, out = await self.post("/v1/containers", body)
        assert status == 201, out
        return out


@pytest.fixture
async def make_api(tmp_path):
    made: list[Api] = []

    async def make(limits: ApiLimits = ApiLimits()) -> Api:
        clock = Clock(NOW)
        node = Node(Identity(NODE_SEED), tmp_path / f"node{len(made)}", clock=clock, synchronous="normal")
        await node.start()
        client = TestClient(TestServer(create_app(node, token=TOKEN, limits=limits), host="127.0.0.1"))
        await client.start_server()
        api = Api(client, node, clock)
        made.append(api)
        return api

    yield make
    for api in made:
        await api.client.close()
        await api.node.stop()


@pytest.fixture
async def api(make_api) -> Api:
    return await make_api()


def signed(identity: Identity, class_: str = "diary_entry", payload: Any = None, **kw) -> dict[str, Any]:
    """A full-form container signed by someone other than the node."""
    return build_container(identity, class_, payload or {"title": "x", "content": "y"}, now=NOW, **kw)


def concrete(path: str, did: str = UNKNOWN) -> str:
    return path.replace("{did}", did)


# -- auth, documents, meta routes ----------------------------------------------------------


async def test_every_route_needs_the_token(api):
    wrong = [None, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"},
             {"Authorization": "Bearer"}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN}]
    paths = [(m, concrete(p)) for m, p, _ in ROUTES if p not in PUBLIC_ROUTES] + [("GET", "/nowhere"),
                                                                                    ("DELETE", "/v1/health")]
    for method, path in paths:
        for headers in wrong:
            async with api.client.request(method, path, headers=headers or {}, data=b"{}") as resp:
                assert resp.status == 401, (method, path, headers)
                assert resp.content_type == "application/json"
                body = await resp.json()
                assert body["reason"] == "unauthorized" and body["detail"]
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    # the scheme is case-insensitive, the token is not
    assert (await api.get("/v1/health", auth=False, headers={"Authorization": f"bearer {TOKEN}"}))[0] == 200
    assert (await api.get("/v1/health", auth=False, headers={"Authorization": f"Bearer {TOKEN.upper()}"}))[0] == 401


async def test_create_app_refuses_an_empty_token(api):
    with pytest.raises(ValueError):
        create_app(api.node, token="")


def _app_routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes()}


async def test_openapi_document_describes_exactly_the_routes(api):
    doc = json.loads(OPENAPI_PATH.read_text())
    assert doc["openapi"].startswith("3.")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if m != "parameters"}
    # and the dashboard's static files (no data, no token: tests/test_dashboard.py)
    assert _app_routes(api.client.server.app) == documented | {(m, p) for m, p, _ in dashboard.PUBLIC_ROUTES}
    assert {(m, p) for m, p, _ in ROUTES} == documented
    # served as is
    status, served = await api.get("/v1/openapi.json")
    assert status == 200 and served == doc
    # bearer security, the error schema, and every operation documents 401 and its success code
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["components"]["schemas"]["Error"]["required"] == ["reason", "detail"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            # the public routes say so (security: []) and are the only ones without a 401
            assert (op.get("security") == []) == (path in PUBLIC_ROUTES), (method, path)
            assert ("401" in op["responses"]) != (path in PUBLIC_ROUTES), (method, path)
            assert any(code.startswith("2") for code in op["responses"]), (method, path)
            if "{did}" in path:
                names = [p.get("name") or p["$ref"].rsplit("/", 1)[-1] for p in op.get("parameters", [])]
                assert "did" in names
            if method == "post":
                assert op["requestBody"]["content"]["application/json"]["schema"]
                assert {"413", "415", "400"} <= set(op["responses"])
    # the list/events query parameters documented are the ones the handlers accept
    list_params = {p["name"] for p in doc["paths"]["/v1/containers"]["get"]["parameters"]}
    assert list_params == {"class", "tag", "sender", "recipient", "related", "since", "until", "expired", "order",
                           "limit", "cursor"}
    event_params = {p["name"] for p in doc["paths"]["/v1/events"]["get"]["parameters"]}
    assert event_params == {"class", "tag", "to_me", "sender", "cursor", "Last-Event-ID"}


async def test_health_and_status(api):
    assert await api.get("/v1/health") == (200, {"ok": True})
    await api.create()
    status, out = await api.get("/v1/status")
    assert status == 200
    assert out["did"] == Identity(NODE_SEED).did
    assert out["last_seq"] == 1 and out["store"]["containers"] == 1
    assert out["api"]["limits"]["max_batch"] == 1000
    assert out["api"]["event_subscribers"] == 0
    assert (await api.get("/v1/health?x=1"))[1]["reason"] == "unknown_field"


async def test_healthz_without_token_and_503_once_the_store_is_closed(api):
    assert await api.get("/healthz", auth=False) == (200, {"status": "ok"})
    await api.node.db.close()  # what a stopping node does after the API stopped taking requests
    assert await api.get("/healthz", auth=False) == (503, {"status": "unavailable", "reason": "unavailable",
                                                           "detail": "not ready"})


# -- create -------------------------------------------------------------------------------------------


async def test_create_plain_then_duplicate_then_get(api):
    body = {"class": "diary_entry", "payload": {"title": "a", "content": "b"}, "tags": ["t1", "t2"], "ttl": "7d",
            "subclass": "note", "meta": {"k": 1}, "confidence": 0.5, "broadcast": True, "network": "localhost",
            "compression": "gzip", "related": {"see_also": [UNKNOWN]}}
    status, out = await api.post("/v1/containers", body)
    assert status == 201 and out["status"] == "stored" and out["seq"] == 1
    head = out["container"]["hmp_container"]["head"]
    assert out["did"] == head["container_did"]
    assert head["sender_did"] == api.node.identity.did
    assert head["tags"] == ["t1", "t2"] and head["subclass"] == "note" and head["compression"] == "gzip"
    assert head["ttl"] == "2026-12-06T10:15:00Z"  # NOW + 7 days
    assert head["confidence"] == 0.5 and head["broadcast"] is True and head["network"] == "localhost"
    assert out["container"]["hmp_container"]["related"] == {"see_also": [UNKNOWN]}
    # the same request in the same second: the same content-addressed DID
    status, again = await api.post("/v1/containers", body)
    assert status == 200 and again["status"] == "duplicate" and again["did"] == out["did"]

    status, got = await api.get(f"/v1/containers/{out['did']}")
    assert status == 200 and got["did"] == out["did"] and got["seq"] == 1 and got["source"] == "agent"
    assert got["container"]["hmp_container"] == out["container"]["hmp_container"]
    status, got = await api.get(f"/v1/containers/{out['did']}", params={"decrypt": "true"})
    assert got["payload"] == {"title": "a", "content": "b"}  # compressed, not encrypted: readable

    # ttl as an RFC 3339 instant
    out = await api.create(payload={"title": "b", "content": "c"}, ttl="2027-01-01T00:00:00Z")
    assert out["container"]["hmp_container"]["head"]["ttl"] == "2027-01-01T00:00:00Z"


async def test_create_directed_and_encrypted(api):
    # plain directed
    out = await api.create(payload={"title": "to bob", "content": "plain"}, recipients=[BOB.did])
    head = out["container"]["hmp_container"]["head"]
    assert head["recipient"] == [BOB.did] and "key_recipient" not in head
    # encrypted for bob's key only: the did defaults to the key's self-certifying DID
    out = await api.create(payload={"title": "secret", "content": "for bob"},
                           encrypt_for=[{"public_key": BOB.public_key_b58}], compression="zstd")
    hmp = out["container"]["hmp_container"]
    assert hmp["head"]["recipient"] == [BOB.did] and hmp["head"]["key_recipient"]
    assert open_payload(hmp, BOB) == {"title": "secret", "content": "for bob"}
    _, got = await api.get(f"/v1/containers/{out['did']}", params={"decrypt": "true"})
    assert "payload" not in got and got["payload_error"]["reason"] == "not_recipient"
    _, got = await api.get(f"/v1/containers/{out['did']}")
    assert "payload" not in got and "payload_error" not in got
    # group: the node, bob and carol (carol under an explicit DID)
    node_key = api.node.identity.public_key_b58
    out = await api.create(payload={"title": "group", "content": "both"},
                           encrypt_for=[{"public_key": node_key}, {"public_key": BOB.public_key_b58},
                                        {"public_key": CAROL.public_key_b58, "did": "did:example:carol"}])
    hmp = out["container"]["hmp_container"]
    assert [g["recipient"] for g in hmp["head"]["group_recipient"]] == [api.node.identity.did, BOB.did,
                                                                      "did:example:carol"]
    assert open_payload(hmp, BOB) == {"title": "group", "content": "both"}
    _, got = await api.get(f"/v1/containers/{out['did']}", params={"decrypt": "true"})
    assert got["payload"] == {"title": "group", "content": "both"}
    # recipients filter sees both kinds
    _, page = await api.get("/v1/containers", params={"recipient": BOB.did})
    assert len(page["items"]) == 3
    _, page = await api.get("/v1/containers", params={"recipient": "did:example:carol"})
    assert len(page["items"]) == 1


@pytest.mark.parametrize("body, status, reason, field", [
    ({"class": "diary_entry"}, 400, "bad_request", "payload"),
    ({"payload": {}}, 400, "bad_request", "class"),
    ({"class": "diary_entry", "payload": {}, "colour": "red"}, 400, "unknown_field", "colour"),
    ({"class": 5, "payload": {}}, 400, "bad_request", "class"),
    ({"class": "diary_entry", "payload": [1]}, 400, "bad_request", "payload"),
    ({"class": "x", "payload": {}, "tags": "t"}, 400, "bad_request", "tags"),
    ({"class": "x", "payload": {}, "tags": [1]}, 400, "bad_request", "tags[0]"),
    ({"class": "x", "payload": {}, "ttl": "tomorrow"}, 400, "bad_request", "ttl"),
    ({"class": "x", "payload": {}, "ttl": "0s"}, 400, "bad_request", "ttl"),
    ({"class": "x", "payload": {}, "ttl": "999999999w"}, 400, "bad_request", "ttl"),
    ({"class": "x", "payload": {}, "ttl": 30}, 400, "bad_request", "ttl"),
    ({"class": "x", "payload": {}, "compression": "lz4"}, 400, "bad_request", "compression"),
    ({"class": "x", "payload": {}, "confidence": 2}, 400, "bad_request", "confidence"),
    ({"class": "x", "payload": {}, "confidence": True}, 400, "bad_request", "confidence"),
    ({"class": "x", "payload": {}, "broadcast": "yes"}, 400, "bad_request", "broadcast"),
    ({"class": "x", "payload": {}, "meta": []}, 400, "bad_request", "meta"),
    ({"class": "x", "payload": {}, "recipients": ["bob"]}, 400, "bad_did", "recipients[0]"),
    ({"class": "x", "payload": {}, "recipients": []}, 400, "bad_request", "recipients"),
    ({"class": "x", "payload": {}, "related": {"r": "nope"}}, 400, "bad_did", "related.r"),
    ({"class": "x", "payload": {}, "related": {"r": 5}}, 400, "bad_request", "related.r"),
    ({"class": "x", "payload": {}, "encrypt_for": [{"public_key": "0OIl"}]}, 400, "bad_request", "encrypt_for[0].public_key"),
    ({"class": "x", "payload": {}, "encrypt_for": [{}]}, 400, "bad_request", "encrypt_for[0].public_key"),
    ({"class": "x", "payload": {}, "encrypt_for": [{"public_key": BOB.public_key_b58, "x": 1}]}, 400, "unknown_field", "x"),
    ({"class": "x", "payload": {}, "encrypt_for": [{"public_key": BOB.public_key_b58, "did": "b"}]}, 400, "bad_did", "did"),
    ({"class": "x", "payload": {}, "encrypt_for": {"public_key": BOB.public_key_b58}}, 400, "bad_request", "encrypt_for"),
    # refused by the builder: 422 invalid_container
    ({"class": "goal", "payload": {"title": "priority as text", "priority": "high"}}, 422, "invalid_container", "goal"),
    ({"class": "bad class!", "payload": {}}, 422, "invalid_container", "class"),
    ({"class": "x", "payload": {}, "network": "lan:not-a-cidr"}, 422, "invalid_container", ""),
    ({"class": "x", "payload": {}, "recipients": [BOB.did], "encrypt_for": [{"public_key": BOB.public_key_b58}]},
     422, "invalid_container", "recipients"),
    ({"class": "x", "payload": {"n": 2**60}}, 422, "invalid_container", ""),
])
async def test_create_refusals(api, body, status, reason, field):
    got_status, out = await api.post("/v1/containers", body)
    assert (got_status, out["reason"]) == (status, reason), out
    assert field in out["detail"]


async def test_create_with_a_public_key_that_is_not_a_curve_point(api):
    def is_point(key: bytes) -> bool:
        try:
            ed25519_pk_to_x25519(key)
        except ValueError:
            return False
        return True

    key = next(k for k in (bytes([i]) * 31 + b"\x80" for i in range(256)) if not is_point(k))
    status, out = await api.post("/v1/containers", {"class": "x", "payload": {},
                                                    "encrypt_for": [{"public_key": b58encode(key)}]})
    assert (status, out["reason"]) == (400, "bad_request") and "public_key" in out["detail"]


# -- import --------------------------------------------------------------------------------------------


async def test_import_single_full_bare_duplicate_rejected(api):
    full = signed(ALICE, payload={"title": "from alice", "content": "1"})
    did = full["hmp_container"]["head"]["container_did"]
    status, out = await api.post("/v1/containers/import", full)
    assert status == 201 and out["status"] == "stored" and out["did"] == did and out["seq"] == 1
    status, out = await api.post("/v1/containers/import", full)
    assert status == 200 and out["status"] == "duplicate" and out["seq"] == 1
    bare = signed(ALICE, payload={"title": "bare", "content": "2"})["hmp_container"]
    status, out = await api.post("/v1/containers/import", bare)
    assert status == 201 and out["did"] == bare["head"]["container_did"]
    _, got = await api.get(f"/v1/containers/{did}")
    assert got["source"] == "agent" and got["container"]["hmp_container"]["head"]["sender_did"] == ALICE.did

    tampered = copy.deepcopy(signed(ALICE, payload={"title": "t", "content": "3"}))
    tampered["hmp_container"]["payload"]["content"] = "changed"
    status, out = await api.post("/v1/containers/import", tampered)
    assert status == 422 and out["reason"] == "payload_hash_mismatch"
    assert out["did"] == tampered["hmp_container"]["head"]["container_did"]
    resigned = copy.deepcopy(signed(ALICE, payload={"title": "s", "content": "4"}))
    sig = bytearray(b64url_decode(resigned["hmp_container"]["head"]["signature"]))
    sig[0] ^= 1
    resigned["hmp_container"]["head"]["signature"] = b64url_encode(bytes(sig))
    status, out = await api.post("/v1/containers/import", resigned)
    assert (status, out["reason"]) == (422, "bad_signature")
    status, out = await api.post("/v1/containers/import", {"something": "else"})
    assert (status, out["reason"]) == (422, "schema")
    # strict reading of a single container: duplicate keys are malformed
    raw = orjson.dumps(full)[:-1] + b',"hmp_container":{}}'
    status, out = await api.call("POST", "/v1/containers/import", data=raw,
                                 headers={"Content-Type": "application/json"})
    assert (status, out["reason"]) == (422, "malformed")
    status, out = await api.post("/v1/containers/import", [full])
    assert (status, out["reason"]) == (400, "bad_request")


async def test_import_batch_mixed(api):
    good = [signed(ALICE, payload={"title": f"n{i}", "content": "c"}) for i in range(3)]
    await api.post("/v1/containers/import", good[0])
    tampered = copy.deepcopy(good[2])
    tampered["hmp_container"]["head"]["class"] = "other"
    items = [good[1], good[0], tampered, 42, "text", None, [1, 2], good[2]["hmp_container"], good[1]]
    status, out = await api.post("/v1/containers/import", {"containers": items})
    assert status == 200
    statuses = [r["status"] for r in out["results"]]
    assert statuses == ["stored", "duplicate", "rejected", "rejected", "rejected", "rejected", "rejected", "stored",
                        "duplicate"]
    assert (out["stored"], out["duplicate"], out["rejected"], out["conflict"]) == (2, 2, 5, 0)
    assert out["results"][2]["reason"] in ("container_did_mismatch", "bad_signature")
    assert out["results"][2]["did"] == good[2]["hmp_container"]["head"]["container_did"]
    assert {r["reason"] for r in out["results"][3:7]} == {"malformed"}
    assert out["results"][0]["seq"] and out["results"][7]["seq"] > out["results"][0]["seq"]
    status, out = await api.post("/v1/containers/import", {"containers": []})
    assert status == 200 and out["results"] == [] and out["stored"] == 0
    # an oversized container in a batch is refused as on the wire (verification's size limit)
    limit = api.node.limits.max_container_bytes
    huge = signed(ALICE, "note", {"blob": "x" * limit})
    status, out = await api.post("/v1/containers/import", {"containers": [huge, signed(ALICE, payload={"title": "s", "content": "m"})]})
    assert [r["status"] for r in out["results"]] == ["rejected", "stored"]
    assert out["results"][0]["reason"] == "malformed" and "limit" in out["results"][0]["detail"]
    status, out = await api.post("/v1/containers/import", huge)
    assert (status, out["reason"]) == (422, "malformed")
    status, out = await api.post("/v1/containers/import", {"containers": {"a": 1}})
    assert (status, out["reason"]) == (400, "bad_request") and "containers" in out["detail"]


async def test_import_batch_items_are_read_as_on_the_wire(api):
    """Each item of {"containers": [...]} goes to verification as its own JSON text
    (docs/protocol.md#rule-import-as-text): strict reading as for one container; the body's own
    errors are those of a parsed body."""
    async def send(body: bytes):
        return await api.call("POST", "/v1/containers/import", data=body, headers={"Content-Type": "application/json"})

    good = signed(ALICE, payload={"title": "wire", "content": "w"})
    text = orjson.dumps(good)
    twice = text[:-1] + b',"hmp_container":' + orjson.dumps(good["hmp_container"]) + b"}"  # a duplicate key
    pretty = json.dumps(signed(ALICE, payload={"title": "pretty", "content": "p"}), indent=2).encode()
    status, out = await send(b'{"containers": [' + twice + b", " + pretty + b", " + text + b"]}")
    assert status == 200, out
    assert [(r["status"], r.get("reason")) for r in out["results"]] == [("rejected", "malformed"), ("stored", None),
                                                                        ("stored", None)]
    assert "duplicate key" in out["results"][0]["detail"]
    status, out = await send(b'{"containers":[' + text + b"]}")
    assert [r["status"] for r in out["results"]] == ["duplicate"]
    # the body's errors: not UTF-8, not JSON, other keys beside "containers" (one container then)
    status, out = await send(b'{"containers":[' + text[:-2] + b'"\xff"}]}')
    assert (status, out["reason"]) == (400, "bad_json") and "UTF-8" in out["detail"]
    status, out = await send(b'{"containers":[' + text + b"]")
    assert (status, out["reason"]) == (400, "bad_json")
    status, out = await send(b'{"containers":[' + text + b'],"x":1}')
    assert (status, out["reason"]) == (422, "schema")
    # nesting msgspec does not read but the full parse does: the parsed path answers as before
    deep = b"[" * 1010 + b"]" * 1010
    status, out = await send(b'{"containers":[' + deep + b"]}")
    assert (status, out["reason"]) == (400, "bad_json")  # was a 500 (orjson.dumps of the item)
    status, out = await send(b'{"containers":[{"a":' + deep + b"}]}")
    assert status == 200 and [(r["status"], r["reason"]) for r in out["results"]] == [("rejected", "malformed")]


async def test_import_limits(make_api):
    api = await make_api(ApiLimits(max_batch=2, max_body_bytes=4096))
    one = signed(ALICE)
    status, out = await api.post("/v1/containers/import", {"containers": [one, one, one]})
    assert (status, out["reason"]) == (413, "batch_too_large")
    status, out = await api.post("/v1/containers/import", {"containers": [one, one]})
    assert status == 200 and out["stored"] == 1 and out["duplicate"] == 1
    big = {"class": "diary_entry", "payload": {"title": "big", "content": "x" * 5000}}
    status, out = await api.post("/v1/containers", big)
    assert (status, out["reason"]) == (413, "body_too_large")

    # without Content-Length (chunked): still a JSON 413
    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    async with api.client.post("/v1/containers", data=chunks(),
                               headers={**AUTH, "Content-Type": "application/json"}) as resp:
        assert resp.status == 413 and (await resp.json())["reason"] == "body_too_large"


# -- reads, list, pagination ---------------------------------------------------------------------------------


async def test_get_errors(api):
    assert (await api.get(f"/v1/containers/{UNKNOWN}"))[1]["reason"] == "not_found"
    for sub in ("", "/versions", "/referenced-by", "/evaluations"):
        status, out = await api.get(f"/v1/containers/{UNKNOWN}{sub}")
        assert (status, out["reason"]) == (404, "not_found"), sub
        for bad in ("nodid", "did:UPPER:x", "did:x:" + "a" * 600, "did:x:%C3%A9", "did:x:a%20b"):
            status, out = await api.get(f"/v1/containers/{bad}{sub}")
            assert (status, out["reason"]) == (400, "bad_did"), (bad, sub)
    status, out = await api.get(f"/v1/containers/{UNKNOWN}", params={"decrypt": "maybe"})
    assert (status, out["reason"]) == (400, "bad_request") and "decrypt" in out["detail"]
    status, out = await api.get(f"/v1/containers/{UNKNOWN}", params={"decrpyt": "true"})
    assert (status, out["reason"]) == (400, "unknown_field")
    status, out = await api.call("PUT", f"/v1/containers/{UNKNOWN}")
    assert (status, out["reason"]) == (405, "method_not_allowed")
    status, out = await api.get("/v1/nothing/here")
    assert (status, out["reason"]) == (404, "not_found")


async def test_post_body_errors(api):
    for path in ("/v1/containers", "/v1/containers/import", f"/v1/containers/{UNKNOWN}/evaluations"):
        status, out = await api.call("POST", path, data=b'{"a": 1}', headers={"Content-Type": "text/plain"})
        assert (status, out["reason"]) == (415, "unsupported_media_type"), path
        status, out = await api.call("POST", path, data=b'{"a": 1}')  # no Content-Type at all
        assert (status, out["reason"]) == (415, "unsupported_media_type"), path
        for raw in (b"", b"{", b"\xff\xfe", b"[" * 2000, b"NaN", b'{"a": 1e999}'):
            status, out = await api.call("POST", path, data=raw, headers={"Content-Type": "application/json"})
            assert (status, out["reason"]) == (400, "bad_json"), (path, raw[:10])
        status, out = await api.call("POST", path, data=b'"text"', headers={"Content-Type": "application/json; charset=utf-8"})
        assert status == 400 and out["reason"] == "bad_request", path
        # compressed request bodies are refused
        status, out = await api.call("POST", path, data=gzip.compress(b"{}"),
                                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert (status, out["reason"]) == (415, "unsupported_media_type") and "Content-Encoding" in out["detail"]


async def test_list_pagination_is_complete_and_stable(api):
    created = []
    for i in range(23):
        cls = "diary_entry" if i % 2 else "semantic_node"
        payload = {"title": f"p{i}", "content": "c"} if i % 2 else {"label": f"n{i}"}
        out = await api.create(cls, payload, tags=["even" if i % 2 == 0 else "odd", "all"])
        created.append(out["did"])
    for order in ("asc", "desc"):
        seen, cursor, pages = [], None, 0
        while True:
            params = {"limit": "5", "order": order}
            if cursor:
                params["cursor"] = cursor
            status, page = await api.get("/v1/containers", params=params)
            assert status == 200
            seen.extend(item["did"] for item in page["items"])
            seqs = [item["seq"] for item in page["items"]]
            assert seqs == sorted(seqs, reverse=order == "desc")
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                break
            # a cursor is tied to its order
            other = "desc" if order == "asc" else "asc"
            status, out = await api.get("/v1/containers", params={"order": other, "cursor": cursor})
            assert (status, out["reason"]) == (400, "bad_cursor")
        assert seen == (created if order == "asc" else created[::-1])
        assert pages == 5
    # a new container shows up after the last page's cursor, once
    _, page = await api.get("/v1/containers", params={"limit": "23"})
    last = page["next_cursor"]
    out = await api.create(payload={"title": "late", "content": "c"})
    _, page = await api.get("/v1/containers", params={"cursor": last})
    assert [i["did"] for i in page["items"]] == [out["did"]] and page["next_cursor"] is None
    # the default limit, and the bounds
    _, page = await api.get("/v1/containers")
    assert len(page["items"]) == 24
    for bad in ("0", "1001", "-1", "x", "1.5", "", "99999999999999999999"):
        status, out = await api.get("/v1/containers", params={"limit": bad})
        assert (status, out["reason"]) == (400, "bad_request") and "limit" in out["detail"], bad


async def test_list_cursor_garbage_and_tampering(api):
    for _ in range(3):
        await api.create(payload={"title": str(_), "content": "c"})
    _, page = await api.get("/v1/containers", params={"limit": "1"})
    cursor = page["next_cursor"]
    raw = bytearray(b64url_decode(cursor))
    raw[5] ^= 1  # another seq, same tag: tampered
    for bad in ("x", "!!!!", "A" * 200, b64url_encode(bytes(raw)), cursor[:-2], cursor + "AA", "=" * 8, "é"):
        status, out = await api.get("/v1/containers", params={"cursor": bad})
        assert (status, out["reason"]) == (400, "bad_cursor"), bad
    # a cursor from another node is not ours
    other_node_cursor = CursorCodec.for_identity(BOB).encode(1)
    status, out = await api.get("/v1/containers", params={"cursor": other_node_cursor})
    assert (status, out["reason"]) == (400, "bad_cursor")
    status, page = await api.get("/v1/containers", params={"cursor": cursor})
    assert status == 200 and [i["seq"] for i in page["items"]] == [2, 3]


async def test_list_filters(api):
    mine = await api.create(payload={"title": "mine", "content": "c"}, tags=["red"])
    theirs = signed(ALICE, payload={"title": "theirs", "content": "c"}, tags=["blue"], recipients=[BOB.did])
    await api.post("/v1/containers/import", theirs)
    theirs_did = theirs["hmp_container"]["head"]["container_did"]
    reply = signed(CAROL, "semantic_node", {"label": "reply"}, related={"in_reply_to": theirs_did})
    await api.post("/v1/containers/import", reply)
    reply_did = reply["hmp_container"]["head"]["container_did"]
    later = build_container(ALICE, "diary_entry", {"title": "later", "content": "c"}, now=NOW + timedelta(hours=1),
                            tags=["red"])
    api.clock.now = NOW + timedelta(hours=1)
    await api.post("/v1/containers/import", later)
    later_did = later["hmp_container"]["head"]["container_did"]

    async def dids(**params):
        status, page = await api.get("/v1/containers", params=params)
        assert status == 200, page
        return [i["did"] for i in page["items"]]

    assert await dids(tag="red") == [mine["did"], later_did]
    assert await dids(tag="red", sender=ALICE.did) == [later_did]
    assert await dids(sender=api.node.identity.did) == [mine["did"]]
    assert await dids(**{"class": "semantic_node"}) == [reply_did]
    assert await dids(recipient=BOB.did) == [theirs_did]
    assert await dids(related=theirs_did) == [reply_did]
    assert await dids(since="2026-11-29T10:30:00Z") == [later_did]
    assert await dids(until="2026-11-29T10:30:00Z") == [mine["did"], theirs_did, reply_did]
    assert await dids(order="desc", limit="2") == [later_did, reply_did]
    for name, bad, reason in (("since", "yesterday", "bad_request"), ("until", "2026-11-29", "bad_request"),
                              ("sender", "alice", "bad_did"), ("related", "x", "bad_did"),
                              ("recipient", "did:", "bad_did"), ("expired", "no", "bad_request"),
                              ("order", "up", "bad_request"), ("class", "", "bad_request"),
                              ("colour", "red", "unknown_field")):
        status, out = await api.get("/v1/containers", params={name: bad})
        assert (status, out["reason"]) == (400, reason), name
    status, out = await api.get("/v1/containers", params=[("tag", "a"), ("tag", "b")])
    assert (status, out["reason"]) == (400, "bad_request") and "tag" in out["detail"]


async def test_list_expired(api):
    short = await api.create(payload={"title": "short", "content": "c"}, ttl="1h")
    long = await api.create(payload={"title": "long", "content": "c"}, ttl="7d")
    forever = await api.create(payload={"title": "forever", "content": "c"})
    api.clock.now = NOW + timedelta(hours=2)

    async def dids(**params):
        _, page = await api.get("/v1/containers", params=params)
        return [i["did"] for i in page["items"]]

    assert await dids() == [long["did"], forever["did"]]
    assert await dids(expired="false") == [long["did"], forever["did"]]
    assert await dids(expired="true") == [short["did"]]
    assert await dids(expired="any") == [short["did"], long["did"], forever["did"]]
    _, got = await api.get(f"/v1/containers/{short['did']}")
    assert got["expired"] is True


# -- versions, referenced-by, evaluations ---------------------------------------------------------------------------


async def test_versions_and_forks(api):
    v1 = signed(ALICE, payload={"title": "v1", "content": "c"})
    v1_did = v1["hmp_container"]["head"]["container_did"]
    v2 = signed(ALICE, payload={"title": "v2", "content": "c"}, related={"previous_version": v1_did})
    v2b = signed(ALICE, payload={"title": "v2b", "content": "c"}, related={"previous_version": v1_did})
    v3 = signed(ALICE, payload={"title": "v3", "content": "c"},
                related={"previous_version": v2["hmp_container"]["head"]["container_did"]})
    status, out = await api.post("/v1/containers/import", {"containers": [v1, v2, v2b, v3]})
    assert out["stored"] == 4
    foreign = await api.create(payload={"title": "node's fork", "content": "c"}, related={"previous_version": v1_did})
    status, versions = await api.get(f"/v1/containers/{v1_did}/versions")
    assert status == 200
    did = lambda c: c["hmp_container"]["head"]["container_did"]  # noqa: E731
    assert versions["did"] == v1_did and versions["author"] == ALICE.did
    assert versions["latest"] == sorted([did(v2b), did(v3)])
    assert versions["forks"] == {v1_did: sorted([did(v2), did(v2b), foreign["did"]])}
    assert versions["foreign"] == [foreign["did"]]
    status, versions = await api.get(f"/v1/containers/{did(v3)}/versions")
    assert versions["latest"] == [did(v3)] and versions["descendants"] == []


async def test_referenced_by_after_importing_a_reply(api):
    original = await api.create(payload={"title": "question", "content": "?"})
    status, block = await api.get(f"/v1/containers/{original['did']}/referenced-by")
    assert status == 200 and block["links"] == [] and block["peer_did"] == api.node.identity.did
    reply = signed(BOB, payload={"title": "answer", "content": "!"}, related={"in_reply_to": original["did"]})
    assert (await api.post("/v1/containers/import", reply))[0] == 201
    reply_did = reply["hmp_container"]["head"]["container_did"]
    status, block = await api.get(f"/v1/containers/{original['did']}/referenced-by")
    assert block["links"] == [{"type": "in_reply_to", "target": reply_did}]
    assert block["signature"] and block["referenced-by_hash"].startswith("sha256:")
    _, got = await api.get(f"/v1/containers/{original['did']}")
    assert got["container"]["referenced-by"] == block


async def test_evaluations(api):
    target = await api.create(payload={"title": "judge me", "content": "c"})
    path = f"/v1/containers/{target['did']}/evaluations"
    status, block = await api.get(path)
    assert status == 200 and block["items"] == []
    # the node's own evaluation
    status, out = await api.post(path, {"type": "support", "value": 0.75})
    assert status == 201 and out["status"] == "active"
    assert out["item"]["agent_did"] == api.node.identity.did and out["item"]["target"] == target["did"]
    # another agent's signed item
    item = build_evaluation(ALICE, value=-0.5, type="oppose", target=target["did"], now=NOW)
    status, out = await api.post(path, {"item": item})
    assert (status, out) == (201, {"status": "active"})
    status, block = await api.get(path)
    assert sorted(i["agent_did"] for i in block["items"]) == sorted([api.node.identity.did, ALICE.did])
    assert block["evaluations_hash"].startswith("sha256:")
    _, got = await api.get(f"/v1/containers/{target['did']}")
    assert got["container"]["evaluations"] == block
    # an older item by the same agent is superseded
    older = build_evaluation(ALICE, value=0.1, type="comment", target=target["did"], now=NOW - timedelta(minutes=1))
    assert await api.post(path, {"item": older}) == (201, {"status": "superseded"})
    # a justification container not held yet: pending
    status, out = await api.post(path, {"type": "extend", "value": 1, "target": UNKNOWN})
    assert (status, out["status"]) == (201, "pending")
    # refused items
    forged = dict(item, value=0.9)
    status, out = await api.post(path, {"item": forged})
    assert (status, out["reason"]) == (422, "bad_signature")
    # unsigned extra members are ignored and not kept (profile section 13; 422 malformed before)
    status, out = await api.post(path, {"item": dict(item, extra=1)})
    assert status == 201 and out["status"] in ("active", "superseded"), out
    status, block = await api.get(path)
    assert all("extra" not in i for i in block["items"]) and item in block["items"]
    # an item about one container offered for another: replay
    other = await api.create(payload={"title": "other", "content": "c"})
    status, out = await api.post(f"/v1/containers/{other['did']}/evaluations",
                                 {"item": build_evaluation(ALICE, value=0.5, type="support", target=target["did"], now=NOW)})
    assert (status, out["reason"]) == (422, "replay")
    # request errors
    status, out = await api.post(path, {"type": "comment, really", "value": 0})
    assert (status, out["reason"]) == (422, "invalid_evaluation")
    for body, reason, field in (({"type": "support"}, "bad_request", "value"),
                                ({"value": 1}, "bad_request", "type"),
                                ({"type": "support", "value": 1.5}, "bad_request", "value"),
                                ({"type": "support", "value": True}, "bad_request", "value"),
                                ({"type": "", "value": 0}, "bad_request", "type"),
                                ({"type": "support", "value": 0, "target": "x"}, "bad_did", "target"),
                                ({"type": "support", "value": 0, "colour": 1}, "unknown_field", "colour"),
                                ({"item": item, "type": "support"}, "unknown_field", "type"),
                                ({"item": [1]}, "bad_request", "item")):
        status, out = await api.post(path, body)
        assert (status, out["reason"]) == (400, reason), body
        assert field in out["detail"]
    status, out = await api.post(f"/v1/containers/{UNKNOWN}/evaluations", {"type": "support", "value": 1})
    assert (status, out["reason"]) == (404, "not_found")
    status, out = await api.post(f"/v1/containers/{UNKNOWN}/evaluations", {"item": item})
    assert (status, out["reason"]) == (404, "not_found")


# -- events (SSE) ------------------------------------------------------------------------------------------------------


async def _read_event(resp: aiohttp.ClientResponse, timeout: float = 5.0) -> dict[str, str]:
    """The next event (comments skipped)."""
    fields: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), timeout)).decode()
        assert line, "stream ended"
        line = line.rstrip("\n")
        if not line:
            if fields:
                return fields
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(": ")
        fields[name] = value


async def _read_comment(resp: aiohttp.ClientResponse, timeout: float = 5.0) -> str:
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), timeout)).decode().rstrip("\n")
        if line.startswith(":"):
            return line


async def test_events_live_then_resume_with_last_event_id(make_api):
    api = await make_api(ApiLimits(event_keepalive_seconds=0.2))
    before = await api.create(payload={"title": "before", "content": "c"})
    async with api.client.get("/v1/events", headers=AUTH) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        assert await _read_comment(resp) == ": stream open"
        first = await api.create(payload={"title": "one", "content": "c"})
        second = await api.create("semantic_node", {"label": "two"})
        ev1, ev2 = await _read_event(resp), await _read_event(resp)
        assert ev1["event"] == ev2["event"] == "container"
        data1, data2 = json.loads(ev1["data"]), json.loads(ev2["data"])
        assert [data1["did"], data2["did"]] == [first["did"], second["did"]]
        assert before["did"] not in (data1["did"], data2["did"])  # stored before the stream opened
        assert data1["container"]["hmp_container"]["head"]["container_did"] == first["did"]
        # the id is an ascending cursor: GET /v1/containers?cursor=<id> continues after it
        _, page = await api.get("/v1/containers", params={"cursor": ev1["id"]})
        assert [i["did"] for i in page["items"]] == [second["did"]]
        assert await _read_comment(resp) == ": keepalive"
        status, out = await api.get("/v1/status")
        assert out["api"]["event_subscribers"] == 1
    last_id = ev2["id"]
    third = await api.create(payload={"title": "three", "content": "c"})
    fourth = await api.create(payload={"title": "four", "content": "c"})
    async with api.client.get("/v1/events", headers={**AUTH, "Last-Event-ID": last_id}) as resp:
        got = [json.loads((await _read_event(resp))["data"])["did"] for _ in range(2)]
        assert got == [third["did"], fourth["did"]]
    # the cursor query parameter works the same; Last-Event-ID wins over it
    async with api.client.get("/v1/events", params={"cursor": ev1["id"]},
                              headers={**AUTH, "Last-Event-ID": ev2["id"]}) as resp:
        assert json.loads((await _read_event(resp))["data"])["did"] == third["did"]
    async with api.client.get("/v1/events", params={"cursor": ev1["id"]}, headers=AUTH) as resp:
        assert json.loads((await _read_event(resp))["data"])["did"] == second["did"]


async def test_events_filters(api):
    async with api.client.get("/v1/events", params={"class": "semantic_node", "tag": "x"}, headers=AUTH) as by_class, \
            api.client.get("/v1/events", params={"to_me": "true"}, headers=AUTH) as to_me, \
            api.client.get("/v1/events", params={"sender": ALICE.did}, headers=AUTH) as from_alice:
        await api.create(payload={"title": "noise", "content": "c"}, tags=["x"])
        node_did = api.node.identity.did
        wanted = await api.create("semantic_node", {"label": "yes"}, tags=["x"])
        to_node = signed(ALICE, payload={"title": "hi node", "content": "c"}, recipients=[node_did])
        await api.post("/v1/containers/import", to_node)
        assert json.loads((await _read_event(by_class))["data"])["did"] == wanted["did"]
        to_node_did = to_node["hmp_container"]["head"]["container_did"]
        assert json.loads((await _read_event(to_me))["data"])["did"] == to_node_did
        assert json.loads((await _read_event(from_alice))["data"])["did"] == to_node_did
    for params, headers, reason in (({"to_me": "maybe"}, {}, "bad_request"), ({"sender": "x"}, {}, "bad_did"),
                                    ({"cursor": "nope"}, {}, "bad_cursor"), ({}, {"Last-Event-ID": "nope"}, "bad_cursor"),
                                    ({"limit": "3"}, {}, "unknown_field")):
        status, out = await api.get("/v1/events", params=params, headers=headers)
        assert (status, out["reason"]) == (400, reason), params
    # a descending list cursor is not an event id
    await api.create(payload={"title": "a", "content": "c"})
    await api.create(payload={"title": "b", "content": "c"})
    _, page = await api.get("/v1/containers", params={"order": "desc", "limit": "1"})
    status, out = await api.get("/v1/events", params={"cursor": page["next_cursor"]})
    assert (status, out["reason"]) == (400, "bad_cursor")


async def test_events_subscriber_limit_and_slot_release(tmp_path):
    """Served the way the daemon serves it (AppRunner: handlers are not cancelled on
    disconnect), a client that goes away must still free its slot."""
    node = Node(Identity(NODE_SEED), tmp_path, synchronous="normal")
    await node.start()
    runner = web.AppRunner(create_app(node, token=TOKEN, limits=ApiLimits(max_event_subscribers=2)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    try:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            first = await session.get(f"{base}/v1/events")
            second = await session.get(f"{base}/v1/events")
            assert first.status == second.status == 200
            async with session.get(f"{base}/v1/events") as third:
                assert third.status == 503
                assert (await third.json())["reason"] == "too_many_subscribers"
            async with session.get(f"{base}/metrics") as resp:
                assert "hmpnode_event_subscribers 2\n" in await resp.text()
            first.close()  # the client disconnects
            for _ in range(300):  # 30 s at most
                async with session.get(f"{base}/v1/status") as resp:
                    if (await resp.json())["api"]["event_subscribers"] == 1:
                        break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the disconnected subscriber kept its slot")
            async with session.get(f"{base}/v1/events") as again:
                assert again.status == 200
            second.close()
            for _ in range(300):
                if node.subscribers == 0:
                    break
                await asyncio.sleep(0.1)
            assert node.subscribers == 0
    finally:
        await runner.cleanup()
        await node.stop()


# -- metrics ---------------------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')


def parse_metrics(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """A strict little reader of the Prometheus text format 0.0.4."""
    types, samples = {}, {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, line
        name, _, labels, value = match.groups()
        pairs = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or family in types, f"sample before its TYPE: {line}"
        key = (name, pairs)
        assert key not in samples, f"duplicate sample {line}"
        samples[key] = float(value)
    return types, samples


async def test_metrics(api):
    async def scrape():
        status, text = await api.get("/metrics")
        assert status == 200
        return parse_metrics(text)

    types, before = await scrape()
    assert types["hmpnode_containers_stored"] == "gauge"
    assert types["hmpnode_ingest_total"] == "counter"
    assert types["hmpnode_rejected_total"] == "counter"
    assert types["hmpnode_ingest_rate_per_second"] == "gauge"
    assert types["hmpnode_api_request_duration_seconds"] == "histogram"
    assert types["hmpnode_event_subscribers"] == "gauge"
    assert before[("hmpnode_containers_stored", frozenset())] == 0
    assert before[("hmpnode_ingest_total", frozenset({("status", "stored")}))] == 0
    assert before[("hmpnode_rejected_total", frozenset({("reason", "bad_signature")}))] == 0

    for i in range(3):
        await api.create(payload={"title": str(i), "content": "c"})
    bad = copy.deepcopy(signed(ALICE))
    bad["hmp_container"]["payload"]["content"] = "changed"
    await api.post("/v1/containers/import", {"containers": [bad, bad, signed(ALICE)]})
    _, after = await scrape()
    assert after[("hmpnode_containers_stored", frozenset())] == 4
    assert after[("hmpnode_ingest_total", frozenset({("status", "stored")}))] == 4
    assert after[("hmpnode_ingest_total", frozenset({("status", "rejected")}))] == 2
    assert after[("hmpnode_rejected_total", frozenset({("reason", "payload_hash_mismatch")}))] == 2
    assert after[("hmpnode_ingest_rate_per_second", frozenset())] > 0
    assert after[("hmpnode_event_subscribers", frozenset())] == 0
    # the held container sent again: answered from the store, not verified again
    verified = after[("hmpnode_ingest_verified_total", frozenset())]
    await api.post("/v1/containers/import", {"containers": [signed(ALICE)]})
    _, resent = await scrape()
    assert resent[("hmpnode_ingest_duplicate_unverified_total", frozenset())] == 1
    assert resent[("hmpnode_ingest_verified_total", frozenset())] == verified
    route = frozenset({("route", "/v1/containers"), ("method", "POST")})
    assert after[("hmpnode_api_request_duration_seconds_count", route)] == 3
    assert after[("hmpnode_api_request_duration_seconds_bucket", route | {("le", "+Inf")})] == 3
    assert after[("hmpnode_api_request_duration_seconds_sum", route)] > 0
    # unknown paths share one label value; no raw path ever becomes a label
    await api.get("/some/random/path")
    _, again = await scrape()
    assert again[("hmpnode_api_request_duration_seconds_count",
                  frozenset({("route", "unmatched"), ("method", "GET")}))] == 1
    assert not any(("route", "/some/random/path") in labels for _, labels in again)
    assert ("hmpnode_api_request_duration_seconds_count",
            frozenset({("route", "/metrics"), ("method", "GET")})) in again


async def test_refusals_are_counted_by_area_and_reason(api):
    types, before = await _scrape(api)
    assert types["hmpnode_refused_total"] == "counter"
    assert not any(name == "hmpnode_refused_total" for name, _ in before)
    api.node.refuse("peer", "per_address_cap", 2)
    api.node.refuse("dht", "future_timestamp")
    _, after = await _scrape(api)
    assert after[("hmpnode_refused_total", frozenset({("area", "peer"), ("reason", "per_address_cap")}))] == 2
    assert after[("hmpnode_refused_total", frozenset({("area", "dht"), ("reason", "future_timestamp")}))] == 1
    status, body = await api.get("/v1/status")
    assert status == 200 and body["refused"] == {"dht:future_timestamp": 1, "peer:per_address_cap": 2}


async def _scrape(api):
    status, text = await api.get("/metrics")
    assert status == 200
    return parse_metrics(text)


def test_rate_window_is_stored_per_second_over_the_window():
    from hmpnode.api.metrics import RateWindow

    now, count = [0.0], [0]
    window = RateWindow(lambda: count[0], window=10.0, clock=lambda: now[0])
    assert window.rate() == 0.0
    for _ in range(30):  # 5 per second for 30 s
        now[0] += 1.0
        count[0] += 5
        window.sample()
    assert window.rate() == pytest.approx(5.0)
    now[0] += 5.0  # idle for 5 s: half the window
    assert window.rate() == pytest.approx(2.5, rel=0.05)
    now[0] += 20.0
    assert window.rate() == 0.0


async def test_storage_that_is_gone_answers_503_not_500(api):
    """A store that cannot take work (here: closed, as during shutdown) is a 503 the
    client may retry, with nothing acknowledged; never a 500."""
    await api.node.db.close()
    status, body = await api.post("/v1/containers/import", signed(Identity(bytes([77]) * 32)))
    assert (status, body["reason"]) == (503, "storage_unavailable")
    status, body = await api.get("/v1/containers")
    assert (status, body["reason"]) == (503, "storage_unavailable")


async def test_peers_and_dht_routes_without_a_mesh(api):
    """A node run without its mesh (as here) has no peers and no DHT: stable answers, no 5xx."""
    assert await api.get("/v1/peers") == (200, {"peers": [], "mesh": None})
    did = "did:hmp:agent:" + "1" * 20
    for path in (f"/v1/dht/peers/{did}", f"/v1/dht/providers/{did}", "/v1/dht/topics/physics"):
        status, body = await api.get(path)
        assert (status, body["reason"]) == (409, "dht_disabled"), path
    assert (await api.get("/v1/dht/peers/not-a-did"))[0] == 400


async def test_search_and_recall_routes(api):
    for i, text in enumerate(["the staging database listens on port 6543", "garden notes", "harbor log"]):
        await api.create("note", {"text": text}, tags=["ops"] if i == 0 else [])
    status, found = await api.get("/v1/search", params={"q": "database port", "tag": "ops"})
    assert status == 200 and len(found["items"]) == 1 and found["items"][0]["state"] == "active"
    assert (await api.get("/v1/search", params={"q": "x", "state": "bogus"}))[0] == 400
    assert (await api.get("/v1/search"))[0] == 400
    body = {"query": "which port does the database use", "max_tokens": 2000, "max_bytes": 4000}
    status, env = await api.post("/v1/recall", body)
    assert status == 200 and env["items"][0]["p"] == {"text": "the staging database listens on port 6543"}
    assert env["used"][1] <= 4000 and "why" not in env
    status, full = await api.post("/v1/recall", {**body, "why": True})  # the full receipt on request
    assert status == 200 and full["tokenizer"] == "hmpnode-approx-v1" and full["why"][0]["id"] == env["items"][0]["id"]
    assert (await api.post("/v1/recall", {**body, "why": "yes"}))[0] == 400
    status, plan = await api.post("/v1/recall/plan", body)
    assert status == 200 and "6543" not in orjson.dumps(plan).decode()
    status, resolved = await api.post("/v1/recall/resolve", {"plan": plan["plan"]})
    assert status == 200 and resolved == env
    # superseded after planning: the plan is stale, no content comes back
    first = full["why"][0]["did"]
    await api.create("note", {"text": "the staging database listens on port 7777 now"},
                     related={"previous_version": first})
    status, stale = await api.post("/v1/recall/resolve", {"plan": plan["plan"]})
    assert (status, stale["reason"]) == (409, "stale_plan") and "payload" not in stale
    assert (await api.post("/v1/recall/resolve", {"plan": "nope"}))[0] == 400
    assert (await api.post("/v1/recall", {**body, "max_tokens": 0}))[0] == 400
    assert (await api.post("/v1/recall", {**body, "extra": 1}))[0] == 400
    # a budget below an empty answer: an abstain that says what would do, not an error (issue 12)
    status, small = await api.post("/v1/recall", {**body, "max_tokens": 3, "max_bytes": 3})
    assert status == 200 and small["items"] == [] and small["abstain"] == "budget_too_small"
    need_tokens, need_bytes = small["need"]
    status, fits = await api.post("/v1/recall", {**body, "max_tokens": need_tokens, "max_bytes": need_bytes})
    assert status == 200 and fits["items"] == [] and fits["used"] == [need_tokens, need_bytes]


async def test_journal_routes(api):
    status, first = await api.post("/v1/journal", {"text": "started the node"})
    assert status == 201 and first["journal_seq"] == 1
    status, second = await api.post("/v1/journal", {"text": "found a peer on the LAN", "tags": ["mesh"]})
    assert status == 201 and second["journal_seq"] == 2
    status, report = await api.get("/v1/journal/verify")
    assert status == 200 and report["ok"] and report["count"] == 2
    status, loaded = await api.get("/v1/journal/load", params={"max_tokens": "10000"})
    assert status == 200 and [e["journal_seq"] for e in loaded["entries"]] == [1, 2]
    assert (await api.get("/v1/journal/load"))[0] == 400
    assert (await api.post("/v1/journal", {"text": "x", "tags": ["journal_seq:9"]}))[0] == 422
    assert (await api.post("/v1/journal/anchor", {"date": "yesterday"}))[0] == 400
    assert (await api.post("/v1/journal/anchor", {"date": "2099-01-01"}))[0] == 422
