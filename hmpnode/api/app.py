"""The local agent API: JSON over HTTP (aiohttp), bearer token on every route
(but the dashboard's static files, hmpnode.api.dashboard).

`create_app(node, token=..., limits=...)` returns the aiohttp application; the
daemon binds it (127.0.0.1 by default). The routes, their parameters and every
answer are described by `openapi.json` beside this file, served at
`GET /v1/openapi.json`.

Errors are always JSON: `{"reason": <stable code>, "detail": <text>}`. Inputs
are checked here so that malformed requests get a 4xx naming the field; the
middleware's catch-all (reason `internal`, 500) exists for genuine bugs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import sqlite3
import time
from datetime import date, datetime
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import orjson
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from hmpnode import __version__
from hmpnode import consensus as cons
from hmpnode.api import dashboard as dashboard_files
from hmpnode.api import validate as V
from hmpnode.api.cursor import CursorCodec
from hmpnode.api.errors import HTTP_REASONS, ApiError, error_response, json_response
from hmpnode.api.history import History, Sample
from hmpnode.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hmpnode.api.metrics import METHODS, Histogram, RateWindow, render
from hmpnode.container.build import Recipient
from hmpnode.container.encoding import EncodingError, format_time
from hmpnode.memory.index import STATES
from hmpnode.store.records import to_us
from hmpnode.store.search import SearchQuery
from hmpnode.identity import agent_did_for_key, ed25519_pk_to_x25519, public_key_from_b58
from hmpnode.logs import LEVELS as LOG_LEVELS
from hmpnode.logs import current_level, set_level
from hmpnode.node import IngestResult, Keep, Node, NodeError, in_slices
from hmpnode.net import views as mesh_views
from hmpnode.net.addresses import StaticError
from hmpnode.net.interests import ChangedTooOften, InterestError, Interests
from hmpnode.store import DatabaseClosed, StorageFull
from hmpnode.store.records import ListQuery

__all__ = ["ApiLimits", "create_app", "ROUTES", "OPENAPI_PATH"]

log = logging.getLogger("hmpnode.api")

OPENAPI_PATH = Path(__file__).with_name("openapi.json")


@dataclass(frozen=True, slots=True)
class ApiLimits:
    """Bounds of the API ([api] settings; the daemon maps them onto this)."""

    max_body_bytes: int = 8 * 1024 * 1024
    #: containers per import request
    max_batch: int = 1000
    max_list_limit: int = 1000
    default_list_limit: int = 100
    max_event_subscribers: int = 64
    #: stored items buffered per event subscriber before the stream waits for the client
    event_queue_size: int = 10_000
    #: seconds between `: keepalive` comments on an idle event stream
    event_keepalive_seconds: float = 15.0
    #: decompressed bytes of all containers of one import request (over: over_budget)
    max_import_decompressed_bytes: int = 64 * 1024 * 1024
    #: bytes of events waiting for one event-stream client / for all of them: a client
    #: that lets more pile up is cut off (reason too_slow) instead of growing memory
    event_queue_bytes: int = 4 * 1024 * 1024
    event_queue_total_bytes: int = 64 * 1024 * 1024
    #: milliseconds between two points of the history (GET /v1/history; hmpnode.api.history)
    history_interval_ms: int = 5000


@dataclass(slots=True)
class _State:
    node: Node
    token: bytes
    limits: ApiLimits
    cursors: CursorCodec
    openapi: bytes
    histogram: Histogram
    rate: RateWindow
    #: the last hour of the node's numbers (GET /v1/history)
    history: History
    subscribers: int = 0
    streams: set[asyncio.Event] | None = None
    #: bytes of events waiting in every event stream's queue
    event_bytes: int = 0
    #: the API is shutting down (/healthz answers 503)
    stopping: bool = False
    #: `GET /v1/config`: the settings the node started with and their sources (`Settings.shown`)
    config: Mapping[str, Any] | None = None
    #: asks the daemon to shut down (POST /v1/shutdown); None: an app without one (tests)
    stop: Callable[[str], None] | None = None


STATE = web.AppKey("hmpnode_api_state", _State)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- helpers ---------------------------------------------------------------------------


def _state(request: web.Request) -> _State:
    return request.app[STATE]


async def _json_body(request: web.Request) -> tuple[bytes, Any]:
    """(raw bytes, parsed value) of a JSON request body; 415 / 413 / 400 bad_json otherwise."""
    raw = await _body_bytes(request)
    return raw, _parsed(raw)


def _parsed(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "bad_json", f"the body is not valid JSON: {exc}"[:300]) from None


async def _body_bytes(request: web.Request) -> bytes:
    """The bytes of a JSON request body, not empty; 415 / 413 / 400 otherwise."""
    limits = _state(request).limits
    content_type = request.content_type.lower()
    if content_type != "application/json":
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Type must be application/json, not {content_type[:100]!r}")
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Encoding {encoding[:40]!r} is not accepted; send the JSON uncompressed",
                       close_connection=True)
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"the body may have at most {limits.max_body_bytes} bytes",
                       close_connection=True)
    try:
        raw = await request.read()
    except (RequestPayloadError, HttpProcessingError) as exc:  # bad chunking, a broken gzip/deflate stream
        # The rest of the body is unreadable: end it here (aiohttp would otherwise try to
        # drain it after the answer, hit the error again and drop the connection) and
        # close the connection once the answer is sent.
        request.content.feed_eof()
        cause = exc.__cause__ or exc
        raise ApiError(400, "bad_request", f"body: cannot be read ({type(cause).__name__})",
                       close_connection=True) from None
    if not raw:
        raise ApiError(400, "bad_json", "the body is empty; a JSON document is required")
    return raw


def _node_refusal(exc: NodeError) -> ApiError:
    """A NodeError from create/evaluate: not_found stays 404, gone 410; a refusal of the content is 422."""
    status = {"not_found": 404, "gone": 410}.get(exc.reason, 422)
    return ApiError(status, exc.reason, exc.detail)


# -- meta routes -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return json_response({"ok": True})


# -- running the node: shutdown, log level ------------------------------------------------


async def shutdown(request: web.Request) -> web.Response:
    """Stop the node cleanly, as SIGTERM does; answered (202) before it stops. `hmpnode
    stop` sends it, then waits for the data dir's lock to be let go. An optional body
    {"reason"} says who asked, in the node's log."""
    V.query_params(request, ())
    why = "POST /v1/shutdown"
    if request.can_read_body:
        _, body = await _json_body(request)
        V.no_unknown(V.obj(body, "body"), ("reason",))
        if "reason" in body:
            why += ": " + V.text(body["reason"], "reason", max_len=200)
    stop = _state(request).stop
    if stop is None:
        raise ApiError(409, "shutdown_unavailable", "this API is not run by a node daemon that can stop")
    stop(why)
    return json_response({"stopping": True, "pid": os.getpid()}, status=202)


