"""The container index on request (spec 5.1, 5.7, 12.9; docs/protocol.md 31), sans-IO.

A peer asks for our `container_index` with a `container_request` whose payload is
empty (spec 12.9.1) or carries `request_container_selection` (12.9.2), optionally
with our extensions `index_after` (the cursor of the previous page), `index_limit`
(at most this many entries) and `index_nonce` (two equal requests stay two
messages). We answer with two MCE messages, both
with `related.in_reply_to` = the request's container DID:

- a `container_index`: DID -> entry (spec 5.1: the head mirror, the published part
  of `meta`, every relation of `related`, `referenced-by_hash`/`evaluations_hash`
  of our local blocks), only of containers the peer may be sent (the gossip's own
  scope check) and that match the selection;
- a `container_response` `{"available": [], "selection_status": "processed" |
  "declined", "index_cursor", "complete"}` (12.9.3), which closes the answer.

Everything here is pure: parsing and matching of selections, the entry of a
stored container, the page (which rows, the cursor), and reading the version
edges out of a peer's entries. The mesh reads the store and the sessions send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from hmpnode.container.backlinks import links_from_related, referenced_by_hash, sort_links
from hmpnode.container.encoding import EncodingError, parse_time
from hmpnode.container.evaluations import evaluations_hash
from hmpnode.net import mce as M

__all__ = [
    "MAX_SELECTIONS", "MAX_LIST", "REQUEST_KEYS", "Selection", "IndexQuery", "SelectionError", "Page",
    "is_index_request", "parse_query", "request_payload", "published_meta", "entry_of", "block_hashes", "page", "version_edges",
]

#: selections of one request, and DIDs/tags/senders one selection field may list
MAX_SELECTIONS = 16
MAX_LIST = 64
#: the payload members an index request may carry (12.9 and our extensions: paging, and a
#: nonce that keeps two equal requests in one second apart: MCE messages are content-addressed)
REQUEST_KEYS = frozenset({"request_container_selection", "index_after", "index_limit", "index_nonce"})
#: the selection members read (spec 12.9.2 plus hmpnode's: docs/protocol.md 31.2)
SELECTION_KEYS = frozenset({"timestamp_begin", "timestamp_end", "class", "subclass", "tags", "sender_did",
                            "related_to", "relation"})
#: `meta` members an index publishes (spec 5.1 item 4); the others stay in the container
_META_PUBLISHED = ("created_by", "agents_class")
#: what the container_index class schema requires of an entry's head (schemas/classes), and
#: its longest meta text: an entry that breaks the schema would make the peer refuse the whole answer
_HEAD_REQUIRED = ("class", "sender_did", "public_key", "sig_algo", "signature", "payload_hash")
_META_TEXT = 1024


class SelectionError(ValueError):
    """A selection we cannot read: the request is declined (not an offence: 12.9 is a hint)."""


def _strings(value: Any, name: str, *, did: bool = False) -> tuple[str, ...]:
    """A string or a list of at most MAX_LIST strings (DIDs when `did`)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or len(items) > MAX_LIST:
        raise SelectionError(f"{name}: a string or a list of 1..{MAX_LIST} strings")
    for item in items:
        if not isinstance(item, str) or not item or len(item) > 512 or (did and not item.startswith("did:")):
            raise SelectionError(f"{name}: {'DIDs' if did else 'non-empty strings'} of at most 512 characters")
    return tuple(dict.fromkeys(items))


def _time(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value)
    except (EncodingError, TypeError, ValueError):
        raise SelectionError(f"{name}: an RFC 3339 UTC timestamp or null") from None


