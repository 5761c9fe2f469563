"""Signed DHT records and the bounded store that holds them (sans-IO).

The Kademlia DHT (`hmpnode.net.dht`) carries only small signed pointers, never
containers: where an agent's node listens (`peer`), which agents hold a
container (`provider`), which agents follow a topic (`topic`). Everything here
is pure: no sockets, no clock reads (`now` is a parameter), randomness only
through the caller's `Identity`. `docs/protocol.md` (DHT section) is the wire
description; this docstring is its summary.

Keys (UTF-8 strings; Kademlia's 160-bit id is SHA-1 of the UTF-8 bytes)::

    hmp:peer:<agent DID>          one record: the agent's newest `peer` record
    hmp:prov:<container DID>      a set: one `provider` record per agent DID
    hmp:topic:<topic>             a set: one `topic` record per agent DID

Record (canonical JSON object, at most `max_record_bytes`, default 1024)::

    {"v": 1, "kind": "peer" | "provider" | "topic",
     "did": <signer's self-certifying agent DID>, "public_key": base58btc(32 bytes),
     "timestamp": RFC 3339 UTC, "expires": RFC 3339 UTC,
     peer:     "addresses": [PoW address records, announce.py], "roles": [str], "mailman": [str]
     provider: "container": <container DID>
     topic:    "topic": <topic string>
     "signature": b64url(Ed25519(canonical_json(record - "signature" + {"context": "hmp-dht-record-v1"})))}

No other member is allowed (a later format changes `v`). The key a record
belongs to is derived from its own content (`record_key`): a valid record
stored under another key is refused (`wrong_key`), so nobody can make a
genuine record answer for a key it was not made for.

Why the checks: the DHT wire format is unauthenticated, so every record must
prove itself. The DID must be self-certifying and hash to `public_key` (a
record cannot claim someone else's DID), the signature binds every member
(the context string keeps it from verifying as any other signed HMP object),
`expires` bounds replays (at most `max_lifetime` after `timestamp`), the skew
bound keeps a signer from pre-dating its way past every later record, the
address PoW (profile section 10) makes mass-minted addresses cost something.

Refusal reasons (`RecordError.reason`, stable strings): `too_large`,
`malformed`, `bad_version`, `bad_kind`, `wrong_key`, `bad_time`, `expired`,
`future`, `bad_lifetime`, `bad_did`, `key_mismatch`, `bad_signature`,
`no_valid_address`; the store adds `stale`, `set_full`, `signer_quota`,
`source_quota`, `subnet_quota`, `store_full`.

Newer wins per (key, signer DID): the greater `timestamp`; at an equal
timestamp the greater canonical bytes (so every replica picks the same one).

Who holds the room (`RecordStore`): the *source* of a stored record is the IP
address that sent the STORE (not its signer: DIDs cost nothing, addresses do),
counted in its *group* (`source_group`: the /24 or /64 around it; a loopback
address alone). A full set or a full store makes room by taking from the group
that holds the most (`eviction_group`), so one group, however many DIDs it
mints, cannot push out another that holds fewer; a set is served one record per
group first (`fair_order`), not newest first, so pre-dating wins nothing.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from hmpnode.container.canonical import CanonicalError, canonical_json, loads_strict
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode, format_time, parse_time
from hmpnode.container.structure import DID_RE
from hmpnode.identity.keys import (
    Identity,
    did_matches_key,
    ed25519_verify,
    is_self_certifying_did,
    public_key_from_b58,
)
from hmpnode.net.announce import DEFAULT_MIN_DIFFICULTY, check_address_record, parse_addr
from hmpnode.net.scope import network_of, parse_ip

__all__ = [
    "RECORD_VERSION",
    "SIGNATURE_CONTEXT",
    "KINDS",
    "KEY_PREFIXES",
    "RecordError",
    "RecordTooLarge",
    "RecordLimits",
    "StoreLimits",
    "DhtRecord",
    "PeerRecord",
    "ProviderRecord",
    "TopicRecord",
    "StoreResult",
    "RecordStore",
    "peer_key",
    "provider_key",
    "topic_key",
    "key_id",
    "record_key",
    "build_peer_record",
    "build_provider_record",
    "build_topic_record",
    "verify_record",
    "is_newer",
    "merge_records",
    "encode_record_set",
    "decode_record_set",
    "OWN_GROUP",
    "source_group",
    "eviction_group",
    "fair_order",
    "merge_ranked",
]

RECORD_VERSION = 1
#: Signed in as a `context` member, never sent (same pattern as the handshake transcript).
SIGNATURE_CONTEXT = "hmp-dht-record-v1"
KINDS = ("peer", "provider", "topic")
KEY_PREFIXES = {"peer": "hmp:peer:", "provider": "hmp:prov:", "topic": "hmp:topic:"}

_COMMON = frozenset({"v", "kind", "did", "public_key", "timestamp", "expires", "signature"})
_MEMBERS = {
    "peer": _COMMON | {"addresses", "roles", "mailman"},
    "provider": _COMMON | {"container"},
    "topic": _COMMON | {"topic"},
}
_MAX_DID_CHARS = 256
# record -> addresses list -> address record: depth 3; a set adds the array
_RECORD_DEPTH = 3
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class RecordError(ValueError):
    """A DHT record is refused; `reason` is one of the stable codes above."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class RecordTooLarge(ValueError):
    """A builder's record would exceed `max_record_bytes` (the caller may drop content)."""


