"""An async client of the node's local agent API (aiohttp).

    async with Client.from_data_dir() as node:          # finds the running node
        made = await node.create("note", {"text": "hi"}, tags=["demo"])
        async for item in node.iterate(class_="note"):
            ...
        async for event in node.events(tag="demo"):     # reconnects on its own
            print(event["cursor"], event["did"])

Every non-2xx answer raises `ApiError(status, reason, detail)`; a node that
is not running or cannot be reached raises `ClientError`.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

__all__ = ["Client", "ClientError", "ApiError", "UnsafeDataDir", "read_node_file"]

NODE_FILE = "node.json"
TOKEN_FILE = "api.token"
_MAX_FILE = 64 * 1024


class ClientError(Exception):
    """No node to talk to, or the conversation failed below HTTP."""


class UnsafeDataDir(ClientError):
    """The data dir, node.json or the token could have been written by another local
    user: refused (hmpnode.fsutil), as the node refuses them."""


class ApiError(ClientError):
    """The node answered with an error status."""

    def __init__(self, status: int, reason: str, detail: str = ""):
        super().__init__(f"{status} {reason}: {detail}" if detail else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.detail = detail


def _default_data_dir() -> Path:
    from hmpnode.config import DATA_DIR_ENV, default_data_dir

    env = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(env).expanduser() if env else default_data_dir()


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` exists (one of another user counts: it exists)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_node_file(data_dir: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], str]:
    """(node.json, API token) of the node running on `data_dir`; ClientError if there is none."""
    from hmpnode.fsutil import UnsafePath, check_private_dir, read_secret

    directory = Path(data_dir).expanduser() if data_dir is not None else _default_data_dir()
    node_file = directory / NODE_FILE
    # node.json says where to send the token, so it is trusted no more than the token
    # itself: the same checks as the node's (no symlinks, the user's own files, nothing
    # another local user could write), else a planted node.json would get the token
    # sent to a server of that user's choice. Never chmods anything.
    try:
        if os.path.isdir(directory):
            check_private_dir(directory)
        info = orjson.loads(read_secret(node_file, "node file", _MAX_FILE, tighten=False))
    except UnsafePath as exc:
        raise UnsafeDataDir(f"refusing to use data dir {directory}: {exc}") from None
    except FileNotFoundError:
        raise ClientError(f"no node is running on data dir {directory} (no {NODE_FILE}); start one with `hmpnode run`") from None
    except OSError as exc:
        raise ClientError(f"cannot read {node_file}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError:
        raise ClientError(f"{node_file} is not JSON; is a node starting up?") from None
    if not isinstance(info, dict) or not isinstance(info.get("api"), dict) or not isinstance(info["api"].get("url"), str):
        raise ClientError(f"{node_file} does not say where the node listens")
    if not pid_alive(info.get("pid")):
        raise ClientError(f"no node is running on data dir {directory} (stale {NODE_FILE} of pid {info.get('pid')})")
    try:
        token = read_secret(directory / TOKEN_FILE, "API token", _MAX_FILE, tighten=False).decode("ascii").strip()
    except UnsafePath as exc:
        raise UnsafeDataDir(f"refusing to use data dir {directory}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ClientError(f"cannot read the API token {directory / TOKEN_FILE}: {getattr(exc, 'strerror', None) or exc}") from None
    return info, token


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    return str(value)


_PARAM_NAMES = {"class_": "class", "related_to": "related", "to_me": "to_me"}


def _params(filters: Mapping[str, Any]) -> dict[str, str]:
    return {_PARAM_NAMES.get(k, k): _param(v) for k, v in filters.items() if v is not None}


def _drop_none(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return _param(value)
    raise TypeError(f"cannot send {type(value).__name__} as JSON")


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value, default=_json_default)


class Client:
    """One node's API. Use as `async with`, or call `close()`."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 60.0,
        session: aiohttp.ClientSession | None = None,
        data_dir: str | os.PathLike[str] | None = None,
    ):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.node_info: dict[str, Any] | None = None
        self._data_dir = data_dir
        self._session = session
        self._own_session = session is None

    @classmethod
    def from_data_dir(cls, data_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Client:
        """The node running on `data_dir` (default: $HMPNODE_DATA_DIR, else the
        platform's user data dir), from its node.json and api.token."""
        directory = Path(data_dir).expanduser() if data_dir is not None else _default_data_dir()
        info, token = read_node_file(directory)
        client = cls(info["api"]["url"], token, data_dir=directory, **kwargs)
        client.node_info = info
        return client

    # -- plumbing ------------------------------------------------------------------

    async def __aenter__(self) -> Client:
        self._get_session()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None if self._own_session else self._session

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                json_serialize=lambda v: _dumps(v).decode(),
            )
            self._own_session = True
        return self._session

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if extra:
            headers.update(extra)
        return headers

    @staticmethod
    async def _error(resp: aiohttp.ClientResponse) -> ApiError:
        body = await resp.read()
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("reason"), str):
            return ApiError(resp.status, doc["reason"], str(doc.get("detail") or ""))
        text = body.decode("utf-8", "replace").strip()
        return ApiError(resp.status, f"http_{resp.status}", text[:300] or (resp.reason or ""))

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        raw_body: bytes | None = None,
        text: bool = False,
    ) -> Any:
        """One API call: the decoded JSON answer (or text with `text=True`)."""
        headers = self._headers({"Accept": "text/plain"} if text else None)
        data = raw_body
        if body is not None:
            data = _dumps(body)
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._get_session().request(method, self.url + path, params=params, data=data, headers=headers) as resp:
                if resp.status >= 400:
                    raise await self._error(resp)
                payload = await resp.read()
        except aiohttp.ClientError as exc:
            raise ClientError(f"cannot reach the node at {self.url}: {exc or type(exc).__name__}") from exc
        except asyncio.TimeoutError:
            raise ClientError(f"the node at {self.url} did not answer {method} {path} within {self.timeout:g} s") from None
        if text:
            return payload.decode("utf-8", "replace")
        if not payload:
            return None
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise ClientError(f"{method} {path}: the node answered with something that is not JSON") from None

    # -- containers ------------------------------------------------------------------

    async def create(self, class_: str, payload: Any, **options: Any) -> dict[str, Any]:
        """Build, sign and store a container as the node's agent. Options: subclass,
        tags, ttl, related, recipients, encrypt_for=[{"public_key", "did"?}],
        compression, network, broadcast, meta, confidence; node-local: source (a label
        `forget(source=...)` erases by), scope (the scope it joins)."""
        return await self.request("POST", "/v1/containers", body={"class": class_, "payload": payload, **_drop_none(options)})

    async def import_containers(self, containers: Iterable[dict[str, Any] | str | bytes]) -> dict[str, Any]:
        """Store containers made elsewhere; str/bytes items are sent byte for byte."""
        parts = [c.encode() if isinstance(c, str) else bytes(c) if isinstance(c, (bytes, bytearray, memoryview)) else _dumps(c)
                 for c in containers]
        return await self.request("POST", "/v1/containers/import", raw_body=b'{"containers":[' + b",".join(parts) + b"]}")

    async def get(self, did: str, decrypt: bool = False) -> dict[str, Any]:
        return await self.request("GET", f"/v1/containers/{quote(did, safe=':')}", params={"decrypt": "true"} if decrypt else None)

    async def list(self, **filters: Any) -> dict[str, Any]:
        """One page: {"items", "next_cursor"}. Filters: class_, tag, sender,
        recipient, related, since, until, expired, order, limit, cursor."""
        return await self.request("GET", "/v1/containers", params=_params(filters))

    async def iterate(self, **filters: Any) -> AsyncIterator[dict[str, Any]]:
        """Every matching item, following cursors page by page."""
        while True:
            page = await self.list(**filters)
            for item in page.get("items") or ():
                yield item
            cursor = page.get("next_cursor")
            if cursor is None or not page.get("items"):
                return
            filters = {**filters, "cursor": cursor}

    async def versions(self, did: str, *, mesh: bool = False) -> dict[str, Any]:
        """Versions of a held container; `mesh`: also those the connected peers know of."""
        return await self.request("GET", f"/v1/containers/{quote(did, safe=':')}/versions",
                                  params={"mesh": "1"} if mesh else None)

    async def referenced_by(self, did: str) -> dict[str, Any]:
        return await self.request("GET", f"/v1/containers/{quote(did, safe=':')}/referenced-by")

    async def evaluations(self, did: str) -> dict[str, Any]:
        return await self.request("GET", f"/v1/containers/{quote(did, safe=':')}/evaluations")

    async def evaluate(self, did: str, type: str, value: float, target: str | None = None) -> dict[str, Any]:  # noqa: A002
        """Sign an evaluation of `did` as the node's agent."""
        body = _drop_none({"type": type, "value": value, "target": target})
        return await self.request("POST", f"/v1/containers/{quote(did, safe=':')}/evaluations", body=body)

    async def add_evaluation(self, did: str, item: dict[str, Any]) -> dict[str, Any]:
        """Hand the node an evaluation item signed by another agent."""
        return await self.request("POST", f"/v1/containers/{quote(did, safe=':')}/evaluations", body={"item": item})

    async def propose(self, text: str | None = None, *, payload: dict[str, Any] | None = None, **rules: Any) -> dict[str, Any]:
        """Publish a proposal; `rules`: ttl, quorum, threshold, voters, weighting, tags."""
        body = _drop_none({"text": text, "payload": payload, **rules})
        return await self.request("POST", "/v1/consensus", body=body)

    async def vote(self, did: str, value: float | bool, *, type: str | None = None,  # noqa: A002
                   reason: str | None = None) -> dict[str, Any]:
        body = _drop_none({"value": value, "type": type, "reason": reason})
        return await self.request("POST", f"/v1/consensus/{quote(did, safe=':')}/votes", body=body)

    async def consensus(self, did: str) -> dict[str, Any]:
        return await self.request("GET", f"/v1/consensus/{quote(did, safe=':')}")

    async def trust(self, agent_did: str) -> dict[str, Any]:
        return await self.request("GET", f"/v1/trust/{quote(agent_did, safe=':')}")

    # -- interests (docs/protocol.md 33) ----------------------------------------------------

    async def interests(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/interests")

    async def set_interests(self, **declared: Any) -> dict[str, Any]:
        """Replace the declaration: mode, classes, tags, senders, topics (lists not given: empty)."""
        return await self.request("PUT", "/v1/interests", body=_drop_none(declared))

    async def reset_interests(self) -> dict[str, Any]:
        """Back to [interests] of the node's configuration."""
        return await self.request("DELETE", "/v1/interests")

    # -- the node ----------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/status")

    async def search(self, q: str, **filters: Any) -> dict[str, Any]:
        """Full-text search: filters class_, tag, sender, since, until, state ("active,contested"), limit."""
        return await self.request("GET", "/v1/search", params={"q": q, **_params(filters)})

    async def recall(self, query: str, *, max_tokens: int, max_bytes: int, **options: Any) -> dict[str, Any]:
        """The budgeted envelope (options: include_contested, why, class, tag, sender, since, until,
        scope; explain=True: only the content-free explanation)."""
        return await self.request("POST", "/v1/recall", body={"query": query, "max_tokens": max_tokens,
                                                               "max_bytes": max_bytes, **_drop_none(options)})

    async def recall_plan(self, query: str, *, max_tokens: int, max_bytes: int, **options: Any) -> dict[str, Any]:
        return await self.request("POST", "/v1/recall/plan", body={"query": query, "max_tokens": max_tokens,
                                                                    "max_bytes": max_bytes, **_drop_none(options)})

    async def recall_resolve(self, plan: str) -> dict[str, Any]:
        """The planned content, or ApiError 409 stale_plan when anything it selected changed."""
        return await self.request("POST", "/v1/recall/resolve", body={"plan": plan})

    async def forget(self, *, did: str | None = None, source: str | None = None,
                     scope: str | None = None) -> dict[str, Any]:
        """Erase one container, everything stored with a source label, or a scope (give one):
        {"forgotten", "tombstoned", "already_forgotten"}."""
        return await self.request("POST", "/v1/forget", body=_drop_none({"did": did, "source": source, "scope": scope}))

    async def accept_into_scope(self, scope: str, did: str) -> dict[str, Any]:
        """Take a held container (any sender's) into a scope."""
        return await self.request("POST", f"/v1/scopes/{quote(scope, safe=':')}/accept", body={"did": did})

    async def journal_add(self, text: str, *, title: str | None = None, tags: list[str] | None = None) -> dict[str, Any]:
        return await self.request("POST", "/v1/journal", body=_drop_none({"text": text, "title": title, "tags": tags}))

    async def journal_verify(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/journal/verify")

    async def journal_load(self, max_tokens: int, *, include_routine: bool = False) -> dict[str, Any]:
        return await self.request("GET", "/v1/journal/load",
                                  params={"max_tokens": str(max_tokens), "include_routine": _param(include_routine)})

    async def journal_anchor(self, day: str) -> dict[str, Any]:
        return await self.request("POST", "/v1/journal/anchor", body={"date": day})

    async def peers(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/peers")

    async def static_peers(self) -> dict[str, Any]:
        """The static peers the node keeps connected ([peer] static and those added here)."""
        return await self.request("GET", "/v1/peers/static")

    async def add_static_peer(self, spec: str) -> dict[str, Any]:
        """Keep `tcp://host:port` or `did:…@tcp://host:port` connected (saved in the data dir)."""
        return await self.request("POST", "/v1/peers/static", body={"peer": spec})

    async def remove_static_peer(self, spec_or_did: str) -> dict[str, Any]:
        return await self.request("DELETE", "/v1/peers/static", body={"peer": spec_or_did})

    async def peer_index(self, did: str, **filters: Any) -> dict[str, Any]:
        """One page of a connected peer's container index: {"entries", "status", "complete",
        "cursor", ...}. Filters: class_, subclass, tag, sender, related, relation, since,
        until, cursor, limit."""
        return await self.request("GET", f"/v1/peers/{quote(did, safe=':')}/index", params=_params(filters))

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/health")

    async def metrics(self) -> str:
        return await self.request("GET", "/metrics", text=True)

    async def shutdown(self, reason: str | None = None) -> dict[str, Any]:
        """Ask the node to stop cleanly (it answers, then stops; `hmpnode stop` waits for
        it); `reason`: who asks, for the node's log."""
        return await self.request("POST", "/v1/shutdown", body=_drop_none({"reason": reason}))

    async def log_level(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/log-level")

    async def set_log_level(self, level: str) -> dict[str, Any]:
        """Log at `level` until SIGHUP or a restart (not saved in the settings)."""
        return await self.request("PUT", "/v1/log-level", body={"level": level})

    # -- events --------------------------------------------------------------------------

    def _refresh_address(self) -> None:
        """After a lost connection: the node may have restarted on another port."""
        if self._data_dir is None:
            return
        try:
            info, token = read_node_file(self._data_dir)
        except ClientError:
            return
        self.url, self.token, self.node_info = info["api"]["url"].rstrip("/"), token, info

    async def events(
        self,
        *,
        cursor: str | int | None = None,
        max_retries: int = 8,
        backoff: float = 0.25,
        max_backoff: float = 5.0,
        **filters: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """The node's event stream (SSE), forever: each event's JSON data as a dict
        with its `cursor` (the SSE id) and `event` (the SSE event type) added.
        Filters: class_, tag, to_me, sender. Resumes after `cursor`.

        A lost connection is re-established with Last-Event-ID, so nothing is
        missed or repeated; after `max_retries` consecutive failures (waits
        growing from `backoff` to `max_backoff` seconds) ClientError is raised.
        HTTP errors other than 5xx raise ApiError at once."""
        params = _params(filters)
        last = None if cursor is None else str(cursor)
        failures = 0
        while True:
            headers = self._headers({"Accept": "text/event-stream", "Cache-Control": "no-cache"})
            if last is not None:
                headers["Last-Event-ID"] = last
            try:
                async with self._get_session().get(
                    self.url + "/v1/events",
                    params=params,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                ) as resp:
                    if resp.status >= 400:
                        error = await self._error(resp)
                        if resp.status < 500:
                            raise error
                        raise _Retry(str(error))
                    failures = 0
                    async for name, event_id, data in _sse(resp.content):
                        if event_id is not None:
                            last = event_id
                        try:
                            doc = orjson.loads(data) if data else None
                        except orjson.JSONDecodeError:
                            doc = {"data": data}
                        if not isinstance(doc, dict):
                            doc = {"data": doc}
                        yield {**doc, "event": name, "cursor": event_id if event_id is not None else last}
                    problem = "the node closed the event stream"
            except _Retry as exc:
                problem = str(exc)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            failures += 1
            if failures > max_retries:
                raise ClientError(f"event stream from {self.url} lost: {problem} (gave up after {max_retries} retries)")
            delay = min(max_backoff, backoff * 2 ** (failures - 1))
            await asyncio.sleep(delay * (0.75 + random.random() / 2))
            self._refresh_address()


class _Retry(Exception):
    pass


_MAX_SSE_LINE = 64 * 1024 * 1024


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[str]:
    """Lines of any length (StreamReader.readline stops at 128 KiB; a container may be bigger)."""
    buffer = bytearray()
    start = 0  # where to look for the next newline
    async for chunk in stream.iter_any():
        buffer += chunk
        while True:
            cut = buffer.find(b"\n", start)
            if cut < 0:
                start = len(buffer)
                break
            line = bytes(buffer[:cut])
            del buffer[:cut + 1]
            start = 0
            yield line.rstrip(b"\r").decode("utf-8", "replace")
        if len(buffer) > _MAX_SSE_LINE:
            raise aiohttp.ClientPayloadError(f"event stream line longer than {_MAX_SSE_LINE} bytes")


async def _sse(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[str, str | None, str]]:
    """(event type, id, data) of each event of a text/event-stream body."""
    name, event_id, data = "", None, []
    async for line in _lines(stream):
        if not line:
            if data:
                yield name or "message", event_id, "\n".join(data)
            name, data = "", []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value
        elif field == "id" and "\0" not in value:
            event_id = value
        # "retry" and unknown fields: ignored
    # end of stream: a partial event is dropped, as the SSE spec says