async def get_log_level(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return json_response({"level": current_level(), "levels": list(LOG_LEVELS)})


async def put_log_level(request: web.Request) -> web.Response:
    """Log at {"level"} from now on, until SIGHUP or a restart (nothing is written to the
    settings); 400 bad_log_level for a name not in LOG_LEVELS."""
    V.query_params(request, ())
    _, body = await _json_body(request)
    V.no_unknown(V.obj(body, "body"), ("level",))
    V.require(body, "level")
    level = body["level"]
    if level not in LOG_LEVELS:
        raise ApiError(400, "bad_log_level", f"level: {str(level)[:40]!r} is not one of {', '.join(LOG_LEVELS)}")
    previous = set_level(level)
    if previous != level:
        log.warning("log level %s (was %s; set over the API until SIGHUP or a restart)", level, previous)
    return json_response({"level": level, "previous": previous, "levels": list(LOG_LEVELS)})


#: routes served without the token: a probe for service managers and load balancers
PUBLIC_ROUTES = frozenset({"/healthz"})


async def healthz(request: web.Request) -> web.Response:
    """Liveness and readiness without the token, so it says nothing else (no version,
    no DID, no counts): 200 {"status": "ok"} while the node takes requests, 503
    {"status": "unavailable"} (with the API's reason and detail, saying no more)
    while it shuts down or its disk is full."""
    state = _state(request)
    db = state.node.db
    if state.stopping or db.closed or db.full:
        return error_response(503, "unavailable", "not ready", extra={"status": "unavailable"},
                              headers={"Retry-After": "5"})
    return json_response({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return web.Response(body=_state(request).openapi, content_type="application/json")


async def get_config(request: web.Request) -> web.Response:
    """The settings in force, each with where it came from (default, file, environment,
    flag), secrets masked: what `hmpnode config show` prints for the same data dir."""
    V.query_params(request, ())
    config = _state(request).config
    if config is None:
        raise ApiError(404, "not_configured", "this API was built without the node's settings")
    return json_response(config)


async def status(request: web.Request) -> web.Response:
    V.query_params(request, ())
    state = _state(request)
    out = await state.node.status()
    mesh = getattr(state.node, "mesh", None)
    if mesh is not None:
        out["mesh"] = await mesh_views.status(mesh)
    out["api"] = {
        "version": __version__,
        "limits": asdict(state.limits),
        "event_subscribers": state.subscribers,
        "ingest_rate_per_second": round(state.rate.rate(), 6),
    }
    return json_response(out)


async def peers(request: web.Request) -> web.Response:
    V.query_params(request, ())
    mesh = getattr(_state(request).node, "mesh", None)
    return json_response({"peers": mesh_views.peers_view(mesh) if mesh is not None else [],
                          "mesh": await mesh_views.status(mesh) if mesh is not None else None})


async def peer_index(request: web.Request) -> web.Response:
    """One page of a connected peer's container index (docs/protocol.md 31): what it may
    send us that matches the filters, without fetching anything."""
    did = V.path_did(request)
    params = V.query_params(request, ("class", "subclass", "tag", "sender", "related", "relation", "since", "until",
                                      "cursor", "limit"))
    selection = {"class": V.query_text(params, "class", 128), "subclass": V.query_text(params, "subclass", 128),
                 "tags": [params["tag"]] if V.query_text(params, "tag", 256) else None,
                 "sender_did": V.query_did(params, "sender"), "related_to": V.query_did(params, "related"),
                 "relation": V.query_text(params, "relation", 128)}
    for name, field in (("since", "timestamp_begin"), ("until", "timestamp_end")):
        moment = V.query_time(params, name)
        selection[field] = format_time(moment) if moment is not None else None
    selection = {k: v for k, v in selection.items() if v is not None}
    cursor = params.get("cursor")
    if cursor is not None and not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):
        raise V.bad_request("cursor", "must be the cursor a previous page gave")
    mesh = getattr(_state(request).node, "mesh", None)
    if mesh is None or did not in mesh.sessions or mesh.sessions[did].closed:
        raise ApiError(404, "peer_not_connected", f"{did} is not a connected peer")
    answers = await mesh.queries.query_index([selection] if selection else [], to=[did], after=cursor,
                                      limit=V.query_int(params, "limit", mesh.settings.session.index_page, 1,
                                                        mesh.settings.session.index_page))
    if not answers:  # the connection ended meanwhile
        raise ApiError(404, "peer_not_connected", f"{did} is not a connected peer")
    [answer] = answers
    return json_response({"peer": did, "entries": answer.entries, "status": answer.status,
                          "complete": answer.complete, "cursor": answer.cursor, "reason": answer.reason})


async def mesh_queues(request: web.Request) -> web.Response:
    params = V.query_params(request, ("limit",))
    state = _state(request)
    limit = V.query_int(params, "limit", min(state.limits.default_list_limit, state.limits.max_list_limit), 1,
                        state.limits.max_list_limit)
    mesh = getattr(state.node, "mesh", None)
    return json_response(await mesh_views.queues(mesh, limit) if mesh is not None else {"outbox": [], "relay": []})


def _dht(request: web.Request):
    mesh = getattr(_state(request).node, "mesh", None)
    if mesh is None or mesh.dht is None:
        raise ApiError(409, "dht_disabled", "this node runs no DHT (peer.dht = false)")
    return mesh.dht


async def dht_peer(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    started = time.perf_counter()
    record = await _dht(request).find_peer(did)
    elapsed_ms = round((time.perf_counter() - started) * 1000, 3)
    if record is None:
        raise ApiError(404, "not_found", f"no valid DHT peer record for {did}")
    return json_response({
        "did": record.did, "addresses": list(record.addresses), "roles": list(record.roles),
        "mailman": list(record.mailman), "timestamp": format_time(record.timestamp),
        "expires": format_time(record.expires), "elapsed_ms": elapsed_ms,
    })


async def dht_providers(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    return json_response({"container_did": did, "providers": await _dht(request).find_providers(did)})


async def dht_topic(request: web.Request) -> web.Response:
    topic = request.match_info.get("topic", "")
    V.query_params(request, ())
    if not 0 < len(topic) <= 128 or not topic.isprintable():
        raise ApiError(400, "bad_topic", "topic: 1..128 printable characters")
    return json_response({"topic": topic, "members": await _dht(request).find_topic(topic)})


# -- interests (hmpnode.net.interests, docs/protocol.md 33) ------------------------------------


def _mesh(request: web.Request):
    mesh = getattr(_state(request).node, "mesh", None)
    if mesh is None:
        raise ApiError(409, "mesh_disabled", "this node runs no mesh: it has no peers")
    return mesh


def _interests_view(mesh) -> dict[str, Any]:
    wants = mesh.wants
    return {"interests": wants.current.to_dict(), "everything": wants.current.everything,
            # the API's declaration is saved in the data dir and outlives a restart, until reset
            "source": wants.source}


async def get_interests(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return json_response(_interests_view(_mesh(request)))


async def _declare(request: web.Request, new: Any) -> web.Response:
    mesh = _mesh(request)
    try:
        await mesh.wants.set(new)
    except ChangedTooOften as exc:
        _state(request).node.refuse("api", "interests_rate_limited")
        raise ApiError(429, "rate_limited", str(exc), headers={"Retry-After": "20"}) from None
    except OSError as exc:  # <data_dir>/interests.json: nothing changed
        raise ApiError(503, "storage_unavailable", f"cannot save the declaration: {exc.strerror or exc}",
                       headers={"Retry-After": "5"}) from None
    return json_response(_interests_view(mesh))


async def put_interests(request: web.Request) -> web.Response:
    """Replace the declaration (every list not given is empty)."""
    V.query_params(request, ())
    _, body = await _json_body(request)
    mesh = _mesh(request)
    try:
        new = Interests.parse(V.obj(body, "body"), mesh.wants.limits)
    except InterestError as exc:
        raise ApiError(400, "bad_interests", str(exc)) from None
    return await _declare(request, new)


async def reset_interests(request: web.Request) -> web.Response:
    """Back to [interests] of the configuration."""
    V.query_params(request, ())
    return await _declare(request, None)


# -- static peers (hmpnode.net.addresses; [peer] static) -------------------------------------


def _static_view(mesh) -> dict[str, Any]:
    return {"static": mesh.dialer.static_view(), "max": mesh.settings.addresses.static_max}


async def _static_body(request: web.Request) -> str:
    """The `peer` member of a static-peers request body (a spec, or for DELETE also a DID)."""
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, ("peer",))
    V.require(body, "peer")
    return V.text(body["peer"], "peer", max_len=800)


def _static_refused(exc: StaticError) -> ApiError:
    status_ = {"bad_static": 400, "not_found": 404}.get(exc.reason, 409)  # static_full, configured: 409
    return ApiError(status_, exc.reason, str(exc))


async def get_static_peers(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return json_response(_static_view(_mesh(request)))


async def add_static_peer(request: web.Request) -> web.Response:
    """Add a static peer (saved in the data dir, dialled at once): 201, or 200 when it was there."""
    V.query_params(request, ())
    spec = await _static_body(request)
    mesh = _mesh(request)
    try:
        peer, added = await mesh.dialer.add_static(spec)
    except StaticError as exc:
        raise _static_refused(exc) from None
    except OSError as exc:
        raise ApiError(503, "storage_unavailable", f"cannot save the static peers: {exc.strerror or exc}",
                       headers={"Retry-After": "5"}) from None
    return json_response({**_static_view(mesh), "peer": peer.spec, "added": added}, status=201 if added else 200)


async def remove_static_peer(request: web.Request) -> web.Response:
    """Take out the static peers a spec or DID names (those of the configuration cannot be)."""
    V.query_params(request, ())
    key = await _static_body(request)
    mesh = _mesh(request)
    try:
        removed = await mesh.dialer.remove_static(key)
    except StaticError as exc:
        raise _static_refused(exc) from None
    except OSError as exc:
        raise ApiError(503, "storage_unavailable", f"cannot save the static peers: {exc.strerror or exc}",
                       headers={"Retry-After": "5"}) from None
    return json_response({**_static_view(mesh), "removed": [p.spec for p in removed]})


async def metrics(request: web.Request) -> web.Response:
    V.query_params(request, ())
    state = _state(request)
    node = state.node
    mesh = getattr(node, "mesh", None)
    text = render(await node.status(), node.counters, node.rejections, rate=state.rate.rate(),
                  subscribers=state.subscribers, histogram=state.histogram, refusals=node.refusals,
                  clock_skew_max=mesh.skew.max_abs() if mesh is not None else None,
                  mesh=await mesh_views.metrics(mesh) if mesh is not None else None)
    return web.Response(body=text.encode("utf-8"), headers={hdrs.CONTENT_TYPE: METRICS_CONTENT_TYPE})


# -- the dashboard's pictures: the mesh as a graph, the last hour ------------------------------


async def mesh_graph(request: web.Request) -> web.Response:
    """This node, its peers and the peers they report, links by state (hmpnode.net.views.graph)."""
    params = V.query_params(request, ("limit",))
    limit = V.query_int(params, "limit", mesh_views.GRAPH_MAX_NODES, 1, mesh_views.GRAPH_MAX_NODES)
    node = _state(request).node
    mesh = getattr(node, "mesh", None)
    if mesh is None:
        return json_response(mesh_views.build_graph(mesh_views.GraphPeer(node.identity.did), (), connected=(),
                                                    table=(), dialling=(), banned=(), limit=limit))
    return json_response(mesh_views.graph(mesh, limit))


async def history(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return json_response(_state(request).history.view(time.monotonic()))


async def _reading(node: Node) -> Sample:
    """One point of the history, from the counters /metrics shows."""
    mesh = getattr(node, "mesh", None)
    numbers = await mesh_views.metrics(mesh) if mesh is not None else None
    return Sample(
        counters={"containers_in": mesh.counters["containers_received"],
                  "containers_out": mesh.counters["containers_sent"]} if mesh is not None else {},
        gauges={"loop_lag_seconds": node.lag_peak(), **({} if numbers is None else {
            "peers_connected": sum(numbers["sessions"].values()), "relay_held": numbers["relay"]["items"],
            "outbox_held": numbers["outbox"]["items"]})},
        refusals={f"{area}/{reason}": n for (area, reason), n in node.refusals.items()})


# -- containers ----------------------------------------------------------------------------

_CREATE_FIELDS = frozenset({
    "class", "payload", "subclass", "tags", "ttl", "related", "recipients", "encrypt_for",
    "compression", "network", "broadcast", "meta", "confidence", "source", "scope",
})
_ENCRYPT_FIELDS = frozenset({"public_key", "did"})


def _encrypt_for(value: Any) -> list[Recipient]:
    if not isinstance(value, list):
        raise V.bad_request("encrypt_for", "must be an array of {public_key, did?} objects")
    if not 1 <= len(value) <= 1024:
        raise V.bad_request("encrypt_for", "must have 1..1024 items")
    out = []
    for i, entry in enumerate(value):
        field = f"encrypt_for[{i}]"
        entry = V.obj(entry, field)
        V.no_unknown(entry, _ENCRYPT_FIELDS, field)
        V.require(entry, "public_key", prefix=f"{field}.")
        text = V.text(entry["public_key"], f"{field}.public_key", max_len=64)
        try:
            key = public_key_from_b58(text)
            ed25519_pk_to_x25519(key)
        except (EncodingError, ValueError):
            raise V.bad_request(f"{field}.public_key", "must be a base58btc Ed25519 public key") from None
        did = V.did(entry["did"], f"{field}.did") if "did" in entry else agent_did_for_key(key)
        out.append(Recipient(did, key))
    return out


def _related(value: Any) -> dict[str, Any]:
    related = V.obj(value, "related")
    if len(related) > 256:
        raise V.bad_request("related", "may have at most 256 relations")
    out: dict[str, Any] = {}
    for relation, targets in related.items():
        field = f"related.{relation[:64]}"
        if not relation or len(relation) > 128:
            raise V.bad_request(field, "a relation name is 1..128 characters")
        if isinstance(targets, str):
            out[relation] = V.did(targets, field)
        else:
            out[relation] = V.did_list(targets, field, max_items=4096)
    return out


async def create_container(request: web.Request) -> web.Response:
    V.query_params(request, ())
    _, body = await _json_body(request)
    node = _state(request).node
    body = V.obj(body, "body")
    V.no_unknown(body, _CREATE_FIELDS)
    V.require(body, "class", "payload")
    class_ = V.text(body["class"], "class", max_len=128)
    payload = V.obj(body["payload"], "payload")
    options: dict[str, Any] = {}
    encrypt_for: list[Recipient] = []
    if "subclass" in body:
        options["subclass"] = V.text(body["subclass"], "subclass", max_len=256, min_len=0)
    if "tags" in body:
        options["tags"] = V.text_list(body["tags"], "tags")
    if "ttl" in body:
        options["ttl"] = V.ttl(body["ttl"], node.now().replace(microsecond=0))
    if "related" in body:
        options["related"] = _related(body["related"])
    if "recipients" in body:
        options["recipients"] = V.did_list(body["recipients"], "recipients")
    if "encrypt_for" in body:
        encrypt_for = _encrypt_for(body["encrypt_for"])
    if "compression" in body:
        compression = body["compression"]
        if compression not in ("zstd", "gzip"):
            raise V.bad_request("compression", 'must be "zstd" or "gzip"')
        options["compression"] = compression
    if "network" in body:
        options["network"] = V.text(body["network"], "network", max_len=256, min_len=0)
    if "broadcast" in body:
        options["broadcast"] = V.boolean(body["broadcast"], "broadcast")
    if "meta" in body:
        options["meta"] = V.obj(body["meta"], "meta")
    if "confidence" in body:
        options["confidence"] = V.number(body["confidence"], "confidence", 0, 1)
    keep = Keep(source=V.label(body["source"], "source") if "source" in body else None,
                scope=V.label(body["scope"], "scope") if "scope" in body else None)
    try:
        result, container = await node.create(class_, payload, encrypt_for=encrypt_for, keep=keep, **options)
    except NodeError as exc:
        raise _node_refusal(exc) from None
    return _created(result, container)


def _created(result, container: dict[str, Any]) -> web.Response:
    """The answer to a container the node built: 201 stored, 200 held already, 422 refused."""
    if result.status == "rejected":
        raise ApiError(422, result.reason or "malformed", result.detail, extra={"did": result.did})
    out = {"did": result.did, "seq": result.seq, "status": result.status, "container": container}
    return json_response(out, 201 if result.status == "stored" else 200)


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    """An import body `{"containers": [...]}`, each item kept as its own JSON text."""

    containers: list[msgspec.Raw]


_BATCH = msgspec.json.Decoder(_Batch)


def _batch_texts(raw: bytes) -> list[msgspec.Raw] | None:
    """The JSON text of each item of a `{"containers": [...]}` body, without building
    the items (a full parse built ~40 objects per container on the event loop, which
    the verifier then serialised again; now it parses each item once, in its thread);
    None for any other body, or one msgspec does not read (it is then parsed as before,
    with the same answers). Invalid UTF-8 is refused for the whole body (bad_json) as
    the full parse does. The texts are views into `raw`: the caller copies them out
    only once their number is within the batch limit (a body of millions of tiny items
    would otherwise cost ~170 MB more per 8 MiB body before the limit refused it)."""
    try:
        batch = _BATCH.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nesting deeper than msgspec reads
        return None
    if not raw.isascii():
        try:
            raw.decode()
        except UnicodeDecodeError:
            return None
    return batch.containers


async def import_containers(request: web.Request) -> web.Response:
    V.query_params(request, ())
    state = _state(request)
    raw = await _body_bytes(request)
    # Each container goes to verification as its own JSON text, read as on the wire
    # (strict reading, the container size limit on the text as sent:
    # docs/protocol.md#rule-import-as-text); what is not an object is refused there as malformed.
    texts = _batch_texts(raw)
    items: list[Any] | None = texts
    body = None
    if items is None:
        body = _parsed(raw)
        if isinstance(body, dict) and len(body) == 1 and "containers" in body:
            items = body["containers"]
            if not isinstance(items, list):
                raise V.bad_request("containers", "must be an array of containers")
            try:
                items = [item if isinstance(item, dict) else orjson.dumps(item) for item in items]
            except orjson.JSONEncodeError:  # an item nested deeper than orjson writes (254)
                raise ApiError(400, "bad_json", "the body nests too deep") from None
    if items is not None:
        if len(items) > state.limits.max_batch:
            raise ApiError(413, "batch_too_large",
                           f"{len(items)} containers; at most {state.limits.max_batch} per request")
        if texts is not None:
            items = [bytes(text) for text in texts]
        results = await state.node.ingest(items, source="agent", budget=state.limits.max_import_decompressed_bytes) \
            if items else []
        tally = Counter(r.status for r in results)
        return json_response({
            "results": await in_slices(IngestResult.to_json, results),
            "stored": tally["stored"],
            "duplicate": tally["duplicate"],
            "conflict": tally["conflict"],
            "rejected": tally["rejected"],
        })
    if not isinstance(body, dict):
        raise V.bad_request("body", "must be a container object or {\"containers\": [...]}")
    # One container: its bytes as received, so that strict reading (duplicate keys,
    # integer range) and the container size limit apply as on the wire.
    (result,) = await state.node.ingest([raw], source="agent", budget=state.limits.max_import_decompressed_bytes)
    if result.status == "rejected":
        return error_response(422, result.reason or "malformed", result.detail,
                              extra={"did": result.did, "status": "rejected"})
    return json_response(result.to_json(), 201 if result.status == "stored" else 200)


async def get_container(request: web.Request) -> web.Response:
    did = V.path_did(request)
    params = V.query_params(request, ("decrypt",))
    decrypt = V.query_bool(params, "decrypt")
    return json_response(await _state(request).node.get(did, decrypt=decrypt, spliced=True))


_LIST_PARAMS = ("class", "tag", "sender", "recipient", "related", "since", "until", "expired", "order", "limit",
                "cursor")


def _expired(params: dict[str, str]) -> bool | None:
    value = params.get("expired", "false")
    if value not in ("false", "true", "any"):
        raise V.bad_request("expired", "must be false, true or any")
    return {"false": False, "true": True, "any": None}[value]


async def list_containers(request: web.Request) -> web.Response:
    state = _state(request)
    limits = state.limits
    params = V.query_params(request, _LIST_PARAMS)
    order = params.get("order", "asc")
    if order not in ("asc", "desc"):
        raise V.bad_request("order", "must be asc or desc")
    descending = order == "desc"
    after = state.cursors.decode(params["cursor"], descending=descending) if "cursor" in params else 0
    query = ListQuery(
        class_=V.query_text(params, "class", 128),
        tag=V.query_text(params, "tag", 256),
        sender=V.query_did(params, "sender"),
        recipient=V.query_did(params, "recipient"),
        related_to=V.query_did(params, "related"),
        since=V.query_time(params, "since"),
        until=V.query_time(params, "until"),
        expired=_expired(params),
        after_seq=after,
        descending=descending,
        limit=V.query_int(params, "limit", min(limits.default_list_limit, limits.max_list_limit), 1,
                          limits.max_list_limit),
    )
    items, next_seq = await state.node.list(query, spliced=True)
    next_cursor = state.cursors.encode(next_seq, descending=descending) if next_seq else None
    return json_response({"items": items, "next_cursor": next_cursor})


def _search_query(*, since: datetime | None, until: datetime | None, **filters: Any) -> SearchQuery:
    """The filters of a search or a recall (the text is matched separately)."""
    return SearchQuery(match="", since_us=to_us(since) if since else None,
                       until_us=to_us(until) if until else None, **filters)


_SEARCH_PARAMS = ("q", "class", "tag", "sender", "since", "until", "state", "limit", "scope")


async def search(request: web.Request) -> web.Response:
    state = _state(request)
    params = V.query_params(request, _SEARCH_PARAMS)
    text = V.query_text(params, "q", 4096)
    if not text or not text.strip():
        raise V.bad_request("q", "the text to search for is required")
    states = None
    if "state" in params:
        states = tuple(dict.fromkeys(params["state"].split(",")))
        if not states or not set(states) <= set(STATES):
            raise V.bad_request("state", f"a comma-separated list among {', '.join(STATES)}")
    query = _search_query(
        class_=V.query_text(params, "class", 128), tag=V.query_text(params, "tag", 256),
        sender=V.query_did(params, "sender"), since=V.query_time(params, "since"),
        until=V.query_time(params, "until"), states=states,
        limit=V.query_int(params, "limit", 20, 1, state.limits.max_list_limit),
        scope=V.label(params["scope"], "scope") if "scope" in params else None,
    )
    return json_response(await state.node.search(text, query))


_RECALL_FIELDS = frozenset({"query", "max_tokens", "max_bytes", "include_contested", "class", "tag", "sender",
                            "since", "until", "scope", "explain", "why"})
MAX_RECALL_BUDGET = 10_000_000


async def _recall_request(request: web.Request) -> tuple[str, dict[str, Any]]:
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, _RECALL_FIELDS)
    V.require(body, "query", "max_tokens", "max_bytes")
    text = V.text(body["query"], "query", max_len=4096)
    budgets = {}
    for name in ("max_tokens", "max_bytes"):
        value = body[name]
        if type(value) is not int or not 1 <= value <= MAX_RECALL_BUDGET:
            raise V.bad_request(name, f"must be an integer 1..{MAX_RECALL_BUDGET}")
        budgets[name] = value
    for name in ("since", "until"):
        if name in body and not isinstance(body[name], str):
            raise V.bad_request(name, "must be an RFC 3339 UTC time")
    query = _search_query(
        class_=V.text(body["class"], "class", max_len=128) if "class" in body else None,
        tag=V.text(body["tag"], "tag", max_len=256) if "tag" in body else None,
        sender=V.did(body["sender"], "sender") if "sender" in body else None,
        since=V.query_time(body, "since"), until=V.query_time(body, "until"),
        scope=V.label(body["scope"], "scope") if "scope" in body else None,
    )
    options = {**budgets, "query": query,
               "include_contested": V.boolean(body["include_contested"], "include_contested")
               if "include_contested" in body else False,
               "explain": V.boolean(body["explain"], "explain") if "explain" in body else False,
               "why": V.boolean(body["why"], "why") if "why" in body else False}
    return text, options


def _envelope_response(outcome) -> web.Response:
    # always an answer: a budget below an empty one abstains (hmpnode.memory.recall.budget_abstain)
    return web.Response(body=outcome.envelope_json, content_type="application/json")


async def recall(request: web.Request) -> web.Response:
    text, options = await _recall_request(request)
    explain = options.pop("explain")
    node = _state(request).node
    outcome = await node.recall(text, **options)
    if explain:  # content-free: counts, reasons, budgets (for logs); no items, ids or text
        return json_response({"explain": node.recall_explain(outcome, **options)})
    return _envelope_response(outcome)


async def recall_plan(request: web.Request) -> web.Response:
    text, options = await _recall_request(request)
    return json_response(await _state(request).node.recall_plan(text, **options))


async def recall_resolve(request: web.Request) -> web.Response:
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, ("plan",))
    V.require(body, "plan")
    return _envelope_response(await _state(request).node.recall_resolve(body["plan"]))


_FORGET_FIELDS = ("did", "source", "scope")


async def forget(request: web.Request) -> web.Response:
    """Erase one container, everything from a named source, or a scope (exactly one)."""
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, _FORGET_FIELDS)
    given = [k for k in _FORGET_FIELDS if k in body]
    if len(given) != 1:
        raise ApiError(400, "bad_request", "give exactly one of did, source, scope")
    (what,) = given
    value = V.did(body[what], what) if what == "did" else V.label(body[what], what)
    return json_response(await _state(request).node.forget(**{what: value}))


async def scope_accept(request: web.Request) -> web.Response:
    """Take a held container (of any sender) into a scope: the only way another sender's is in one."""
    scope = V.label(request.match_info.get("scope", ""), "scope")
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, ("did",))
    V.require(body, "did")
    return json_response(await _state(request).node.accept_into_scope(scope, V.did(body["did"], "did")))


async def journal_add(request: web.Request) -> web.Response:
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, ("text", "title", "tags"))
    V.require(body, "text")
    out = await _state(request).node.journal_add(
        V.text(body["text"], "text", max_len=1_000_000),
        title=V.text(body["title"], "title", max_len=256) if "title" in body else None,
        tags=V.text_list(body["tags"], "tags") if "tags" in body else (),
    )
    return json_response(out, status=201)


async def journal_verify(request: web.Request) -> web.Response:
    V.query_params(request, ())
    return json_response((await _state(request).node.journal_verify()).to_json())


async def journal_load(request: web.Request) -> web.Response:
    params = V.query_params(request, ("max_tokens", "include_routine"))
    V.require(params, "max_tokens")
    entries = await _state(request).node.journal_load(
        V.query_int(params, "max_tokens", 0, 0, MAX_RECALL_BUDGET),
        include_routine=V.query_bool(params, "include_routine"))
    return json_response({"entries": entries})


async def journal_anchor(request: web.Request) -> web.Response:
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, ("date",))
    try:
        day = date.fromisoformat(V.text(body.get("date"), "date", max_len=10))
    except ValueError:
        raise V.bad_request("date", "must be a UTC day, YYYY-MM-DD") from None
    return json_response(await _state(request).node.journal_anchor(day), status=201)