@dataclass(frozen=True, slots=True)
class RecordLimits:
    """What a single record may be. Defaults are the wire defaults (docs/protocol.md)."""

    #: canonical JSON bytes of one record, signature included
    max_record_bytes: int = 1024
    #: `expires - timestamp` at most this
    max_lifetime: timedelta = timedelta(hours=24)
    #: `timestamp` at most this far after the reader's clock: the LAN announce
    #: freshness window (120 s); nodes whose clocks differ more do not see each
    #: other's announces either. Newer wins by `timestamp`, so this is also how long
    #: a pre-dated record can stay ahead of its signer's honest later ones.
    max_skew: timedelta = timedelta(seconds=120)
    #: entries of a peer record's `addresses`
    max_addresses: int = 8
    #: entries of `roles` and of `mailman`
    max_list_items: int = 16
    #: characters of one `roles` / `mailman` entry
    max_item_chars: int = 128
    #: characters of a topic
    max_topic_chars: int = 128


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """Bounds of one node's `RecordStore` (not part of the wire format except the set caps,
    which also bound a FIND_VALUE reply)."""

    #: records per key (one per signer DID)
    max_set_entries: int = 16
    #: bytes of a key's JSON array (the FIND_VALUE reply value)
    max_set_bytes: int = 8192
    #: records in the whole store
    max_entries: int = 8192
    #: bytes of all records in the store
    max_bytes: int = 4 * 1024 * 1024
    #: records one signer DID may hold in this store (other nodes' STOREs)
    max_per_signer: int = 64
    #: records one source IP address may have stored here
    max_per_source: int = 512
    #: records one source group (`source_group`: a /24 or /64) may have stored here
    max_per_group: int = 1024
    #: how long a record stored by another node is kept after its last STORE, at most
    #: (its `expires` may be up to 24 h away): honest signers store again every 30 min,
    #: so only records nobody keeps storing go; 2 h is hmpnode's own record lifetime
    max_hold: timedelta = timedelta(hours=2)
    #: prefix lengths of a source group (non-loopback addresses)
    group_prefix_v4: int = 24
    group_prefix_v6: int = 64

    def __post_init__(self) -> None:
        for name in ("max_set_entries", "max_set_bytes", "max_entries", "max_bytes", "max_per_signer",
                     "max_per_source", "max_per_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_hold <= timedelta(0):
            raise ValueError("max_hold must be > 0")
        if not (0 <= self.group_prefix_v4 <= 32 and 0 <= self.group_prefix_v6 <= 128):
            raise ValueError("group prefixes must be 0..32 (IPv4) and 0..128 (IPv6)")


# -- keys --------------------------------------------------------------------


def _check_text(value: Any, what: str, max_chars: int) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= max_chars or _CONTROL.search(value):
        raise ValueError(f"{what} must be a string of 1..{max_chars} characters without control characters")
    return value


def peer_key(did: str) -> str:
    """`hmp:peer:<did>`: where the agent's `peer` record lives."""
    return KEY_PREFIXES["peer"] + _check_text(did, "did", _MAX_DID_CHARS)


def provider_key(container_did: str) -> str:
    """`hmp:prov:<container DID>`: the set of agents that hold the container."""
    return KEY_PREFIXES["provider"] + _check_text(container_did, "container DID", _MAX_DID_CHARS)


def topic_key(topic: str, *, limits: RecordLimits = RecordLimits()) -> str:
    """`hmp:topic:<topic>`: the set of agents that follow the topic. Topics are compared
    as exact strings (no case folding or Unicode normalisation)."""
    return KEY_PREFIXES["topic"] + _check_text(topic, "topic", limits.max_topic_chars)


def key_id(key: str) -> bytes:
    """The 20-byte Kademlia id of a key: SHA-1 of its UTF-8 bytes (kademlia's `digest`)."""
    return hashlib.sha1(key.encode("utf-8")).digest()


# -- records -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DhtRecord:
    """A verified record. `raw` is its canonical JSON (what is stored and sent)."""

    kind: str
    did: str
    public_key: str
    timestamp: datetime
    expires: datetime
    #: the key derived from the record's content (`record_key`)
    key: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class PeerRecord(DhtRecord):
    #: `addr` of each valid address record, in order, without duplicates
    addresses: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    mailman: tuple[str, ...] = ()
    #: (index in `addresses`, reason) of each address record that was dropped
    dropped: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ProviderRecord(DhtRecord):
    container: str = ""


@dataclass(frozen=True, slots=True)
class TopicRecord(DhtRecord):
    topic: str = ""


def record_key(record: dict[str, Any]) -> str:
    """The key a record belongs to, from its own members (ValueError if it has none)."""
    kind = record.get("kind")
    if kind == "peer":
        return peer_key(record.get("did"))  # type: ignore[arg-type]
    if kind == "provider":
        return provider_key(record.get("container"))  # type: ignore[arg-type]
    if kind == "topic":
        return topic_key(record.get("topic"))  # type: ignore[arg-type]
    raise ValueError(f"unknown kind {kind!r:.40}")


def _signing_input(unsigned: dict[str, Any]) -> bytes:
    return canonical_json({**unsigned, "context": SIGNATURE_CONTEXT})


def _build(
    identity: Identity, kind: str, body: dict[str, Any], *, now: datetime, ttl: timedelta, limits: RecordLimits
) -> bytes:
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (UTC)")
    if not timedelta(0) < ttl <= limits.max_lifetime:
        raise ValueError(f"ttl must be in (0, {limits.max_lifetime}]")
    # Emitted times are whole milliseconds; build from the truncated instant so that
    # expires - timestamp is exactly what a reader computes.
    stamp = parse_time(format_time(now))
    unsigned = {
        "v": RECORD_VERSION,
        "kind": kind,
        "did": identity.did,
        "public_key": identity.public_key_b58,
        "timestamp": format_time(stamp),
        "expires": format_time(stamp + ttl),
        **body,
    }
    signature = b64url_encode(identity.sign(_signing_input(unsigned)))
    raw = canonical_json({**unsigned, "signature": signature})
    if len(raw) > limits.max_record_bytes:
        raise RecordTooLarge(f"record is {len(raw)} bytes, more than {limits.max_record_bytes}")
    return raw


def _address_problem(did: str, record: Any, min_difficulty: int) -> str | None:
    """The reason an address record of `did` is unusable here, or None: the
    announce rules (proof of work, announce.check_address_record) and an `addr`
    that `parse_addr` takes (`bad_addr`)."""
    problem = check_address_record(did, record, min_difficulty=min_difficulty)
    if problem is None:
        try:
            parse_addr(record["addr"])
        except ValueError:
            problem = "bad_addr"
    return problem


def build_peer_record(
    identity: Identity,
    *,
    address_records: list[dict[str, Any]],
    roles: Iterable[str] = (),
    mailman: Iterable[str] = (),
    now: datetime,
    ttl: timedelta,
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY,
    limits: RecordLimits = RecordLimits(),
) -> bytes:
    """A signed `peer` record (canonical JSON bytes).

    `address_records` are `announce.make_address_record(identity.did, addr)` results;
    every one must be valid for `identity` at `min_difficulty` (ValueError otherwise:
    a node should not publish what its peers drop)."""
    records = list(address_records)
    if not 1 <= len(records) <= limits.max_addresses:
        raise ValueError(f"a peer record needs 1..{limits.max_addresses} address records")
    for index, rec in enumerate(records):
        problem = _address_problem(identity.did, rec, min_difficulty)
        if problem is not None:
            raise ValueError(f"address_records[{index}]: {problem}")
    body = {
        "addresses": [dict(r) for r in records],
        "roles": _text_list(roles, "roles", limits),
        "mailman": _text_list(mailman, "mailman", limits),
    }
    return _build(identity, "peer", body, now=now, ttl=ttl, limits=limits)


def build_provider_record(
    identity: Identity, container_did: str, *, now: datetime, ttl: timedelta, limits: RecordLimits = RecordLimits()
) -> bytes:
    """A signed `provider` record: `identity` holds `container_did`."""
    if not isinstance(container_did, str) or DID_RE.fullmatch(container_did) is None:
        raise ValueError("container_did must be a DID")
    provider_key(container_did)
    return _build(identity, "provider", {"container": container_did}, now=now, ttl=ttl, limits=limits)


def build_topic_record(
    identity: Identity, topic: str, *, now: datetime, ttl: timedelta, limits: RecordLimits = RecordLimits()
) -> bytes:
    """A signed `topic` record: `identity` follows `topic`."""
    topic_key(topic, limits=limits)
    return _build(identity, "topic", {"topic": topic}, now=now, ttl=ttl, limits=limits)


def _text_list(values: Iterable[str], what: str, limits: RecordLimits) -> list[str]:
    if isinstance(values, str):
        raise ValueError(f"{what} is a list of strings")
    out = [_check_text(v, what, limits.max_item_chars) for v in values]
    if len(out) > limits.max_list_items:
        raise ValueError(f"{what}: at most {limits.max_list_items} entries")
    return out


def _is_text_list(value: Any, limits: RecordLimits) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= limits.max_list_items
        and all(
            isinstance(v, str) and 1 <= len(v) <= limits.max_item_chars and not _CONTROL.search(v) for v in value
        )
    )


