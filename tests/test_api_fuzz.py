"""Property-based fuzzing of the agent API against its own OpenAPI document (schemathesis).

Every operation in hmpnode/api/openapi.json is driven with generated requests,
valid and invalid ("all" generation modes), against a real Node behind a real
aiohttp server on 127.0.0.1 (run on its own event loop in a thread, because
schemathesis' transport is synchronous). Properties:

* no answer is ever a 5xx;
* every 4xx is JSON with a string `reason` and a string `detail`;
* every answer conforms to the document (documented status code, content
  type, response schema), so the document cannot drift from the code.

Bounded: at most 25 examples per operation and mode; the file runs in well under a minute.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402  (a schemathesis dependency)
from aiohttp.test_utils import TestServer  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import given as given_  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from hmpnode.api import SERVER_OPTIONS, ApiLimits, create_app  # noqa: E402
from hmpnode.api.app import OPENAPI_PATH  # noqa: E402
from hmpnode.config import Settings  # noqa: E402
from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.node import Node  # noqa: E402
from tests.conftest import NOW  # noqa: E402

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: per operation and test; raise it for a long one-off run: HMPNODE_TEST_API_FUZZ_EXAMPLES=2000 pytest tests/test_api_fuzz.py
MAX_EXAMPLES = int(os.environ.get("HMPNODE_TEST_API_FUZZ_EXAMPLES", "25"))

CONFIG = schemathesis.Config.from_dict({
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True},
    "headers": AUTH,
})
SCHEMA = schemathesis.openapi.from_dict(json.loads(OPENAPI_PATH.read_text()), config=CONFIG)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class _Server:
    """A Node and the API on a private event loop in a daemon thread."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="api-fuzz-server", daemon=True)
        self.seeded: list[str] = []

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> str:
        self.thread.start()
        return self.run(self._start())

    async def _start(self) -> str:
        self.node = Node(Identity(bytes([7]) * 32), self.data_dir, clock=lambda: NOW, synchronous="off")
        await self.node.start()
        limits = ApiLimits(max_body_bytes=256 * 1024, event_keepalive_seconds=0.2)
        config = {"data_dir": str(self.data_dir), "settings": Settings(data_dir=self.data_dir).shown({})}
        self.server = TestServer(create_app(self.node, token=TOKEN, limits=limits, config=config), host="127.0.0.1")
        await self.server.start_server(**SERVER_OPTIONS)  # as the daemon serves it
        # something to find: the node's own container, a reply by another agent, an evaluation
        _, own = await self.node.create("diary_entry", {"title": "seed", "content": "fuzz"}, tags=["seed"])
        did = own["hmp_container"]["head"]["container_did"]
        reply = build_container(Identity(bytes([1]) * 32), "semantic_node", {"label": "reply"}, now=NOW,
                                related={"in_reply_to": did})
        await self.node.ingest([reply])
        await self.node.evaluate(did, type_="support", value=0.5)
        self.seeded = [did, reply["hmp_container"]["head"]["container_did"]]
        return str(self.server.make_url("")).rstrip("/")

    def stop(self) -> None:
        async def _stop():
            await self.server.close()
            await self.node.stop()

        try:
            self.run(_stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _Server(tmp_path_factory.mktemp("api-fuzz"))
    srv.base_url = srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def _content_type(response) -> str:
    value = response.headers.get("content-type") or response.headers.get("Content-Type") or ""
    return value[0] if isinstance(value, list) else value


#: aiohttp's HTTP parser refuses a request line or header longer than this before any
#: application code runs (400, text/plain); the daemon can raise it (AppRunner max_line_size).
HTTP_LINE_LIMIT = 8190


def _protocol_level_refusal(response) -> bool:
    request = response.request
    too_long = len(request.path_url) + len(request.method) + len(" HTTP/1.1 ") > HTTP_LINE_LIMIT or any(
        len(k) + len(v) + 2 > HTTP_LINE_LIMIT for k, v in request.headers.items()
    )
    return too_long and response.status_code == 400 and response.text.startswith("Got more than")


def _check_error_shape(response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if 400 <= response.status_code < 500 and not _protocol_level_refusal(response):
        assert _content_type(response).startswith("application/json"), (response.status_code, response.text[:300])
        body = response.json()
        assert isinstance(body, dict), body
        assert isinstance(body.get("reason"), str) and body["reason"], body
        assert isinstance(body.get("detail"), str), body


def _use_seeded(case, server, pick) -> None:
    """Sometimes aim at a container the node holds, so reads succeed and writes reach the node."""
    if pick is not None and case.path_parameters and "did" in case.path_parameters:
        case.path_parameters["did"] = server.seeded[pick % len(server.seeded)]


@SCHEMA.exclude(path="/v1/events").parametrize()
@SCHEMA.given(pick=st.none() | st.integers(0, 3))
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck), database=None)
def test_api_operation(case, pick, server, session):
    _use_seeded(case, server, pick)
    response = case.call(base_url=server.base_url, session=session, timeout=10)
    _check_error_shape(response)
    if not _protocol_level_refusal(response):
        case.validate_response(response, checks=CHECKS)