@dataclass(frozen=True, slots=True)
class Selection:
    """One selection object (12.9.2): every member given must hold (AND); a list
    member (sender_did, related_to) matches any of its values, `tags` all of them."""

    class_: str | None = None
    subclass: str | None = None
    tags: tuple[str, ...] = ()
    senders: tuple[str, ...] = ()
    begin: datetime | None = None  # head.timestamp >= begin
    end: datetime | None = None  # head.timestamp < end
    related_to: tuple[str, ...] = ()  # `related` points at one of these
    relation: str | None = None  # ... by this relation (alone: has this relation at all)
    ignored: tuple[str, ...] = ()  # members we do not read

    @classmethod
    def parse(cls, raw: Any) -> Selection:
        if not isinstance(raw, dict):
            raise SelectionError("a selection is an object")
        class_, subclass, relation = raw.get("class"), raw.get("subclass"), raw.get("relation")
        for name, value in (("class", class_), ("subclass", subclass), ("relation", relation)):
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= 128):
                raise SelectionError(f"{name}: a string of 1..128 characters")
        return cls(
            class_=class_,
            subclass=subclass,
            tags=_strings(raw["tags"], "tags") if raw.get("tags") is not None else (),
            senders=_strings(raw["sender_did"], "sender_did", did=True) if raw.get("sender_did") is not None else (),
            begin=_time(raw.get("timestamp_begin"), "timestamp_begin"),
            end=_time(raw.get("timestamp_end"), "timestamp_end"),
            related_to=_strings(raw["related_to"], "related_to", did=True) if raw.get("related_to") is not None
            else (),
            relation=relation,
            ignored=tuple(sorted(str(k)[:64] for k in raw if k not in SELECTION_KEYS))[:MAX_LIST],
        )

    def matches(self, hmp: Mapping[str, Any]) -> bool:
        """Does the container (its `hmp_container`) match? Never raises on a stored container."""
        head = hmp.get("head") or {}
        if self.class_ is not None and head.get("class") != self.class_:
            return False
        if self.subclass is not None and head.get("subclass") != self.subclass:
            return False
        if self.tags:
            tags = head.get("tags") if isinstance(head.get("tags"), list) else []
            if not all(t in tags for t in self.tags):
                return False
        if self.senders and head.get("sender_did") not in self.senders:
            return False
        if self.begin is not None or self.end is not None:
            try:
                moment = parse_time(head.get("timestamp"))
            except (EncodingError, TypeError, ValueError):
                return False
            if (self.begin is not None and moment < self.begin) or (self.end is not None and moment >= self.end):
                return False
        if self.related_to or self.relation is not None:
            links = links_from_related(str(head.get("container_did", "")), hmp.get("related"))
            if not any((self.relation is None or rel == self.relation) and (not self.related_to or t in self.related_to)
                       for rel, t in links):
                return False
        return True


@dataclass(frozen=True, slots=True)
class IndexQuery:
    """A parsed index request: no selection means everything we may give the peer."""

    selections: tuple[Selection, ...] = ()
    after: int = 0  # the cursor: rows after this store seq
    limit: int | None = None  # the requester's own bound on entries

    @property
    def ignored(self) -> list[str]:
        return sorted({name for s in self.selections for name in s.ignored})

    def matches(self, hmp: Mapping[str, Any]) -> bool:
        return not self.selections or any(s.matches(hmp) for s in self.selections)

    def prefilter(self) -> dict[str, Any]:
        """The store filters (ListQuery members) every match satisfies: only with a single
        selection (several are OR-ed), and only its single-valued members."""
        if len(self.selections) != 1:
            return {}
        s = self.selections[0]
        out: dict[str, Any] = {}
        if s.class_ is not None:
            out["class_"] = s.class_
        if s.tags:
            out["tag"] = s.tags[0]
        if len(s.senders) == 1:
            out["sender"] = s.senders[0]
        if len(s.related_to) == 1:
            out["related_to"] = s.related_to[0]
        if s.begin is not None:
            out["since"] = s.begin
        if s.end is not None:
            out["until"] = s.end
        return out


def is_index_request(payload: Mapping[str, Any]) -> bool:
    """An empty `container_request` (12.9.1; our paging members aside) or one with a selection (12.9.2)."""
    return "request_container_selection" in payload or set(payload) <= REQUEST_KEYS