def verify_record(
    value: bytes | str | dict[str, Any],
    *,
    now: datetime,
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY,
    limits: RecordLimits = RecordLimits(),
    key: str | None = None,
    key_id_: bytes | None = None,
) -> DhtRecord:
    """Check one record and return its typed, verified form; RecordError otherwise.

    `value` is the record's JSON text (as received in a STORE) or an already parsed
    object (an element of a FIND_VALUE array). `key` / `key_id_`: the key (or its
    Kademlia id) the record was stored under or asked for; it must be the record's
    own key. Checks in order, cheap before costly: size, JSON (strict: no duplicate
    keys, no unsafe integers), shape, key, times, DID/key binding, signature, then
    the PoW of every address record (invalid ones are dropped; none left is
    `no_valid_address`). Never raises anything but RecordError on the value."""
    if isinstance(value, dict):
        obj = value
    else:
        if isinstance(value, str):
            try:
                data = value.encode("utf-8")
            except UnicodeEncodeError:
                raise RecordError("malformed", "not UTF-8 text") from None
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        else:
            raise RecordError("malformed", f"a record is JSON text, not {type(value).__name__}")
        if len(data) > limits.max_record_bytes:
            raise RecordError("too_large", f"{len(data)} bytes > {limits.max_record_bytes}")
        try:
            obj, _ = loads_strict(data, max_depth=_RECORD_DEPTH)
        except CanonicalError as exc:
            raise RecordError("malformed", str(exc)[:120]) from None
    if not isinstance(obj, dict):
        raise RecordError("malformed", "a record is a JSON object")
    kind = obj.get("kind")
    if kind not in _MEMBERS:
        raise RecordError("bad_kind", f"kind {kind!r:.40}")
    if obj.keys() != _MEMBERS[kind]:
        raise RecordError("malformed", f"members of a {kind} record must be exactly {sorted(_MEMBERS[kind])}")
    version = obj["v"]
    if type(version) is not int or version != RECORD_VERSION:
        raise RecordError("bad_version", f"v {version!r:.20}")
    did, public_key, signature = obj["did"], obj["public_key"], obj["signature"]
    if not all(isinstance(x, str) for x in (did, public_key, signature, obj["timestamp"], obj["expires"])):
        raise RecordError("malformed", "did, public_key, timestamp, expires and signature are strings")
    if kind == "peer":
        if not isinstance(obj["addresses"], list) or not 1 <= len(obj["addresses"]) <= limits.max_addresses:
            raise RecordError("malformed", f"addresses must be a list of 1..{limits.max_addresses} records")
        if not _is_text_list(obj["roles"], limits) or not _is_text_list(obj["mailman"], limits):
            raise RecordError("malformed", "roles and mailman must be short lists of short strings")
    elif kind == "provider":
        container = obj["container"]
        if not isinstance(container, str) or len(container) > _MAX_DID_CHARS or DID_RE.fullmatch(container) is None:
            raise RecordError("malformed", "container must be a DID")
    elif not isinstance(obj["topic"], str) or not 1 <= len(obj["topic"]) <= limits.max_topic_chars:
        raise RecordError("malformed", f"topic must be a string of 1..{limits.max_topic_chars} characters")
    try:
        own_key = record_key(obj)
    except ValueError as exc:
        raise RecordError("malformed", str(exc)) from None
    if (key is not None and key != own_key) or (key_id_ is not None and key_id(own_key) != key_id_):
        raise RecordError("wrong_key", f"the record belongs to {own_key[:80]!r}")
    try:
        raw = canonical_json(obj) if isinstance(value, dict) else canonical_json(obj, max_depth=_RECORD_DEPTH)
    except CanonicalError as exc:
        raise RecordError("malformed", str(exc)[:120]) from None
    if len(raw) > limits.max_record_bytes:
        raise RecordError("too_large", f"{len(raw)} canonical bytes > {limits.max_record_bytes}")
    try:
        timestamp = parse_time(obj["timestamp"])
        expires = parse_time(obj["expires"])
    except EncodingError as exc:
        raise RecordError("bad_time", str(exc)) from None
    if expires <= now:
        raise RecordError("expired", f"expired at {obj['expires']}")
    if timestamp > now + limits.max_skew:
        raise RecordError("future", f"timestamp {obj['timestamp']} is after now + {limits.max_skew}")
    if not timestamp < expires <= timestamp + limits.max_lifetime:
        raise RecordError("bad_lifetime", f"expires must be after timestamp, by at most {limits.max_lifetime}")
    if len(did) > _MAX_DID_CHARS or not is_self_certifying_did(did):
        raise RecordError("bad_did", "did must be a self-certifying agent DID")
    try:
        key_bytes = public_key_from_b58(public_key)
        sig = b64url_decode(signature)
    except EncodingError as exc:
        raise RecordError("malformed", str(exc)) from None
    if not did_matches_key(did, key_bytes):
        raise RecordError("key_mismatch", "did does not hash to public_key")
    unsigned = {k: v for k, v in obj.items() if k != "signature"}
    if not ed25519_verify(key_bytes, _signing_input(unsigned), sig):
        raise RecordError("bad_signature", "Ed25519 signature does not verify")
    # A copy of its own size: orjson (3.13, measured) returns its output in a buffer of
    # at least 4 KiB, and a stored record is kept for hours (8192 of them: 32 MiB, not 3).
    raw = bytes(memoryview(raw))
    common = dict(kind=kind, did=did, public_key=public_key, timestamp=timestamp, expires=expires, key=own_key, raw=raw)
    if kind == "provider":
        return ProviderRecord(**common, container=obj["container"])
    if kind == "topic":
        return TopicRecord(**common, topic=obj["topic"])
    addresses: list[str] = []
    dropped: list[tuple[int, str]] = []
    for index, rec in enumerate(obj["addresses"]):
        problem = _address_problem(did, rec, min_difficulty)
        if problem is not None:
            dropped.append((index, problem))
        elif rec["addr"] not in addresses:
            addresses.append(rec["addr"])
    if not addresses:
        raise RecordError("no_valid_address", "; ".join(f"addresses[{i}]: {r}" for i, r in dropped))
    return PeerRecord(
        **common, addresses=tuple(addresses), roles=tuple(obj["roles"]), mailman=tuple(obj["mailman"]),
        dropped=tuple(dropped),
    )