@SCHEMA.include(path="/v1/events").parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck), database=None)
def test_event_stream_operation(case, server, session):
    """The stream never ends: send the request with requests itself (stream=True), check
    the status and headers, read the body only when it is an error, then hang up."""
    kwargs = case.as_transport_kwargs(base_url=server.base_url)
    response = session.request(**kwargs, stream=True, timeout=10)
    try:
        if response.status_code == 200:
            assert response.headers["Content-Type"].startswith("text/event-stream")
        else:
            response.content  # noqa: B018 - read the error body
            _check_error_shape(response)
            if not _protocol_level_refusal(response):
                case.validate_response(response, checks=CHECKS)
    finally:
        response.close()


# -- beyond the document: hostile bodies, media types and query strings ---------------------------------
#
# schemathesis generates from the document's schemas; these drive the same server with
# values the document does not describe at all: arbitrary JSON where the fields are known,
# raw bytes, other media types, and query strings made of the known names with junk values.

_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=12)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=12)
_dids = st.sampled_from(["did:hmp:agent:x", "did:a:b", "did:", "did:x:" + "y" * 600, "not a did", ""]) | st.text(max_size=20)


def _known_fields(names, values=_json):
    return st.fixed_dictionaries({}, optional={name: values for name in names})


_create_bodies = _known_fields(
    ["class", "payload", "subclass", "tags", "ttl", "related", "recipients", "encrypt_for", "compression", "network",
     "broadcast", "meta", "confidence"],
    _json | _dids | st.sampled_from(["diary_entry", "goal", "30m", "7d", "2026-11-29T10:15:00Z", "zstd", "lan:10.0.0.0/8"])
    | st.lists(st.fixed_dictionaries({}, optional={"public_key": st.text(max_size=50) | _json, "did": _dids}), max_size=2),
)
_head = _known_fields(["version", "class", "container_did", "sender_did", "timestamp", "payload_hash", "sig_algo",
                       "signature", "payload_type", "public_key", "recipient", "group_recipient", "ttl", "tags"],
                      _json | _dids)
_container = st.fixed_dictionaries({"head": _head, "payload": _json}, optional={"related": _json, "meta": _json})
_VALID = build_container(Identity(bytes([2]) * 32), "diary_entry", {"title": "valid", "content": "c"}, now=NOW)
_VALID_DID = _VALID["hmp_container"]["head"]["container_did"]
# A verified container carrying hostile blocks outside its signature: evaluations and
# referenced-by reports are processed (inside the store's write transaction) for
# every container that passes verification, stored or duplicate.
_item = _known_fields(["value", "type", "target", "timestamp", "agent_did", "public_key", "sig_algo", "signature"],
                      _json | _dids | st.just(_VALID_DID) | st.just("2026-11-29T10:15:00Z") | st.just("ed25519"))