def parse_query(payload: Mapping[str, Any]) -> IndexQuery:
    """The index request in a `container_request` payload; SelectionError when unreadable."""
    raw = payload.get("request_container_selection", [])
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list) or len(raw) > MAX_SELECTIONS:
        raise SelectionError(f"request_container_selection: a list of at most {MAX_SELECTIONS} objects")
    after = payload.get("index_after", "")
    if not (isinstance(after, str) and len(after) <= 18 and (after == "" or (after.isascii() and after.isdigit()))):
        raise SelectionError("index_after: a cursor this node gave out")
    limit = payload.get("index_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SelectionError("index_limit: a positive integer")
    return IndexQuery(tuple(Selection.parse(s) for s in raw), int(after or 0), limit)


def request_payload(selections: Sequence[Mapping[str, Any]], *, after: str | None = None,
                    limit: int | None = None, nonce: str | None = None) -> dict[str, Any]:
    """The `container_request` payload that asks a peer for its index (requester side)."""
    payload: dict[str, Any] = {"request_container_selection": [dict(s) for s in selections]} if selections else {}
    if nonce:
        payload["index_nonce"] = nonce
    if after:
        payload["index_after"] = after
    if limit is not None:
        payload["index_limit"] = limit
    return payload


def published_meta(meta: Any) -> dict[str, Any]:
    """The part of `meta` an index publishes (spec 5.1 item 4): created_by, agents_class,
    abstraction as its flattened path of DIDs, axes reduced to DID -> number."""
    def text(value: Any) -> bool:
        return isinstance(value, str) and len(value) <= _META_TEXT

    if not isinstance(meta, dict):
        return {}
    out = {k: meta[k] for k in _META_PUBLISHED if text(meta.get(k))}
    abstraction = meta.get("abstraction")
    if isinstance(abstraction, dict):
        flat: dict[str, Any] = {}
        if text(abstraction.get("agents_class")):
            flat["agents_class"] = abstraction["agents_class"]
        path = abstraction.get("path")
        dids = {k: v for k, v in path.items() if text(v) and v.startswith("did:")} if isinstance(path, dict) else {}
        if dids:  # an empty member is omitted, as everywhere in an entry
            flat["path"] = dids
        if flat:
            out["abstraction"] = flat
    axes = meta.get("axes")
    if isinstance(axes, dict):
        reduced = {k: v for k, v in axes.items()
                   if k.startswith("did:") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if reduced:
            out["axes"] = reduced
    return out


def entry_of(hmp: Mapping[str, Any], backlinks: Sequence[tuple[str, str]] = (),
             evaluations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any] | None:
    """The `container_index` entry of a held container (spec 5.1 item 3): the head mirror
    of `mce.index_entry` (what every peer reads today) with `timestamp`/`subclass`, the
    published meta, the whole `related` block (5.1: all relation fields) and the hashes
    of our referenced-by (`backlinks`: (relation, source) pairs) and evaluations blocks.
    None for a container whose head lacks what the class schema requires of an entry
    (a head without `public_key`, whose key the verifier knew otherwise): it is not listed."""
    entry = M.index_entry(hmp)
    head = hmp["head"]
    if not all(k in entry["head"] for k in _HEAD_REQUIRED):
        return None
    for name in ("timestamp", "subclass"):
        if name in head:
            entry["head"][name] = head[name]
    meta = published_meta(hmp.get("meta"))
    if meta:
        entry["meta"] = meta
    if isinstance(hmp.get("related"), dict) and hmp["related"]:
        entry["related"] = hmp["related"]
    entry.update(block_hashes(evaluations, backlinks))
    return entry


def block_hashes(evaluation_items: Sequence[dict[str, Any]], backlinks: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The hashes of a held container's blocks as this node would send them (sections
    12-13): `evaluations_hash`, `referenced-by_hash`, each only when the block is not empty."""
    out = {}
    if evaluation_items:
        out["evaluations_hash"] = evaluations_hash(evaluation_items)
    links = sort_links(backlinks)
    if links:
        out["referenced-by_hash"] = referenced_by_hash(links)
    return out


@dataclass(slots=True)
class Page:
    """One answer: entries in store order, the cursor to ask from next, whether it is the end."""

    entries: dict[str, Any] = field(default_factory=dict)
    cursor: int = 0
    complete: bool = True


def page(rows: Iterable[Any], query: IndexQuery, *, eligible: Callable[[Any], bool],
         entry: Callable[[Any], dict[str, Any] | None], limit: int, max_bytes: int,
         more: Callable[[], bool]) -> Page:
    """The entries of `rows` (store rows with `seq`, `did`, `hmp_container`, in seq order
    after `query.after`; read lazily) the peer may be sent (`eligible`: the gossip's scope
    check) and that match, at most `limit` of them and `max_bytes` of JSON; `more()`, asked
    once `rows` ran out: the read stopped at its bound, so rows may follow. The cursor is
    the last row looked at."""
    out = Page(cursor=query.after)
    size = 0
    for row in rows:
        if len(out.entries) >= limit:
            out.complete = False
            return out
        made = entry(row) if query.matches(row.hmp_container) and eligible(row) else None
        if made is not None:
            n = len(orjson.dumps(made)) + len(row.did) + 4
            if out.entries and size + n > max_bytes:
                out.complete = False
                return out
            out.entries[row.did] = made
            size += n
        out.cursor = row.seq
    out.complete = not more()
    return out


def version_edges(entries: Mapping[str, Any], parents: Iterable[str]) -> list[tuple[str, str, str]]:
    """(child, parent, child's sender) of the entries of a peer's index whose
    `related.previous_version` names one of `parents` (spec 5.7 item 2). A peer's
    entries are untrusted: anything malformed is skipped."""
    wanted = set(parents)
    out = []
    for did, entry in entries.items():
        if not (isinstance(did, str) and did.startswith("did:") and isinstance(entry, dict)):
            continue
        head = entry.get("head")
        sender = head.get("sender_did") if isinstance(head, dict) else None
        if not isinstance(sender, str) or not sender:
            continue
        for relation, target in links_from_related(did, entry.get("related")):
            if relation == "previous_version" and target in wanted:
                out.append((did, target, sender))
    return out