# -- merging -----------------------------------------------------------------


def is_newer(candidate: DhtRecord, current: DhtRecord) -> bool:
    """True when `candidate` replaces `current` (same key and signer): a later
    `timestamp`, or the same one and greater canonical bytes (a total order, so
    every replica converges on the same record)."""
    return (candidate.timestamp, candidate.raw) > (current.timestamp, current.raw)


def merge_records(
    records: Iterable[DhtRecord], *, max_entries: int | None = None, max_bytes: int | None = None
) -> list[DhtRecord]:
    """Newest record per (key, signer), newest first; then, if bounded, the newest that
    fit: at most `max_entries`, and a JSON array of them of at most `max_bytes`
    (a record too big for the space left is skipped, smaller older ones may follow)."""
    best: dict[tuple[str, str], DhtRecord] = {}
    for rec in records:
        current = best.get((rec.key, rec.did))
        if current is None or is_newer(rec, current):
            best[(rec.key, rec.did)] = rec
    ordered = sorted(best.values(), key=lambda r: (r.timestamp, r.raw), reverse=True)
    if max_entries is None and max_bytes is None:
        return ordered
    out: list[DhtRecord] = []
    size = 2  # "[" and "]"
    for rec in ordered:
        if max_entries is not None and len(out) >= max_entries:
            break
        grow = len(rec.raw) + (1 if out else 0)
        if max_bytes is not None and size + grow > max_bytes:
            continue
        out.append(rec)
        size += grow
    return out