async def container_versions(request: web.Request) -> web.Response:
    did = V.path_did(request)
    mesh = V.query_bool(V.query_params(request, ("mesh",)), "mesh", digits=True)
    return json_response(await _state(request).node.versions(did, mesh=mesh))


async def container_referenced_by(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    return json_response(await _state(request).node.referenced_by(did))


async def container_evaluations(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    return json_response(await _state(request).node.evaluations(did))


async def add_evaluation(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    _, body = await _json_body(request)
    node = _state(request).node
    body = V.obj(body, "body")
    if "item" in body:
        V.no_unknown(body, ("item",))
        item = V.obj(body["item"], "item")
        try:
            status_ = await node.add_evaluation(did, item)
        except NodeError as exc:
            raise _node_refusal(exc) from None
        return json_response({"status": status_}, 201)
    V.no_unknown(body, ("type", "value", "target"))
    for required in ("type", "value"):
        if required not in body:
            raise V.bad_request(required, "is required (or give a signed evaluation as \"item\")")
    type_ = V.text(body["type"], "type", max_len=64)
    value = V.number(body["value"], "value", -1, 1)
    target = V.did(body["target"], "target") if "target" in body else None
    try:
        out = await node.evaluate(did, type_=type_, value=value, target=target)
    except NodeError as exc:
        raise _node_refusal(exc) from None
    return json_response(out, 201)


# -- consensus and trust (hmpnode.consensus, docs/protocol.md "Consensus") ---------------------

_PROPOSE_FIELDS = ("payload", "text", "ttl", "quorum", "threshold", "voters", "weighting", "tags")


async def propose(request: web.Request) -> web.Response:
    V.query_params(request, ())
    _, body = await _json_body(request)
    node = _state(request).node
    body = V.obj(body, "body")
    V.no_unknown(body, _PROPOSE_FIELDS)
    if ("payload" in body) == ("text" in body):
        raise V.bad_request("payload", 'give exactly one of "payload" (an object) or "text"')
    payload = V.obj(body["payload"], "payload") if "payload" in body else {"text": V.text(body["text"], "text")}
    if "consensus" in payload:
        raise V.bad_request("payload", 'must not carry "consensus": give quorum, threshold, voters, weighting')
    base = node.consensus_policy.rules()
    rules = cons.Rules(
        quorum=int(V.number(body["quorum"], "quorum", 1, cons.MAX_VOTERS)) if "quorum" in body else base.quorum,
        threshold=float(V.number(body["threshold"], "threshold", 0.01, 1)) if "threshold" in body else base.threshold,
        voters=tuple(V.did_list(body["voters"], "voters", max_items=cons.MAX_VOTERS)) if "voters" in body else None,
        weighting=body.get("weighting", base.weighting),
    )
    if isinstance(body.get("quorum"), float) and not body["quorum"].is_integer():
        raise V.bad_request("quorum", "must be an integer")
    if rules.weighting not in cons.WEIGHTINGS:
        raise V.bad_request("weighting", f"must be one of {', '.join(cons.WEIGHTINGS)}")
    deadline = V.ttl(body["ttl"], node.now().replace(microsecond=0)) if "ttl" in body else None
    if deadline is not None and deadline <= node.now():
        raise V.bad_request("ttl", "must be in the future: it is the voting deadline")
    tags = V.text_list(body["tags"], "tags") if "tags" in body else ()
    try:
        result, container = await node.propose(payload, deadline=deadline, rules=rules, tags=tags)
    except NodeError as exc:
        raise _node_refusal(exc) from None
    return _created(result, container)


async def vote(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    _, body = await _json_body(request)
    body = V.obj(body, "body")
    V.no_unknown(body, ("value", "type", "reason"))
    V.require(body, "value")
    value = body["value"] if isinstance(body["value"], bool) else V.number(body["value"], "value", -1, 1)
    vote_type = V.text(body["type"], "type", max_len=128) if "type" in body else None
    reason = V.text(body["reason"], "reason") if "reason" in body else None
    try:
        result, container = await _state(request).node.vote(did, value, vote_type=vote_type, reason=reason)
    except NodeError as exc:
        raise _node_refusal(exc) if exc.reason != "voting_closed" else ApiError(409, exc.reason, exc.detail) from None
    return _created(result, container)


async def consensus_state(request: web.Request) -> web.Response:
    did = V.path_did(request)
    V.query_params(request, ())
    try:
        return json_response(await _state(request).node.consensus(did))
    except NodeError as exc:
        raise _node_refusal(exc) from None


async def trust(request: web.Request) -> web.Response:
    did = V.path_did(request, "agent_did")
    V.query_params(request, ())
    return json_response(await _state(request).node.trust(did))


# -- events ------------------------------------------------------------------------------------

_EVENT_PARAMS = ("class", "tag", "to_me", "sender", "cursor")
_END = object()
#: seconds an event stream over its byte bound may go without taking an event before it is cut off
_STALL_SECONDS = 5.0
#: stored containers read per page for an event stream (a page is held while it is queued)
_EVENT_PAGE = 32


async def events(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    node, limits = state.node, state.limits
    params = V.query_params(request, _EVENT_PARAMS)
    last_event_id = request.headers.get("Last-Event-ID")
    if last_event_id is not None and last_event_id.strip():
        after = state.cursors.decode(last_event_id.strip(), field="Last-Event-ID")
    elif "cursor" in params:
        after = state.cursors.decode(params["cursor"])
    else:
        after = node.last_seq  # only what is stored from now on
    query = ListQuery(
        class_=V.query_text(params, "class", 128),
        tag=V.query_text(params, "tag", 256),
        sender=V.query_did(params, "sender"),
        recipient=node.identity.did if V.query_bool(params, "to_me") else None,
        expired=False,  # expired containers are stored, never offered as current (profile 7, 12)
        after_seq=after,
    )
    if state.subscribers >= limits.max_event_subscribers:
        raise ApiError(503, "too_many_subscribers",
                       f"{state.subscribers} event streams are open; at most {limits.max_event_subscribers}",
                       headers={"Retry-After": "5"})
    state.subscribers += 1
    stop = asyncio.Event()
    streams = state.streams
    assert streams is not None
    streams.add(stop)
    # Events wait here as the bytes to be written, bounded in bytes per stream
    # (event_queue_bytes) and for all streams (event_queue_total_bytes): the reader
    # waits for room; a stream that has not taken an event for _STALL_SECONDS while
    # over its bound is cut off (too_slow) and resumes later with Last-Event-ID.
    queue: deque[bytes | object] = deque()
    queued = [0]  # bytes in `queue`
    ready, room = asyncio.Event(), asyncio.Event()
    progress = [time.monotonic()]  # when the writer last took or wrote an event
    max_items = max(1, limits.event_queue_size)

    def full(n: int) -> bool:
        if not queue:
            return False  # one event always fits (it may be as large as a container)
        return (len(queue) >= max_items or queued[0] + n > limits.event_queue_bytes
                or state.event_bytes + n > limits.event_queue_total_bytes)

    async def pump() -> None:
        try:
            async for item in node.events(query, batch=_EVENT_PAGE, spliced=True):
                chunk = (b"id: " + state.cursors.encode(item["seq"]).encode("ascii")
                         + b"\nevent: container\ndata: " + orjson.dumps(item) + b"\n\n")
                del item
                while full(len(chunk)):
                    if time.monotonic() - progress[0] > _STALL_SECONDS:
                        node.refuse("events", "too_slow")
                        log.warning("event stream cut off: the client took no event for %d s", _STALL_SECONDS)
                        if request.transport is not None:
                            request.transport.close()  # a stalled writer's drain() ends with it
                        stop.set()
                        ready.set()
                        return
                    room.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(room.wait(), 0.5)
                queue.append(chunk)
                queued[0] += len(chunk)
                state.event_bytes += len(chunk)
                ready.set()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the store went away (node stopping): end the stream
            log.warning("event stream source failed", exc_info=True)
        queue.append(_END)
        ready.set()

    task: asyncio.Task[None] | None = None
    response = web.StreamResponse(headers={
        hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
        hdrs.CACHE_CONTROL: "no-cache",
        "X-Accel-Buffering": "no",
    })
    try:
        await response.prepare(request)
        await response.write(b": stream open\n\n")
        task = asyncio.create_task(pump())
        keepalive = limits.event_keepalive_seconds
        poll = min(1.0, keepalive)
        last_write = time.monotonic()
        while not stop.is_set():
            if not queue:
                ready.clear()
                try:
                    await asyncio.wait_for(ready.wait(), timeout=poll)
                except asyncio.TimeoutError:
                    if request.transport is None or request.transport.is_closing():
                        break  # the client went away
                    if time.monotonic() - last_write >= keepalive:
                        await response.write(b": keepalive\n\n")
                        last_write = time.monotonic()
                continue
            chunk = queue.popleft()
            if chunk is _END:
                break
            assert isinstance(chunk, bytes)
            queued[0] -= len(chunk)
            state.event_bytes -= len(chunk)
            room.set()
            progress[0] = time.monotonic()
            await response.write(chunk)
            last_write = progress[0] = time.monotonic()
    except (ConnectionError, RuntimeError):
        pass  # the client disconnected mid-write (aiohttp raises ConnectionResetError / RuntimeError)
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        state.event_bytes -= queued[0]
        queue.clear()
        streams.discard(stop)
        state.subscribers -= 1
    with contextlib.suppress(ConnectionError, RuntimeError):
        await response.write_eof()
    return response


# -- routing, middleware, app -----------------------------------------------------------------

#: (method, path, handler): every route of the API; openapi.json lists exactly these.
ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/v1/health", health),
    ("GET", "/healthz", healthz),
    ("GET", "/v1/status", status),
    ("GET", "/v1/openapi.json", openapi),
    ("GET", "/v1/config", get_config),
    ("GET", "/v1/peers", peers),
    ("GET", "/v1/peers/static", get_static_peers),
    ("POST", "/v1/peers/static", add_static_peer),
    ("DELETE", "/v1/peers/static", remove_static_peer),
    ("GET", "/v1/peers/{did}/index", peer_index),
    ("GET", "/v1/mesh/queues", mesh_queues),
    ("GET", "/v1/mesh/graph", mesh_graph),
    ("GET", "/v1/history", history),
    ("GET", "/v1/dht/peers/{did}", dht_peer),
    ("GET", "/v1/dht/providers/{did}", dht_providers),
    ("GET", "/v1/dht/topics/{topic}", dht_topic),
    ("GET", "/v1/interests", get_interests),
    ("PUT", "/v1/interests", put_interests),
    ("DELETE", "/v1/interests", reset_interests),
    ("GET", "/metrics", metrics),
    ("POST", "/v1/containers", create_container),
    ("GET", "/v1/containers", list_containers),
    ("POST", "/v1/containers/import", import_containers),
    ("GET", "/v1/search", search),
    ("POST", "/v1/journal", journal_add),
    ("GET", "/v1/journal/verify", journal_verify),
    ("GET", "/v1/journal/load", journal_load),
    ("POST", "/v1/journal/anchor", journal_anchor),
    ("POST", "/v1/recall", recall),
    ("POST", "/v1/recall/plan", recall_plan),
    ("POST", "/v1/recall/resolve", recall_resolve),
    ("POST", "/v1/forget", forget),
    ("POST", "/v1/scopes/{scope}/accept", scope_accept),
    ("GET", "/v1/containers/{did}", get_container),
    ("GET", "/v1/containers/{did}/versions", container_versions),
    ("GET", "/v1/containers/{did}/referenced-by", container_referenced_by),
    ("GET", "/v1/containers/{did}/evaluations", container_evaluations),
    ("POST", "/v1/containers/{did}/evaluations", add_evaluation),
    ("GET", "/v1/events", events),
    ("POST", "/v1/consensus", propose),
    ("GET", "/v1/consensus/{did}", consensus_state),
    ("POST", "/v1/consensus/{did}/votes", vote),
    ("GET", "/v1/trust/{agent_did}", trust),
    ("POST", "/v1/shutdown", shutdown),
    ("GET", "/v1/log-level", get_log_level),
    ("PUT", "/v1/log-level", put_log_level),
)


def _http_error(exc: web.HTTPException) -> web.Response:
    status_ = exc.status
    if status_ >= 500:
        return error_response(500, "internal", "internal error")
    reason = HTTP_REASONS.get(status_, f"http_{status_}")
    if status_ == 404:
        detail = "no such route"
    elif status_ == 405:
        detail = f"method not allowed; allowed: {exc.headers.get(hdrs.ALLOW, '')}"
    elif status_ == 413:
        detail = f"the body is larger than the limit ({exc.text or 'too large'})"[:300]
    else:
        detail = (exc.text or exc.reason or "refused")[:300]
    headers = {k: v for k, v in exc.headers.items() if k in (hdrs.ALLOW, "Retry-After")}
    response = error_response(status_, reason, detail, headers=headers)
    if status_ == 413:
        response.force_close()  # the rest of the body is not read
    return response


def _authorized(request: web.Request, token: bytes) -> bool:
    header = request.headers.get(hdrs.AUTHORIZATION, "")
    scheme, _, given = header.strip().partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"), token)
    return ok and scheme.lower() == "bearer"


_PUBLIC_PATHS = frozenset(path for _, path, _ in dashboard_files.PUBLIC_ROUTES)


def _public(request: web.Request) -> bool:
    """Served without the token: the health probe (it says nothing) and the dashboard's
    static files (they hold no data; GET only)."""
    resource = request.match_info.route.resource
    if resource is None:
        return False
    return resource.canonical in PUBLIC_ROUTES or (request.method == "GET" and resource.canonical in _PUBLIC_PATHS)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer auth on every route, JSON errors for everything, request timing."""
    state = request.app[STATE]
    started = time.perf_counter()
    response: web.StreamResponse | None = None
    try:
        if not _public(request) and not _authorized(request, state.token):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token",
                           headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="hmpnode"'})
        response = await handler(request)
    except ApiError as exc:
        response = exc.response()
    except NodeError as exc:
        response = error_response(exc.status if 400 <= exc.status < 600 else 400, exc.reason, exc.detail)
    except web.HTTPException as exc:
        response = _http_error(exc)
    except (HttpProcessingError, RequestPayloadError) as exc:
        response = error_response(400, "bad_request", f"malformed HTTP request ({type(exc).__name__})")
    except StorageFull:
        # The store's writer logged "disk full" already (once per episode, not per request).
        state.node.refuse("api", "storage_full")
        response = error_response(507, "storage_full", "the node's disk is full; nothing of this request was "
                                  "stored; retry once space is freed", headers={"Retry-After": "30"})
    except (DatabaseClosed, sqlite3.Error) as exc:
        # Shutting down, I/O error: nothing was acknowledged; the client may retry.
        log.error("storage unavailable: %s %s: %s", request.method, request.path[:200], exc)
        response = error_response(503, "storage_unavailable", "the node's store cannot take this request now",
                                  headers={"Retry-After": "5"})
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001 - last line: a bug, never an answer to bad input
        log.exception("API handler failed: %s %s", request.method, request.path[:200])
        response = error_response(500, "internal", "internal error")
    finally:
        resource = request.match_info.route.resource
        if response is not None and response.status >= 400 and not request.content.is_eof():
            response.force_close()  # the unread body is not read: say so (Connection: close)
        route = resource.canonical if resource is not None else "unmatched"
        method = request.method if request.method in METHODS else "other"
        state.histogram.observe(route, method, time.perf_counter() - started)
        state.rate.sample()
    return response


async def _background(app: web.Application):
    state = app[STATE]

    async def sample() -> None:
        while True:
            await asyncio.sleep(1.0)
            state.rate.sample()

    async def record() -> None:
        while True:
            await asyncio.sleep(state.history.interval)
            try:
                reading = await _reading(state.node)
            except (DatabaseClosed, sqlite3.Error) as exc:  # shutting down, or the disk: a gap, not an end
                log.debug("history: no reading: %s", exc)
                continue
            except Exception:  # noqa: BLE001 - a bug: said in the log, and the charts go on
                log.exception("history: reading the counters failed")
                continue
            state.history.record(time.monotonic(), reading)

    tasks = [asyncio.create_task(sample()), asyncio.create_task(record())]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _end_streams(app: web.Application) -> None:
    app[STATE].stopping = True
    for stop in list(app[STATE].streams or ()):
        stop.set()


def create_app(node: Node, *, token: str, limits: ApiLimits = ApiLimits(), dashboard: bool = True,
               config: Mapping[str, Any] | None = None,
               stop: Callable[[str], None] | None = None) -> web.Application:
    """The API application for `node`; every request needs `Authorization: Bearer <token>`
    (but the web dashboard's static files, served unless `dashboard` is false: api.dashboard).
    `config`: what `GET /v1/config` answers (the daemon's settings with their sources);
    None: that route answers 404 not_configured (an app built without settings, in tests).
    `stop(why)`: what POST /v1/shutdown calls (the daemon's clean shutdown)."""
    if not isinstance(token, str) or not token:
        raise ValueError("the API needs a non-empty bearer token")
    app = web.Application(middlewares=[_guard], client_max_size=limits.max_body_bytes)
    app[STATE] = _State(
        node=node,
        token=token.encode("utf-8"),
        limits=limits,
        cursors=CursorCodec.for_identity(node.identity),
        openapi=OPENAPI_PATH.read_bytes(),
        histogram=Histogram(),
        rate=RateWindow(lambda: node.counters["ingest_stored"]),
        history=History(limits.history_interval_ms / 1000),
        streams=set(),
        config=config,
        stop=stop,
    )
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    if dashboard:
        dashboard_files.add_routes(app)
    app.cleanup_ctx.append(_background)
    app.on_shutdown.append(_end_streams)
    return app