_blocks = st.fixed_dictionaries({}, optional={
    "evaluations": _json | _known_fields(["items", "evaluations_hash"], _json | st.lists(_item | _json, max_size=3)),
    "referenced-by": _json | _known_fields(
        ["links", "peer_did", "public_key", "sig_algo", "signature", "referenced-by_hash"],
        _json | _dids | st.lists(_known_fields(["type", "target"], _json | _dids), max_size=3)),
})
_valid_with_blocks = st.builds(lambda blocks: {**_VALID, **blocks}, _blocks)
_import_bodies = (st.builds(lambda c: {"hmp_container": c}, _container) | _container | _valid_with_blocks
                  | st.builds(lambda cs: {"containers": cs}, st.lists(_container | _json | _valid_with_blocks, max_size=4))
                  | _json)
_evaluation_bodies = _known_fields(["type", "value", "target", "item"], _json | _dids
                                   | st.sampled_from(["support", "oppose, no", 0.5, -1, 1.0000001]))
_media_types = st.sampled_from(["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
                                "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""])
_fuzz_settings = settings(max_examples=MAX_EXAMPLES + 5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                          database=None)


def _post(server, session, path, body, media_type="application/json", content_encoding=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = dict(AUTH)
    if media_type:
        headers["Content-Type"] = media_type
    if content_encoding:
        headers["Content-Encoding"] = content_encoding
    response = session.post(f"{server.base_url}{path}", data=data, headers=headers, timeout=10)
    _check_error_shape(response)
    return response


@_fuzz_settings
@given_(body=_create_bodies)
def test_create_with_hostile_fields(server, session, body):
    _post(server, session, "/v1/containers", body)


@_fuzz_settings
@given_(body=_import_bodies)
def test_import_with_hostile_containers(server, session, body):
    _post(server, session, "/v1/containers/import", body)


@_fuzz_settings
@given_(body=_evaluation_bodies, pick=st.integers(0, 1))
def test_evaluate_with_hostile_fields(server, session, body, pick):
    _post(server, session, f"/v1/containers/{server.seeded[pick]}/evaluations", body)


@_fuzz_settings
@given_(path=st.sampled_from(["/v1/containers", "/v1/containers/import", "/v1/containers/did:a:b/evaluations"]),
        raw=st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()), media_type=_media_types,
        content_encoding=st.sampled_from([None, None, "gzip", "deflate", "br", "identity", "x-unknown"]))
def test_post_raw_bytes_and_media_types(server, session, path, raw, media_type, content_encoding):
    _post(server, session, path, raw, media_type, content_encoding)


_query_names = st.sampled_from(["class", "tag", "sender", "recipient", "related", "since", "until", "expired", "order",
                                "limit", "cursor", "decrypt", "to_me", "x", ""])
_query_values = st.text(max_size=16) | _dids | st.sampled_from(["true", "any", "desc", "0", "1001", "2026-11-29T10:15:00Z"])


@_fuzz_settings
@given_(path=st.sampled_from(["/v1/containers", "/v1/containers/did:a:b", "/v1/events", "/v1/status", "/metrics"]),
        query=st.lists(st.tuples(_query_names, _query_values), max_size=4),
        last_event_id=st.none() | st.from_regex(r"[!-~]([ -~]{0,28}[!-~])?", fullmatch=True))
def test_get_with_junk_query_strings(server, session, path, query, last_event_id):
    headers = dict(AUTH)
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    response = session.get(f"{server.base_url}{path}", params=query, headers=headers, stream=True, timeout=10)
    try:
        if response.status_code != 200 or path != "/v1/events":
            response.content  # noqa: B018
            _check_error_shape(response)
    finally:
        response.close()


def test_no_stream_slot_leaks_after_fuzzing(server, session):
    """Every fuzzed stream was hung up on; all of them must have freed their slot."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = session.get(f"{server.base_url}/v1/status", headers=AUTH, timeout=10).json()
        if status["api"]["event_subscribers"] == 0 and server.node.subscribers == 0:
            return
        time.sleep(0.1)
    pytest.fail(f"event subscribers left open: {status['api']['event_subscribers']}")