def encode_record_set(records: Iterable[DhtRecord]) -> bytes:
    """The JSON array of the records' canonical texts (canonical itself)."""
    return b"[" + b",".join(r.raw for r in records) + b"]"


def decode_record_set(
    value: Any,
    *,
    now: datetime,
    key: str,
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY,
    limits: RecordLimits = RecordLimits(),
    max_items: int = 64,
) -> tuple[list[DhtRecord], int]:
    """Verify a FIND_VALUE reply value for `key`: a JSON array of records (or, from a
    peer that stores values verbatim, a single record object).

    Returns (valid records, number refused). Every element is checked on its own
    with `verify_record`; elements past `max_items` are refused unread. Never raises."""
    if isinstance(value, str):
        try:
            value = value.encode("utf-8")
        except UnicodeEncodeError:
            return [], 1
    if not isinstance(value, bytes):
        return [], 1
    try:
        parsed, _ = loads_strict(value, max_depth=_RECORD_DEPTH + 1)
    except CanonicalError:
        return [], 1
    items = parsed if isinstance(parsed, list) else [parsed]
    refused = max(0, len(items) - max_items)
    good: list[DhtRecord] = []
    for item in items[:max_items]:
        try:
            good.append(verify_record(item, now=now, min_difficulty=min_difficulty, limits=limits, key=key))
        except RecordError:
            refused += 1
    return good, refused


# -- fairness ----------------------------------------------------------------


def _newest(record: DhtRecord) -> tuple[datetime, bytes]:
    return (record.timestamp, record.raw)


#: the group of this node's own records (not an IP network text, so never a source's)
OWN_GROUP = "own"


def source_group(source: str | None, *, v4_prefix: int = 24, v6_prefix: int = 64) -> str:
    """The group a STORE's sender counts in: the /24 (IPv4) or /64 (IPv6) network
    around it, as text. One host or one customer of a provider usually has a whole
    /24 or /64, so caps per address alone would be caps per address *they choose*.
    A loopback address is a group by itself (on one host the nodes are told apart
    by their 127.x address; no other host can send from it). `None` (this node's
    own records) is `OWN_GROUP`; text that is no IP address is its own group."""
    if source is None:
        return OWN_GROUP
    addr = parse_ip(source)
    if addr is None:
        return source
    if addr.is_loopback:
        return str(addr)
    return network_of(addr, v4_prefix, v6_prefix)


def eviction_group(counts: Mapping[str, int], group: str) -> str | None:
    """Which group gives up one entry so that one from `group` fits, or None (refuse).

    The group holding the most entries (ties: the greater name, so that every
    replica decides alike), if it holds at least two more than `group`: only then
    does the move make the holdings more even, so a group can never push out one
    that holds fewer, and equals do not take turns evicting each other. Otherwise
    `group` makes room among its own entries, if it holds any. `OWN_GROUP` (this
    node's own records) is never chosen for another group; as `group` it takes
    from the largest other group."""
    mine = counts.get(group, 0)
    best: str | None = None
    for g, n in counts.items():
        if g == OWN_GROUP or g == group or n <= 0:
            continue
        if best is None or (n, g) > (counts[best], best):
            best = g
    if best is not None and (group == OWN_GROUP or counts[best] >= mine + 2):
        return best
    return group if mine > 0 else None


def fair_order(items: Iterable[tuple[str, DhtRecord]]) -> list[DhtRecord]:
    """`(group, record)` pairs in serving order: one record per group first. Round r
    holds the r-th newest record of every group that has that many, newest first
    within the round. Many DIDs (or later timestamps) from one group therefore
    come after the first record of every other group."""
    lanes: dict[str, list[DhtRecord]] = {}
    for group, record in items:
        lanes.setdefault(group, []).append(record)
    queues = [sorted(recs, key=_newest, reverse=True) for recs in lanes.values()]
    out: list[DhtRecord] = []
    for depth in range(max((len(q) for q in queues), default=0)):
        out.extend(sorted((q[depth] for q in queues if len(q) > depth), key=_newest, reverse=True))
    return out


def merge_ranked(answers: Iterable[Sequence[DhtRecord]]) -> list[DhtRecord]:
    """Merge record sets from several holders (each in its serving order, `fair_order`):
    the newest record per (key, signer), ordered by the best position any holder gave
    that signer, then newest first. A reader cannot see who stored what at a holder,
    but keeps each holder's fairness: a record an honest holder serves first is not
    pushed behind the many records of one group served by another."""
    best: dict[tuple[str, str], DhtRecord] = {}
    rank: dict[tuple[str, str], int] = {}
    for answer in answers:
        for index, record in enumerate(answer):
            slot = (record.key, record.did)
            current = best.get(slot)
            if current is None or is_newer(record, current):
                best[slot] = record
            if index < rank.get(slot, index + 1):
                rank[slot] = index
    out = sorted(best.values(), key=_newest, reverse=True)
    out.sort(key=lambda r: rank[(r.key, r.did)])
    return out


# -- the store ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of `RecordStore.put`: `accepted` is what a STORE reply says.
    `reason` names a refusal, or is `duplicate` for a record already held.
    `evicted`: records of others dropped to make room for this one."""

    accepted: bool
    reason: str | None = None
    record: DhtRecord | None = None
    evicted: int = 0


@dataclass(slots=True, eq=False)
class _Entry:
    kid: bytes
    record: DhtRecord
    #: the IP address the STORE came from; None for this node's own records
    source: str | None
    group: str
    #: the last STORE of this very record from its source (what `max_hold` counts from)
    stored_at: datetime
    drop_at: datetime
    seq: int


class RecordStore:
    """A node's DHT storage: only verified records, bounded everywhere, shared fairly.

    - Every value is verified (`verify_record`) against the key it is stored under.
    - Per (key, signer DID) the newer record wins; an older or equal one is refused
      (`stale`), the identical one is accepted as already held (`duplicate`; from the
      same source it counts as a fresh STORE for `max_hold` and eviction order).
    - Sources: `source` is the IP address the STORE came from (`None`: this node's
      own records, which skip quotas and are never evicted), counted in its group
      (`source_group`; own records in `OWN_GROUP`). Quotas: `max_per_signer` records per signer DID,
      `max_per_source` per address, `max_per_group` per group (`signer_quota`,
      `source_quota`, `subnet_quota`).
    - Per key a set of at most `max_set_entries` records in at most `max_set_bytes`.
      When a new signer does not fit, the group holding the most records of the set
      gives up its oldest (`eviction_group`); if that would be the newcomer's own
      group, its oldest record of the set or the newcomer itself goes (`set_full`).
    - Totals `max_entries` and `max_bytes`: when full, the group holding the most
      records gives up its least recently stored one, on the same rule
      (`store_full` only when nothing may go). A flood from a few groups thus
      evicts itself, never the few records of the others.
    - A record of another node is kept until its `expires`, or `max_hold` after its
      last STORE, whichever comes first; expired ones are dropped (`cull`, also run
      by every `put` and read).
    - A set is served in `fair_order` (one record per group first).
    """

    def __init__(
        self,
        *,
        own_did: str,
        min_difficulty: int = DEFAULT_MIN_DIFFICULTY,
        record_limits: RecordLimits = RecordLimits(),
        limits: StoreLimits = StoreLimits(),
    ):
        self.own_did = own_did
        self.min_difficulty = min_difficulty
        self.record_limits = record_limits
        self.limits = limits
        self._sets: dict[bytes, dict[str, _Entry]] = {}
        self._per_signer: Counter[str] = Counter()
        self._per_source: Counter[str] = Counter()
        self._per_group: Counter[str] = Counter()
        #: per group its entries, least recently stored first (eviction order)
        self._lru: dict[str, dict[int, _Entry]] = {}
        self._count = 0
        self._bytes = 0
        #: this node's own records held (source None)
        self._own = 0
        self._expiry: list[tuple[datetime, int, bytes, str]] = []
        self._seq = itertools.count()

    def group_of(self, source: str | None) -> str:
        return source_group(source, v4_prefix=self.limits.group_prefix_v4, v6_prefix=self.limits.group_prefix_v6)

    # - writing -

    def put(self, kid: bytes, value: Any, *, now: datetime, source: str | None) -> StoreResult:
        """Verify `value` (one record's JSON text) for key id `kid` and keep it if it wins."""
        try:
            record = verify_record(
                value, now=now, min_difficulty=self.min_difficulty, limits=self.record_limits, key_id_=kid
            )
        except RecordError as exc:
            return StoreResult(False, exc.reason)
        return self.put_record(kid, record, now=now, source=source)

    def put_record(self, kid: bytes, record: DhtRecord, *, now: datetime, source: str | None) -> StoreResult:
        """Keep an already verified `record` (its key id must be `kid`) if it wins."""
        if key_id(record.key) != kid:
            return StoreResult(False, "wrong_key")
        if record.expires <= now:
            return StoreResult(False, "expired")
        self.cull(now)
        limits = self.limits
        group = self.group_of(source)
        entries = self._sets.get(kid, {})
        current = entries.get(record.did)
        if current is not None:
            if current.record.raw == record.raw:
                if source is not None and current.source == source:
                    self._refresh(current, now)
                return StoreResult(True, "duplicate", record)
            if not is_newer(record, current.record):
                return StoreResult(False, "stale")
        if source is not None:
            if current is None and self._per_signer[record.did] >= limits.max_per_signer:
                return StoreResult(False, "signer_quota")
            if (current is None or current.source != source) and self._per_source[source] >= limits.max_per_source:
                return StoreResult(False, "source_quota")
            if (
                group != source
                and (current is None or current.group != group)
                and self._per_group[group] >= limits.max_per_group
            ):
                return StoreResult(False, "subnet_quota")
        set_room = self._set_room(entries, record, group)
        if set_room is None:
            return StoreResult(False, "set_full")
        gone = set_room + ([current] if current is not None else [])
        count = self._count + 1 - len(gone)
        size = self._bytes + len(record.raw) - sum(len(e.record.raw) for e in gone)
        store_room: list[_Entry] = []
        if count > limits.max_entries or size > limits.max_bytes:
            room = self._store_room(group, count, size, gone)
            if room is None:
                return StoreResult(False, "store_full")
            store_room = room
        for entry in gone + store_room:
            self._drop(entry)
        if source is None:
            drop_at = record.expires
        else:
            drop_at = min(record.expires, now + limits.max_hold)
        entry = _Entry(kid, record, source, group, now, drop_at, next(self._seq))
        self._sets.setdefault(kid, {})[record.did] = entry
        self._count += 1
        self._bytes += len(record.raw)
        self._per_signer[record.did] += 1
        if source is not None:
            self._per_source[source] += 1
            self._per_group[group] += 1
            self._lru.setdefault(group, {})[entry.seq] = entry
        else:
            self._own += 1
        self._schedule(entry)
        return StoreResult(True, None, record, evicted=len(set_room) + len(store_room))

    def _set_room(self, entries: dict[str, _Entry], record: DhtRecord, group: str) -> list[_Entry] | None:
        """The records of this key's set to drop so that `record` fits (its signer's
        current record aside), or None when it may not take any (`set_full`)."""
        others = [e for did, e in entries.items() if did != record.did]
        size = 2 + sum(len(e.record.raw) for e in others) + len(others) + len(record.raw)
        counts: Counter[str] = Counter(e.group for e in others)
        victims: list[_Entry] = []
        while len(others) + 1 > self.limits.max_set_entries or size > self.limits.max_set_bytes:
            victim_group = eviction_group(counts, group)
            if victim_group is None:
                return None
            oldest = min((e for e in others if e.group == victim_group), key=lambda e: _newest(e.record))
            if victim_group == group and _newest(record) < _newest(oldest.record):
                return None  # the newcomer is its group's oldest
            others.remove(oldest)
            victims.append(oldest)
            counts[victim_group] -= 1
            size -= len(oldest.record.raw) + 1
        return victims

    def _store_room(self, group: str, count: int, size: int, gone: list[_Entry]) -> list[_Entry] | None:
        """Least recently stored records of the largest groups to drop until `count`
        records of `size` bytes fit the totals, or None when that is not allowed."""
        taken = {e.seq for e in gone}
        dropped = Counter(e.group for e in gone if e.source is not None)
        view = {g: n - dropped[g] for g, n in self._per_group.items()}  # own records are never evicted
        victims: list[_Entry] = []
        while count > self.limits.max_entries or size > self.limits.max_bytes:
            victim_group = eviction_group(view, group)
            if victim_group is None or victim_group == OWN_GROUP:
                return None
            victim = next(e for e in self._lru[victim_group].values() if e.seq not in taken)
            taken.add(victim.seq)
            victims.append(victim)
            view[victim_group] -= 1
            count -= 1
            size -= len(victim.record.raw)
        return victims

    def _refresh(self, entry: _Entry, now: datetime) -> None:
        """The same source stored the same record again: it counts from now."""
        lru = self._lru[entry.group]
        del lru[entry.seq]
        entry.stored_at = now
        entry.drop_at = min(entry.record.expires, now + self.limits.max_hold)
        entry.seq = next(self._seq)
        lru[entry.seq] = entry
        self._schedule(entry)

    def _schedule(self, entry: _Entry) -> None:
        heapq.heappush(self._expiry, (entry.drop_at, entry.seq, entry.kid, entry.record.did))
        if len(self._expiry) > 4 * self.limits.max_entries + 64:
            self._rebuild_expiry()

    def _drop(self, entry: _Entry) -> None:
        entries = self._sets[entry.kid]
        del entries[entry.record.did]
        if not entries:
            del self._sets[entry.kid]
        self._count -= 1
        self._bytes -= len(entry.record.raw)
        self._per_signer[entry.record.did] -= 1
        if self._per_signer[entry.record.did] <= 0:
            del self._per_signer[entry.record.did]
        if entry.source is None:
            self._own -= 1
        else:
            group = entry.group
            self._per_source[entry.source] -= 1
            if self._per_source[entry.source] <= 0:
                del self._per_source[entry.source]
            self._per_group[group] -= 1
            if self._per_group[group] <= 0:
                del self._per_group[group]
            lru = self._lru[group]
            del lru[entry.seq]
            if not lru:
                del self._lru[group]

    def _rebuild_expiry(self) -> None:
        self._expiry = [
            (e.drop_at, e.seq, kid, did) for kid, entries in self._sets.items() for did, e in entries.items()
        ]
        heapq.heapify(self._expiry)

    def cull(self, now: datetime) -> int:
        """Drop every record expired (or held past `max_hold`) at `now`; returns how many."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, kid, did = heapq.heappop(self._expiry)
            entry = self._sets.get(kid, {}).get(did)
            if entry is not None and entry.seq == seq:
                self._drop(entry)
                dropped += 1
        return dropped

    # - reading -

    def get(self, kid: bytes, *, now: datetime) -> list[DhtRecord]:
        """The live records under `kid`, in serving order (`fair_order`)."""
        self.cull(now)
        entries = self._sets.get(kid)
        if not entries:
            return []
        return fair_order((e.group, e.record) for e in entries.values())

    def reply_value(self, kid: bytes, *, now: datetime) -> bytes | None:
        """The FIND_VALUE reply value for `kid` (a JSON array), None when nothing is held."""
        records = self.get(kid, now=now)
        return encode_record_set(records) if records else None

    def keys(self) -> list[bytes]:
        return list(self._sets)

    def records(self, *, now: datetime) -> Iterator[tuple[bytes, DhtRecord]]:
        """Every live (key id, record)."""
        self.cull(now)
        for kid, entries in list(self._sets.items()):
            for entry in list(entries.values()):
                yield kid, entry.record

    def own_older_than(self, cutoff: datetime) -> list[tuple[bytes, bytes]]:
        """(key id, raw) of this node's own records (signer = `own_did`) stored at or
        before `cutoff`. The only records a node ever republishes: republishing
        others' records would let a stale holder revert newer ones."""
        return [
            (kid, entry.record.raw)
            for kid, entries in self._sets.items()
            for did, entry in entries.items()
            if did == self.own_did and entry.stored_at <= cutoff
        ]

    def drop_own(self, kid: bytes) -> bool:
        """Forget this node's own record under `kid` (one it no longer publishes);
        True if one was held. Replicas keep their copies until they expire."""
        entry = self._sets.get(kid, {}).get(self.own_did)
        if entry is None or entry.source is not None:
            return False
        self._drop(entry)
        return True

    def own_record(self, kid: bytes) -> DhtRecord | None:
        """This node's own record under `kid`, if held."""
        entry = self._sets.get(kid, {}).get(self.own_did)
        return entry.record if entry is not None and entry.source is None else None

    def held_by(self) -> dict[str, int]:
        """Records stored here per source group (gauges for status and tests)."""
        return dict(self._per_group)

    def stats(self) -> dict[str, int]:
        return {"stored_records": self._count, "stored_bytes": self._bytes, "stored_keys": len(self._sets),
                "stored_own": self._own}

    def __len__(self) -> int:
        return self._count
