"""Hostile input to `Verifier.verify` (profile section 7, "bad input").

Every test feeds the verifier something built from a valid, signed container
and checks that

(a) `verify` never raises,
(b) a rejection always carries a reason code from `reasons.ALL`, and the
    verifier never hides a crash: a reject detail of the form
    "unexpected <ExceptionType>" (its catch-all) fails the test,
(c) no change to a signed member is ever accepted.

Where the outcome is fully determined, the exact reason code is asserted too.

Byte-level changes are judged against an independent reference parse of the
changed bytes (strict UTF-8, RFC 8259 JSON, no duplicate keys, no NaN /
Infinity, canonical JSON must exist): bytes that do not parse must be rejected
as `malformed`; bytes that parse to a container whose `hmp_container` has the
same canonical JSON as before are the same container written differently (a
single byte can do that: `\\u001f` -> `\\u001F`, `1e+21` -> `1e021`, or a
change inside an unsigned block) and must verify; anything else must be
rejected.

All hypothesis tests are derandomized and use no example database, so CI runs
are reproducible.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import re
import sys
import tracemalloc
import zlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmpnode.container import reasons as R
from hmpnode.container.build import DEFAULT_SCHEMA_URI, Recipient, build_container
from hmpnode.container.canonical import CanonicalError, canonical_json, prepare
from hmpnode.container.did import container_did_for
from hmpnode.container.encoding import b58encode, b64url_decode, b64url_encode, format_time, sha256_tag
from hmpnode.container.payload import encode_payload
from hmpnode.container.verify import Limits, Verifier, VerifyResult, encode_wire
from hmpnode.identity import Identity, MemoryKeyRegistry

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
MiB = 1024 * 1024

ALICE = Identity(bytes([0xA1]) * 32)
BOB = Identity(bytes([0xB0]) * 32)
CAROL = Identity(bytes([0xC0]) * 32)
DAVE = Identity(bytes([0xD0]) * 32)
MALLORY = Identity(bytes([0x66]) * 32)

HYPOTHESIS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

REQUIRED_HEAD = frozenset({
    "version", "class", "class_version", "class_id", "container_did", "schema",
    "sender_did", "timestamp", "payload_hash", "sig_algo", "signature", "payload_type",
})
KNOWN_HEAD = REQUIRED_HEAD | {
    "subclass", "ttl", "tags", "public_key", "recipient", "key_recipient", "group_recipient",
    "broadcast", "network", "encryption_algo", "compression", "confidence", "magnet_uri",
}


# --------------------------------------------------------------------- helpers


def _rng(seed: int):
    return random.Random(seed).randbytes


def _recipient(identity: Identity) -> Recipient:
    return Recipient(identity.did, identity.public_key)


# Control characters with and without short escapes, a float written with an
# exponent, non-ASCII (2-, 3- and 4-byte UTF-8), U+2028: a single byte change
# can rewrite some of these into another spelling of the same value.
META = {
    "note": "tab\there, vt\x0b, us\x1f, nul\x00",
    "exp": 1e21,
    "neg": -0.25,
    "n": 42,
    "nested": {"a": [1, 2, {"b": None}], "t": True, "f": False},
    "uni": "h\u00e9llo \u2603 \U0001d11e \u2028",
}
RELATED = {
    "in_reply_to": "did:hmp:container:QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG",
    "see_also": ["did:example:one", "did:example:two"],
}
PAYLOAD = {
    "text": 'hello "mesh" \\ /',
    "items": [1, 2.5, "x", None, -7],
    "flag": False,
    "obj": {"k": "v", "e": {}},
    "empty": [],
}
PEER_ANNOUNCE = {
    "name": "alice",
    "interests": ["mesh"],
    "addresses": [{"addr": "tcp://127.0.0.1:4001", "nonce": 7, "pow_hash": "0" * 64, "difficulty": 1}],
}


def _build(class_: str = "note", payload: Any = PAYLOAD, **kw) -> dict[str, Any]:
    return build_container(
        ALICE,
        class_,
        payload,
        now=NOW,
        rng=_rng(7),
        subclass="sub",
        tags=["alpha", "beta"],
        ttl=NOW + timedelta(days=1),
        broadcast=False,
        network="",
        confidence=0.75,
        meta=META,
        related=RELATED,
        **kw,
    )


def _with_unsigned(full: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(full)
    out["referenced-by"] = {"links": [{"type": "see_also", "target": "did:example:x"}], "peer_did": "did:example:p"}
    out["evaluations"] = {"items": [], "note": "unsigned\x0b"}
    out["relay_chain"] = [{"relay_did": "did:example:relay", "timestamp": format_time(NOW), "n": 3}]
    return out


BASES: dict[str, dict[str, Any]] = {
    "plain": _build(),
    "zstd": _build(compression="zstd"),
    "gzip": _build(compression="gzip"),
    "enc_single": _build(encrypt_to=[_recipient(BOB)]),
    "enc_group": _build(encrypt_to=[_recipient(BOB), _recipient(CAROL), _recipient(DAVE)], compression="zstd"),
    "peer_announce": _build("peer_announce", PEER_ANNOUNCE),
}
BASES["unsigned_blocks"] = _with_unsigned(BASES["plain"])
WIRES = {name: encode_wire(full) for name, full in BASES.items()}
NAMES = sorted(BASES)

VERIFIER = Verifier()


def verify(raw: Any, *, verifier: Verifier | None = None, now: datetime = NOW) -> VerifyResult:
    result = (verifier or VERIFIER).verify(raw, now=now)
    assert isinstance(result, VerifyResult)
    assert result.ok in (True, False)
    if result.ok:
        assert result.reason is None, result
    else:
        assert result.reason in R.ALL, result
        assert not result.detail.startswith("unexpected "), f"verifier swallowed a crash: {result}"
    return result


def assert_rejected(result: VerifyResult, reason: str | None = None) -> None:
    assert result.ok is False, f"accepted: {result}"
    assert result.reason in R.ALL, result
    if reason is not None:
        assert result.reason == reason, result


def canon(hmp: Any) -> bytes:
    return canonical_json(hmp, max_depth=1000)


def sign(hmp: dict[str, Any], identity: Identity = ALICE) -> dict[str, Any]:
    """Address and sign `hmp` as build.py does: container_did over the canonical
    hmp_container without signature and container_did, signature over it without
    signature. Returns the full form."""
    head = hmp["head"]
    head.pop("signature", None)
    head.pop("container_did", None)
    head["container_did"] = container_did_for(canon(hmp))
    head["signature"] = b64url_encode(identity.sign(canon(hmp)))
    return {"hmp_container": hmp}


def resign(full: dict[str, Any], change, identity: Identity = ALICE) -> dict[str, Any]:
    hmp = copy.deepcopy(full["hmp_container"])
    change(hmp)
    return sign(hmp, identity)


def hand_head(class_: str = "note", **fields: Any) -> dict[str, Any]:
    head = {
        "version": "1.2",
        "class": class_,
        "class_version": "1.0",
        "class_id": f"{class_}-v1.0",
        "schema": DEFAULT_SCHEMA_URI,
        "timestamp": format_time(NOW),
        "sender_did": ALICE.did,
        "sig_algo": "ed25519",
        "public_key": ALICE.public_key_b58,
    }
    head.update(fields)
    return head


def compressed_container(compressed: bytes, algo: str, class_: str = "note", base: str = "json") -> dict[str, Any]:
    """A correctly signed container whose payload is the given compressed bytes."""
    head = hand_head(class_, payload_type=f"{algo}+{base}", compression=algo, payload_hash=sha256_tag(compressed))
    return sign({"head": head, "payload": b64url_encode(compressed)})


def raw_wire(full: dict[str, Any]) -> bytes:
    """encode_wire without its nesting limit."""
    return orjson.dumps(prepare(full, max_depth=1_000_000), option=orjson.OPT_STRICT_INTEGER)


def plain_container(payload: Any, **fields: Any) -> dict[str, Any]:
    head = hand_head(payload_type="json", payload_hash=sha256_tag(canon(payload)), **fields)
    return sign({"head": head, "payload": payload})


# -- paths into a JSON value


def iter_paths(value: Any, prefix: tuple = ()):
    """Every path below `value` (not the root itself), parents first."""
    if type(value) is dict:
        for key, item in value.items():
            yield prefix + (key,)
            yield from iter_paths(item, prefix + (key,))
    elif type(value) is list:
        for i, item in enumerate(value):
            yield prefix + (i,)
            yield from iter_paths(item, prefix + (i,))


def get_at(doc: Any, path: tuple) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def set_at(doc: Any, path: tuple, value: Any) -> None:
    get_at(doc, path[:-1])[path[-1]] = value


def del_at(doc: Any, path: tuple) -> None:
    del get_at(doc, path[:-1])[path[-1]]


def json_category(value: Any) -> str:
    if value is None:
        return "null"
    if type(value) is bool:
        return "bool"
    if type(value) in (int, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


# -- compact JSON with raw edits (duplicate keys, NaN, huge literals, ...)


def _leaf(value: Any) -> bytes:
    return orjson.dumps(prepare(value), option=orjson.OPT_STRICT_INTEGER)


def emit(value: Any, *, replace: dict | None = None, insert: dict | None = None, path: tuple = ()) -> bytes:
    """encode_wire's bytes, except: `replace` maps a path to the raw bytes written
    for that node; `insert` maps the path of an object to [(index, raw key, raw value)]
    members spliced in (any key, including one the object already has)."""
    if replace and path in replace:
        return replace[path]
    if type(value) is dict:
        members = [
            orjson.dumps(k) + b":" + emit(v, replace=replace, insert=insert, path=path + (k,))
            for k, v in sorted(value.items())  # canonical member order, as encode_wire writes
        ]
        for index, raw_key, raw_value in sorted((insert or {}).get(path, ()), key=lambda m: -m[0]):
            members.insert(index, raw_key + b":" + raw_value)
        return b"{" + b",".join(members) + b"}"
    if type(value) is list:
        return b"[" + b",".join(
            emit(v, replace=replace, insert=insert, path=path + (i,)) for i, v in enumerate(value)
        ) + b"]"
    return _leaf(value)


# -- reference decoders (independent of the library)

_B64URL_BODY = re.compile(r"[A-Za-z0-9_-]*")
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def ref_b64url(text: str) -> bytes | None:
    """Profile sections 1 and 13: base64url, trailing '=' padding ignored however much
    there is, canonical trailing bits. None when not valid."""
    body = text.rstrip("=")
    if _B64URL_BODY.fullmatch(body) is None or len(body) % 4 == 1 or (text and not body):
        return None
    data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    if base64.urlsafe_b64encode(data).rstrip(b"=").decode() != body:
        return None
    return data


def ref_b58(text: str) -> bytes | None:
    if not text or any(c not in _B58_ALPHABET for c in text):
        return None
    n = 0
    for c in text:
        n = n * 58 + _B58_ALPHABET.index(c)
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def reference_outcome(original: dict[str, Any], data: bytes) -> str:
    """'malformed', 'same' (the same signed container, written differently) or 'different'."""
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
        canonical_json(doc, max_depth=Limits().max_depth)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "malformed"
    if type(doc) is not dict:
        return "malformed"
    if type(doc.get("hmp_container")) is dict and canon(doc["hmp_container"]) == canon(original["hmp_container"]):
        return "same"
    return "different"


def check_bytes(original: dict[str, Any], data: bytes, *, as_text: bool = False) -> tuple[str, VerifyResult]:
    expected = reference_outcome(original, data)
    if as_text:
        try:
            raw: Any = data.decode("utf-8")
        except UnicodeDecodeError:
            raw = data.decode("utf-8", "surrogateescape")
    else:
        raw = data
    result = verify(raw)
    if expected == "same":
        assert result.ok, f"the same container, re-spelled, was rejected: {result}"
        assert result.container_did == original["hmp_container"]["head"]["container_did"]
    elif expected == "malformed":
        assert_rejected(result, R.MALFORMED)
    else:
        assert_rejected(result)
    return expected, result


# -- JSON values for hypothesis

SAFE_INTS = st.integers(-(2**53 - 1), 2**53 - 1)
# Floats below 2**53 in magnitude, plus a few extremes whose canonical form has an
# exponent; floats in [2**53, 1e21) have no canonical form (they would read back as
# unsafe integers) and are tested on their own
# (test_builder_and_verifier_agree_on_large_integral_floats).
FLOATS = st.one_of(
    st.floats(min_value=-(2.0**53), max_value=2.0**53, exclude_min=True, exclude_max=True),
    st.sampled_from([1e21, -1e300, 1.7976931348623157e308, 5e-324, -0.0]),
)


def _string_leaves(value: Any):
    for path in iter_paths(value):
        leaf = get_at(value, path)
        if type(leaf) is str and len(leaf) < 200:
            yield leaf
        if type(path[-1]) is str:
            yield path[-1]


INTERESTING_STRINGS = sorted(
    {s for full in BASES.values() for s in _string_leaves(full)}
    | {
        BOB.did, BOB.public_key_b58, format_time(NOW - timedelta(hours=1)), format_time(NOW + timedelta(hours=1)),
        "did:hmp:container:QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51", "did:example:x", "did:x",
        "rsa", "ed25519", "json", "zstd+json", "gzip", "zstd", "encrypted+json", "x25519-chacha20poly1305",
        "sha256:" + "0" * 64, "localhost", "lan:10.0.0.0/8", "lan:10.0.0.0/99", "", "\n", "x\n",
    }
)
STRINGS = st.one_of(st.text(max_size=24), st.sampled_from(INTERESTING_STRINGS))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | SAFE_INTS | FLOATS | STRINGS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


# ------------------------------------------------------------ the base cases


@pytest.mark.parametrize("name", NAMES)
def test_bases_verify(name):
    full = BASES[name]
    for raw in (WIRES[name], WIRES[name].decode("utf-8"), bytearray(WIRES[name]), copy.deepcopy(full)):
        result = verify(raw)
        assert result.ok, result
        assert result.container_did == full["hmp_container"]["head"]["container_did"]
    assert emit(full) == WIRES[name]  # the raw-edit serializer writes what encode_wire writes


def test_bare_form_verifies():
    result = verify(orjson.dumps(prepare(BASES["plain"]["hmp_container"])))
    assert result.ok, result


# ------------------------------------------------------------ single-byte changes


def _flip_candidates(byte: int, pos: int) -> list[int]:
    cycle = [0x00, 0x20, 0x22, 0x5C, 0x30, 0x7D, 0xFF, 0x2B, 0x2E, 0x41, 0x0A, 0xC3, 0x5D, 0x2C]
    return [c for c in (byte ^ 0x01, cycle[pos % len(cycle)], byte ^ 0x20) if c != byte]


@pytest.mark.parametrize("name", NAMES)
def test_every_byte_position_changed(name):
    """Deterministic sweep: every byte of the wire form, changed to up to 3 other bytes."""
    wire = WIRES[name]
    original = BASES[name]
    outcomes = {"malformed": 0, "same": 0, "different": 0}
    for pos, byte in enumerate(wire):
        for new in _flip_candidates(byte, pos):
            expected, _ = check_bytes(original, wire[:pos] + bytes([new]) + wire[pos + 1:])
            outcomes[expected] += 1
    assert outcomes["malformed"] and outcomes["different"]
    if name == "unsigned_blocks":
        assert outcomes["same"], "changes inside unsigned blocks must not affect verification"


@settings(max_examples=2000, **HYPOTHESIS)
@given(name=st.sampled_from(NAMES), data=st.data())
def test_random_byte_change(name, data):
    wire = WIRES[name]
    pos = data.draw(st.integers(0, len(wire) - 1), label="pos")
    new = data.draw(st.integers(0, 255).filter(lambda b: b != wire[pos]), label="byte")
    as_text = data.draw(st.booleans(), label="as_text")
    check_bytes(BASES[name], wire[:pos] + bytes([new]) + wire[pos + 1:], as_text=as_text)


def _replace_once(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1, (old, data.count(old))
    return data.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"\\u000b", b"\\u000B"),  # same character, other hex case
        (b"\\u001f", b"\\u001F"),
        (b"1e+21", b"1e021"),  # same number: a leading zero in the exponent is JSON
    ],
)
def test_single_byte_respelling_of_the_same_value_verifies(old, new):
    """One byte changed, same parsed value: the signature covers canonical JSON,
    not the wire spelling, so this is the same container."""
    wire = WIRES["plain"]
    mutated = _replace_once(wire, old, new)
    assert sum(a != b for a, b in zip(wire, mutated, strict=True)) == 1
    expected, result = check_bytes(BASES["plain"], mutated)
    assert expected == "same" and result.ok


def test_whitespace_is_not_content():
    wire = WIRES["plain"]
    assert verify(wire + b"\n").ok
    assert verify(b" \t\r\n" + wire).ok
    pretty = json.dumps(json.loads(wire), indent=2, ensure_ascii=False).encode()
    assert verify(pretty).ok
    assert verify(json.dumps(json.loads(wire)).encode()).ok  # \uXXXX escapes for all non-ASCII
    assert_rejected(verify(wire + b"x"), R.MALFORMED)
    assert_rejected(verify(wire + wire), R.MALFORMED)
    assert_rejected(verify(wire[:-1]), R.MALFORMED)


# ------------------------------------------------------------ dropped members


def _expected_after_drop(hmp: dict[str, Any], path: tuple) -> str:
    head = hmp["head"]
    encrypted = head["payload_type"].startswith("encrypted+")
    if path in (("head",), ("payload",)):
        return R.SCHEMA
    if path[0] == "head" and len(path) == 2:
        name = path[1]
        if name in REQUIRED_HEAD or name == "compression":
            return R.SCHEMA
        if encrypted and name in ("recipient", "key_recipient", "group_recipient", "encryption_algo"):
            return R.SCHEMA
        return R.CONTAINER_DID_MISMATCH
    if path[:2] == ("head", "group_recipient") and len(path) == 4:
        return R.SCHEMA  # an entry without recipient or key_recipient
    if path[:2] == ("head", "recipient") and "key_recipient" in head:
        return R.SCHEMA  # key_recipient goes with exactly one recipient
    if path[0] == "payload":
        return R.PAYLOAD_HASH_MISMATCH
    return R.CONTAINER_DID_MISMATCH


@pytest.mark.parametrize("name", NAMES)
def test_drop_any_member(name):
    """Drop every member of head, payload, meta, related (and nested ones), one at a time."""
    full = BASES[name]
    failures = []
    checked = 0
    for path in iter_paths(full["hmp_container"]):
        mutated = copy.deepcopy(full)
        del_at(mutated["hmp_container"], path)
        expected = _expected_after_drop(full["hmp_container"], path)
        for raw in (encode_wire(mutated), mutated):
            result = verify(raw)
            checked += 1
            if result.ok or result.reason != expected:
                failures.append((path, type(raw).__name__, expected, result.reason, result.detail))
    assert checked > 40
    assert failures == []


@pytest.mark.parametrize("name", NAMES)
def test_drop_top_level_members(name):
    full = BASES[name]
    for key in list(full):
        mutated = {k: v for k, v in full.items() if k != key}
        result = verify(encode_wire(mutated))
        if key == "hmp_container":
            assert_rejected(result, R.SCHEMA)
        else:
            assert result.ok, (key, result)  # unsigned blocks are not covered by the signature


# ------------------------------------------------------------ type changes

REPLACEMENTS = {
    "number": [7, 0.5, -1],
    "string": ["x", ""],
    "bool": [True, False],
    "null": [None],
    "array": [["x"], []],
    "object": [{"x": 1}, {}],
}


def _type_change_paths(hmp: dict[str, Any]):
    yield ("head",)
    yield ("payload",)
    yield ("meta",)
    yield ("related",)
    for name in hmp["head"]:
        yield ("head", name)
    for relation in hmp["related"]:
        yield ("related", relation)
    for i, entry in enumerate(hmp["head"].get("group_recipient", ())):
        yield ("head", "group_recipient", i)
        for member in entry:
            yield ("head", "group_recipient", i, member)
    for i, _ in enumerate(hmp["head"].get("recipient", ())):
        yield ("head", "recipient", i)
    for i, _ in enumerate(hmp["head"].get("tags", ())):
        yield ("head", "tags", i)


@pytest.mark.parametrize("name", NAMES)
def test_change_type_of_every_head_field(name):
    """Any member the base schema types (every head field, meta, related and its
    values, payload, group entries, list items) given a value of another JSON type
    -> schema."""
    full = BASES[name]
    failures = []
    for path in _type_change_paths(full["hmp_container"]):
        original = get_at(full["hmp_container"], path)
        for category, values in REPLACEMENTS.items():
            if category == json_category(original):
                continue
            for value in values:
                if path[0] == "related" and len(path) == 2 and value == []:
                    continue  # an empty list of DIDs is a valid relation value
                mutated = copy.deepcopy(full)
                set_at(mutated["hmp_container"], path, value)
                for raw in (encode_wire(mutated), mutated):
                    result = verify(raw)
                    if result.ok or result.reason != R.SCHEMA:
                        failures.append((path, value, type(raw).__name__, result.reason, result.detail))
    assert failures == []


def test_related_string_rewritten_as_list_is_a_change():
    """Readers accept both forms and never rewrite them: ["x"] is not "x"."""
    full = BASES["plain"]
    mutated = copy.deepcopy(full)
    mutated["hmp_container"]["related"]["in_reply_to"] = [mutated["hmp_container"]["related"]["in_reply_to"]]
    assert_rejected(verify(encode_wire(mutated)), R.CONTAINER_DID_MISMATCH)


# ------------------------------------------------------------ random replacement / insertion

SIGNED_PATHS = {
    name: [p for p in iter_paths(full["hmp_container"]) if p != ("head", "signature")]
    for name, full in BASES.items()
}


@settings(max_examples=1000, **HYPOTHESIS)
@given(name=st.sampled_from(NAMES), data=st.data())
def test_replace_any_signed_member_with_random_json(name, data):
    full = BASES[name]
    path = data.draw(st.sampled_from(SIGNED_PATHS[name]), label="path")
    value = data.draw(JSON_VALUES, label="value")
    as_dict = data.draw(st.booleans(), label="as_dict")
    mutated = copy.deepcopy(full)
    set_at(mutated["hmp_container"], path, value)
    result = verify(mutated if as_dict else encode_wire(mutated))
    if canon(mutated["hmp_container"]) == canon(full["hmp_container"]):
        assert result.ok, result  # e.g. 42 -> 42.0, or a value replaced by itself
    else:
        assert_rejected(result)


def _dict_paths(hmp: dict[str, Any]) -> list[tuple]:
    return [()] + [p for p in iter_paths(hmp) if type(get_at(hmp, p)) is dict]


@settings(max_examples=500, **HYPOTHESIS)
@given(name=st.sampled_from(NAMES), data=st.data())
def test_insert_unknown_member_anywhere(name, data):
    """Unknown members are signed like known ones (profile section 3)."""
    full = BASES[name]
    hmp = full["hmp_container"]
    path = data.draw(st.sampled_from(_dict_paths(hmp)), label="object")
    target = get_at(hmp, path)
    key = "x-" + data.draw(st.text(max_size=8), label="key")
    if key in target:
        return
    if path == ("related",):
        value = data.draw(st.sampled_from(["did:example:new", ["did:example:a", "did:b:c"], []]), label="value")
    else:
        value = data.draw(JSON_VALUES, label="value")
    mutated = copy.deepcopy(full)
    get_at(mutated["hmp_container"], path)[key] = value
    expected = R.PAYLOAD_HASH_MISMATCH if path[:1] == ("payload",) else R.CONTAINER_DID_MISMATCH
    result = verify(mutated if data.draw(st.booleans(), label="as_dict") else encode_wire(mutated))
    assert_rejected(result, expected)


# ------------------------------------------------------------ duplicate keys


@settings(max_examples=400, **HYPOTHESIS)
@given(name=st.sampled_from(NAMES), data=st.data())
def test_duplicate_key_anywhere_is_malformed(name, data):
    full = BASES[name]
    objects = [p for p in _dict_paths(full) if get_at(full, p)]
    path = data.draw(st.sampled_from(objects), label="object")
    target = get_at(full, path)
    key = data.draw(st.sampled_from(list(target)), label="key")
    if data.draw(st.booleans(), label="same_value"):
        value = _leaf(target[key]) if type(target[key]) not in (dict, list) else emit(target[key])
    else:
        value = _leaf(data.draw(JSON_VALUES, label="value"))
    index = data.draw(st.integers(0, len(target)), label="index")
    raw = emit(full, insert={path: [(index, orjson.dumps(key), value)]})
    as_text = data.draw(st.booleans(), label="as_text")
    assert_rejected(verify(raw.decode("utf-8") if as_text else raw), R.MALFORMED)


@pytest.mark.parametrize("name", NAMES)
def test_duplicate_class_key(name):
    wire = WIRES[name]
    for dup in (b'"class":"x","class":', b'"class":"note","class":'):
        raw = _replace_once(wire, b'"class":', dup)
        assert_rejected(verify(raw), R.MALFORMED)
    raw = _replace_once(wire, b'"class":"' + BASES[name]["hmp_container"]["head"]["class"].encode() + b'"',
                        b'"class":"x","class":"y"')
    assert_rejected(verify(raw), R.MALFORMED)
    # the whole hmp_container twice
    inner = emit(BASES[name]["hmp_container"])
    assert_rejected(verify(b'{"hmp_container":' + inner + b',"hmp_container":' + inner + b"}"), R.MALFORMED)


# ------------------------------------------------------------ nesting, size


def _nested_list(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_deep_nesting_is_malformed_without_recursion_error(name):
    full = BASES[name]
    deep_array = b"[" * 10_000 + b"1" + b"]" * 10_000
    deep_object = b'{"a":' * 10_000 + b"1" + b"}" * 10_000
    for deep in (deep_array, deep_object):
        for path in (("hmp_container", "payload"), ("hmp_container", "meta", "nested")):
            raw = emit(full, replace={path: deep})
            assert_rejected(verify(raw), R.MALFORMED)
            assert_rejected(verify(raw.decode()), R.MALFORMED)
    assert_rejected(verify(b"[" * 200_000), R.MALFORMED)
    assert_rejected(verify(b"[" * 100_000 + b"]" * 100_000), R.MALFORMED)
    assert_rejected(verify(b'{"hmp_container":' * 50_000 + b"{}" + b"}" * 50_000), R.MALFORMED)
    # already-parsed input (the dict path): a Python value 10 000 levels deep
    for where in ("payload", "meta"):
        mutated = copy.deepcopy(full)
        mutated["hmp_container"][where] = {"d": _nested_list(10_000)}
        assert_rejected(verify(mutated), R.MALFORMED)


def _builder_max_payload_depth() -> int:
    """The deepest payload {"d": [[...]]} build_container accepts (levels, the payload object included)."""
    levels = 1
    while levels < 200:
        try:
            build_container(ALICE, "note", {"d": _nested_list(levels)}, now=NOW)
        except (ValueError, CanonicalError):
            return levels
        levels += 1
    raise AssertionError("no nesting limit in build_container")


def test_nesting_limit_boundary():
    """The verifier accepts exactly the plain-payload nesting the builder can produce."""
    deepest = _builder_max_payload_depth()
    ok = plain_container({"d": _nested_list(deepest - 1)})
    too_deep = plain_container({"d": _nested_list(deepest)})
    for raw in (raw_wire(ok), ok):
        assert verify(raw).ok
    for raw in (raw_wire(too_deep), too_deep):
        assert_rejected(verify(raw), R.MALFORMED)


@pytest.mark.parametrize("algo", ["zstd", "gzip"])
def test_compressed_payload_nesting_limit_matches_plain(algo):
    deepest = _builder_max_payload_depth()
    ok_text = orjson.dumps({"d": _nested_list(deepest - 1)})
    assert verify(encode_wire(compressed_container(_compress(ok_text, algo), algo))).ok
    deeper = orjson.dumps({"d": _nested_list(deepest)})
    assert_rejected(verify(encode_wire(compressed_container(_compress(deeper, algo), algo))), R.MALFORMED)


@pytest.mark.parametrize("algo", ["zstd", "gzip"])
def test_deeply_nested_compressed_payload_is_malformed(algo):
    for depth in (65, 500, 10_000):
        text = b"[" * depth + b"]" * depth
        full = compressed_container(_compress(text, algo), algo)
        assert_rejected(verify(encode_wire(full)), R.MALFORMED)


def test_size_limit():
    limit = Limits().max_container_bytes
    big = copy.deepcopy(BASES["plain"])
    big["hmp_container"]["meta"]["blob"] = "a" * (2 * MiB)
    raw = encode_wire(big)
    assert_rejected(verify(raw), R.MALFORMED)
    assert_rejected(verify(raw.decode()), R.MALFORMED)
    # the limit is on the bytes: exactly at it (padded with whitespace) passes, one over fails
    wire = WIRES["plain"]
    assert verify(wire + b" " * (limit - len(wire))).ok
    assert_rejected(verify(wire + b" " * (limit - len(wire) + 1)), R.MALFORMED)
    small = Verifier(limits=Limits(max_container_bytes=len(wire) - 1))
    assert_rejected(verify(wire, verifier=small), R.MALFORMED)
    assert verify(wire, verifier=Verifier(limits=Limits(max_container_bytes=len(wire)))).ok


@pytest.mark.parametrize("where", ["meta", "payload"])
def test_900_kib_string_inside_limits(where):
    blob = "\u00e9a" * (300 * 1024)  # 900 KiB of UTF-8
    if where == "meta":
        full = build_container(ALICE, "note", {"x": 1}, now=NOW, meta={"blob": blob})
    else:
        full = build_container(ALICE, "note", {"blob": blob}, now=NOW)
    wire = encode_wire(full)
    assert 900 * 1024 <= len(wire) <= Limits().max_container_bytes
    assert verify(wire).ok
    assert verify(wire.decode()).ok
    mutated = wire.replace(b"a\xc3\xa9a", b"a\xc3\xa9b", 1)
    expected = R.CONTAINER_DID_MISMATCH if where == "meta" else R.PAYLOAD_HASH_MISMATCH
    assert_rejected(verify(mutated), expected)


# ------------------------------------------------------------ decompression bombs

BOMB_SIZE = 100 * MiB
PEAK_LIMIT = 64 * MiB


def _compress(data: bytes, algo: str) -> bytes:
    if algo == "zstd":
        return zstandard.ZstdCompressor(write_content_size=True).compress(data)
    co = zlib.compressobj(6, zlib.DEFLATED, 31)
    return co.compress(data) + co.flush()


def _bomb_chunks(size: int):
    """A JSON object of `size` bytes, produced 1 MiB at a time."""
    head, tail = b'{"x":"', b'"}'
    yield head
    left = size - len(head) - len(tail)
    chunk = b"A" * MiB
    while left > 0:
        yield chunk[: min(left, MiB)]
        left -= MiB
    yield tail


def _zstd_bomb(size: int, content_size: bool) -> bytes:
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    cobj = cctx.compressobj(size=size if content_size else -1)
    out = [cobj.compress(c) for c in _bomb_chunks(size)]
    out.append(cobj.flush())
    return b"".join(out)


def _gzip_bomb(size: int) -> bytes:
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [co.compress(c) for c in _bomb_chunks(size)]
    out.append(co.flush())
    return b"".join(out)


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    small = b'{"x":1}'
    zstd_declared = _zstd_bomb(BOMB_SIZE, content_size=True)
    gzip_bomb = _gzip_bomb(BOMB_SIZE)
    return {
        "zstd_declared_size": zstd_declared,
        "zstd_unknown_size": _zstd_bomb(BOMB_SIZE, content_size=False),
        "zstd_second_frame": _compress(small, "zstd") + zstd_declared,
        "gzip": gzip_bomb,
        "gzip_second_member": _compress(small, "gzip") + gzip_bomb,
    }


def test_tracemalloc_sees_decompression_buffers(bombs):
    """The memory bound below means something: an unbounded decompression is traced."""
    tracemalloc.start()
    try:
        out = zstandard.ZstdDecompressor().decompress(bombs["zstd_declared_size"])
        size = len(out)
        del out
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == BOMB_SIZE
    assert peak >= BOMB_SIZE


@pytest.mark.parametrize(
    "kind", ["zstd_declared_size", "zstd_unknown_size", "zstd_second_frame", "gzip", "gzip_second_member"]
)
@pytest.mark.parametrize(("class_", "base"), [("note", "json"), ("peer_announce", "json"), ("note", "binary")])
def test_decompression_bomb_is_malformed_with_bounded_memory(bombs, kind, class_, base):
    """100 MiB behind a few KiB: rejected, and never materialised (default limit 16 MiB)."""
    algo = kind.split("_")[0]
    wire = encode_wire(compressed_container(bombs[kind], algo, class_, base))
    assert len(wire) < Limits().max_container_bytes
    tracemalloc.start()
    try:
        result = verify(wire)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_rejected(result, R.MALFORMED)
    assert peak < PEAK_LIMIT, f"peak {peak / MiB:.1f} MiB while verifying a {kind} bomb"


@pytest.mark.parametrize("algo", ["zstd", "gzip"])
def test_decompressed_size_limit_boundary(algo):
    limit = 64 * 1024
    verifier = Verifier(limits=Limits(max_decompressed_bytes=limit))
    for size, ok in ((limit, True), (limit + 1, False)):
        payload = {"s": "a" * (size - len(b'{"s":""}'))}
        assert len(canonical_json(payload)) == size
        result = verify(encode_wire(build_container(ALICE, "note", payload, now=NOW, compression=algo)),
                        verifier=verifier)
        if ok:
            assert result.ok, result
        else:
            assert_rejected(result, R.MALFORMED)


@pytest.mark.parametrize("algo", ["zstd", "gzip"])
@pytest.mark.parametrize(
    "inner",
    [b"not json", b'{"x":NaN}', b'{"x":Infinity}', b'{"x":9007199254740992}', b'{"x":"\\ud800"}',
     b'{"x":"\xff"}', b"\xef\xbb\xbf{}", b'{"x":1} {"y":2}', b""],
)
def test_compressed_payload_that_is_not_json_is_malformed(algo, inner):
    full = compressed_container(_compress(inner, algo), algo)
    assert_rejected(verify(encode_wire(full)), R.MALFORMED)


@pytest.mark.parametrize("algo", ["zstd", "gzip"])
def test_corrupt_compressed_payload_is_malformed(algo):
    good = _compress(b'{"x":1}', algo)
    for data in (good[:-1], good[:5], good + b"\0", b"\0" * 16, b"", bytes(reversed(good))):
        full = compressed_container(data, algo)
        assert_rejected(verify(encode_wire(full)), R.MALFORMED)


@pytest.mark.parametrize("algo", ["zstd", "gzip"])
def test_duplicate_keys_inside_compressed_payload(algo):
    """Profile section 2: duplicate keys SHOULD be rejected. Inside a compressed
    payload they make `key_is_falsified` mean true to one parser and false to another."""
    inner = b'{"addresses":[],"key_is_falsified":true,"key_is_falsified":false}'
    full = compressed_container(_compress(inner, algo), algo, "peer_announce")
    assert_rejected(verify(encode_wire(full)), R.MALFORMED)


# ------------------------------------------------------------ text encoding

INVALID_UTF8 = [
    b"\xff",  # never valid
    b"\xc0\xaf",  # overlong '/'
    b"\xe0\x80\xaf",  # overlong, 3 bytes
    b"\xed\xa0\x80",  # UTF-8-encoded lone surrogate U+D800
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\x80",  # lone continuation byte
    b"\xe2\x82",  # truncated sequence
    b"\xe9",  # Latin-1 'e acute'
]


@pytest.mark.parametrize("bad", INVALID_UTF8, ids=lambda b: b.hex())
@pytest.mark.parametrize("where", ["value", "key", "payload", "head"])
def test_invalid_utf8_is_malformed(bad, where):
    wire = WIRES["plain"]
    if where == "value":
        raw = _replace_once(wire, b'"h\xc3\xa9llo', b'"h' + bad + b"llo")
    elif where == "key":
        raw = _replace_once(wire, b'"nested":', b'"nes' + bad + b'ted":')
    elif where == "payload":
        raw = _replace_once(wire, b'"mesh\\"', b'"me' + bad + b'sh\\"')
    else:
        raw = _replace_once(wire, b'"class":"note"', b'"class":"no' + bad + b'te"')
    assert_rejected(verify(raw), R.MALFORMED)
    assert_rejected(verify(raw.decode("utf-8", "surrogateescape")), R.MALFORMED)


def test_other_text_encodings_are_malformed():
    text = WIRES["plain"].decode()
    for raw in (text.encode("utf-16"), text.encode("utf-16-le"), text.encode("utf-32"),
                b"\xef\xbb\xbf" + WIRES["plain"]):
        assert_rejected(verify(raw), R.MALFORMED)


LONE_SURROGATES = [b'"\\ud800"', b'"\\udfff"', b'"\\ud800\\u0041"', b'"a\\udc00b"', b'"\\ud800\\ud800"']


@pytest.mark.parametrize("literal", LONE_SURROGATES)
@pytest.mark.parametrize("where", [("hmp_container", "meta", "note"), ("hmp_container", "payload", "text"),
                                   ("hmp_container", "head", "class_id")])
def test_lone_surrogate_escape_is_malformed(literal, where):
    full = BASES["plain"]
    raw = emit(full, replace={where: literal})
    assert_rejected(verify(raw), R.MALFORMED)
    assert_rejected(verify(raw.decode()), R.MALFORMED)


def test_lone_surrogate_in_key_and_python_input_is_malformed():
    full = BASES["plain"]
    raw = emit(full, insert={("hmp_container", "meta"): [(0, b'"\\ud800"', b"1")]})
    assert_rejected(verify(raw), R.MALFORMED)
    # a Python str carrying a lone surrogate, as text input and inside an already-parsed dict
    text = WIRES["plain"].decode().replace("h\u00e9llo", "h\ud800llo")
    assert_rejected(verify(text), R.MALFORMED)
    for where in (("meta", "note"), ("payload", "text"), ("head", "class_id"), ("meta", "\ud800")):
        mutated = copy.deepcopy(full)
        set_at(mutated["hmp_container"], where, "\udc00")
        assert_rejected(verify(mutated), R.MALFORMED)


def test_valid_surrogate_pair_escape_is_the_same_character():
    """`\\ud834\\udd1e` is U+1D11E, which the wire form writes literally: same container."""
    wire = WIRES["plain"]
    raw = _replace_once(wire, "\U0001d11e".encode(), b"\\ud834\\udd1e")
    expected, result = check_bytes(BASES["plain"], raw)
    assert expected == "same" and result.ok


# ------------------------------------------------------------ numbers


@pytest.mark.parametrize("literal", [b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"1e400",
                                     b"-1e400", b"01", b"1.", b".5", b"+1", b"0x10", b"1e", b"--1"])
@pytest.mark.parametrize("where", [("hmp_container", "meta", "n"), ("hmp_container", "payload", "flag"),
                                   ("hmp_container", "head", "confidence")])
def test_non_json_numbers_are_malformed(literal, where):
    raw = emit(BASES["plain"], replace={where: literal})
    assert_rejected(verify(raw), R.MALFORMED)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [("meta", "n"), ("payload", "flag"), ("head", "confidence"), ("related", "x")])
def test_nan_and_infinity_in_python_input_are_malformed(value, where):
    mutated = copy.deepcopy(BASES["plain"])
    set_at(mutated["hmp_container"], where, value)
    assert_rejected(verify(mutated), R.MALFORMED)


BIG_INTS = [2**53, -(2**53), 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]


@pytest.mark.parametrize("n", BIG_INTS)
@pytest.mark.parametrize("where", [("meta", "n"), ("payload", "flag"), ("meta", "nested", "a", 0)])
def test_integers_beyond_2_53_are_malformed(n, where):
    raw = emit(BASES["plain"], replace={("hmp_container",) + where: str(n).encode()})
    assert_rejected(verify(raw), R.MALFORMED)
    assert_rejected(verify(raw.decode()), R.MALFORMED)
    mutated = copy.deepcopy(BASES["plain"])
    set_at(mutated["hmp_container"], where, n)
    assert_rejected(verify(mutated), R.MALFORMED)


def test_largest_safe_integers_verify():
    for n in (2**53 - 1, -(2**53 - 1)):
        full = plain_container({"n": n})
        assert verify(encode_wire(full)).ok


@pytest.mark.parametrize("literal", [b"18446744073709551616", b"100000000000000000000", b"-9223372036854775809",
                                     b"1" + b"0" * 400])
@pytest.mark.parametrize("where", [("hmp_container", "meta", "n"), ("hmp_container", "payload", "flag")])
def test_integer_literal_beyond_2_64_is_malformed(literal, where):
    """orjson reads integers beyond 64 bits as floats; they are still integers beyond 2**53."""
    raw = emit(BASES["plain"], replace={where: literal})
    assert_rejected(verify(raw), R.MALFORMED)
    assert_rejected(verify(raw.decode()), R.MALFORMED)


@pytest.mark.parametrize("value", [2.0**53, 1e16, -1e16, 1e19, 1e20, 2.0**64, -(2.0**70)])
def test_builder_and_verifier_agree_on_large_integral_floats(value):
    """A float whose canonical form is an integer beyond 2**53 must not be signed by
    the builder unless the verifier accepts it from the wire and as a dict."""
    try:
        full = build_container(ALICE, "note", {"x": 1}, now=NOW, meta={"n": value})
    except (ValueError, CanonicalError):
        return  # refusing to build is a consistent answer
    from_wire = verify(encode_wire(full))
    from_dict = verify(full)
    assert from_wire.ok and from_dict.ok, (from_wire, from_dict)


def test_large_exponent_floats_round_trip():
    """Floats at and beyond 1e21 have an exponent form and are fine everywhere."""
    for value in (1e21, -1e21, 1.5e300, 1.7976931348623157e308, 5e-324, 1e-7, 1.5e-6, 0.000001):
        full = build_container(ALICE, "note", {"x": value}, now=NOW, meta={"n": value})
        assert verify(encode_wire(full)).ok, value
        assert verify(full).ok, value


# ------------------------------------------------------------ not a container at all


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"[1]", b'"x"', b"null", b"1", b"true", b"", b" ", b"\x00", b"{", b"}", b'{"a"}',
     "[]", "", "null", '"hmp_container"', b"[" + WIRES["plain"] + b"]", b"[" + WIRES["plain"][1:]],
)
def test_not_an_object_is_malformed(raw):
    assert_rejected(verify(raw), R.MALFORMED)


@pytest.mark.parametrize(
    "raw",
    [b"{}", {}, b'{"hmp_container":null}', b'{"hmp_container":[]}', b'{"hmp_container":"x"}',
     b'{"hmp_container":{}}', b'{"head":{}}', b'{"payload":{}}', b'{"head":{},"payload":{}}',
     b'{"head":null,"payload":{}}', {"hmp_container": {"head": {}, "payload": None}},
     b'{"hmp_containe":' + emit(BASES["plain"]["hmp_container"]) + b"}"],
)
def test_empty_or_wrong_shape_object_is_schema(raw):
    assert_rejected(verify(raw), R.SCHEMA)


# ------------------------------------------------------------ base64url / base58 fields


def _set_head(full: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    mutated = copy.deepcopy(full)
    set_at(mutated["hmp_container"]["head"], path, value)
    return mutated


def _with_low_bit(text: str) -> str:
    """`text` with the lowest bit of its last base64url digit set (non-canonical
    when the last quantum is partial)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    return text[:-1] + alphabet[alphabet.index(text[-1]) | 1]


def test_signature_encoding_errors():
    full = BASES["plain"]
    sig = full["hmp_container"]["head"]["signature"]
    assert len(sig) == 86
    cases = {
        "+" + sig[1:]: R.SCHEMA,
        "/" + sig[1:]: R.SCHEMA,
        "*" + sig[1:]: R.SCHEMA,
        sig[:40] + "=" + sig[41:]: R.SCHEMA,  # padding in the middle
        sig[:-1]: R.BAD_SIGNATURE,  # 85 characters: a length base64 cannot have
        sig[:-2]: R.BAD_SIGNATURE,  # 63 bytes
        sig + "AA": R.BAD_SIGNATURE,  # 65 bytes
        _with_low_bit(sig): R.BAD_SIGNATURE,  # non-canonical trailing bits
        "": R.BAD_SIGNATURE,
        b64url_encode(bytes(64)): R.BAD_SIGNATURE,
        b64url_encode(b64url_decode(sig)[:-1] + bytes([b64url_decode(sig)[-1] ^ 1])): R.BAD_SIGNATURE,
        BASES["zstd"]["hmp_container"]["head"]["signature"]: R.BAD_SIGNATURE,  # another container's signature
    }
    if "-" in sig or "_" in sig:
        cases[sig.replace("-", "+").replace("_", "/")] = R.SCHEMA  # standard base64 alphabet
    assert _with_low_bit(sig) != sig
    for bad, reason in cases.items():
        for raw in (encode_wire(_set_head(full, ("signature",), bad)), _set_head(full, ("signature",), bad)):
            assert_rejected(verify(raw), reason)
    # padding, however much, is ignored (spec A.4.3(5), profile section 13); the DID stays the same
    for padded in (sig + "=", sig + "==", sig + "==="):
        result = verify(_set_head(full, ("signature",), padded))
        assert result.ok and result.container_did == full["hmp_container"]["head"]["container_did"]
    # padding is optional on input (profile section 1) and signature is not signed
    assert verify(encode_wire(_set_head(full, ("signature",), sig + "=="))).ok


@pytest.mark.parametrize("path", [("key_recipient",), ("group_recipient", 1, "key_recipient")])
def test_key_envelope_encoding_errors(path):
    full = BASES["enc_single" if path[0] == "key_recipient" else "enc_group"]
    env = get_at(full["hmp_container"]["head"], path)
    assert len(env) == 107  # 80 bytes, last quantum of 3 characters
    schema_cases = [
        "+" + env[1:], "/" + env[1:], "*" + env[1:], env[:50] + "." + env[51:], env[:50] + "=" + env[51:],
        env[:-1],  # 79 bytes
        env[:-2],  # 106 - 1 characters: impossible length
        env + "A",  # 108 characters = 81 bytes
        _with_low_bit(env),  # non-canonical
        "", b64url_encode(bytes(79)), b64url_encode(bytes(81)),
    ]
    assert _with_low_bit(env) != env
    for bad in schema_cases:
        for raw in (encode_wire(_set_head(full, path, bad)), _set_head(full, path, bad)):
            assert_rejected(verify(raw), R.SCHEMA)
    # well-formed, 80 bytes, but not what was signed: a padded variant (read, since padding
    # is ignored) changes the signed text, so it can neither keep the DID nor the signature
    envelope = b64url_decode(env)
    for bad in (env + "=", env + "==", b64url_encode(envelope[:-1] + bytes([envelope[-1] ^ 1])), b64url_encode(bytes(80))):
        assert_rejected(verify(encode_wire(_set_head(full, path, bad))), R.CONTAINER_DID_MISMATCH)


@pytest.mark.parametrize("name", ["zstd", "gzip", "enc_single", "enc_group"])
def test_payload_encoding_errors(name):
    full = BASES[name]
    text = full["hmp_container"]["payload"]
    for bad in ("+" + text[1:], "/" + text[1:], "*" + text[1:], text + "!", text[:5] + "=" + text[6:],
                "x" + text if len(text) % 4 == 0 else text + "A" * (5 - len(text) % 4)):
        mutated = copy.deepcopy(full)
        mutated["hmp_container"]["payload"] = bad
        assert ref_b64url(bad) is None
        assert_rejected(verify(encode_wire(mutated)), R.SCHEMA)
    if len(text) % 4 in (2, 3):
        mutated = copy.deepcopy(full)
        assert _with_low_bit(text) != text
        mutated["hmp_container"]["payload"] = _with_low_bit(text)
        assert_rejected(verify(encode_wire(mutated)), R.SCHEMA)
        # correct padding: the same bytes, but the payload member's text is signed
        mutated["hmp_container"]["payload"] = text + "=" * (-len(text) % 4)
        assert_rejected(verify(encode_wire(mutated)), R.CONTAINER_DID_MISMATCH)
    data = b64url_decode(text)
    mutated = copy.deepcopy(full)
    mutated["hmp_container"]["payload"] = b64url_encode(data[:-1] + bytes([data[-1] ^ 0x40]))
    assert_rejected(verify(encode_wire(mutated)), R.PAYLOAD_HASH_MISMATCH)


def test_public_key_encoding_errors():
    """The pattern is part of the base schema (step 2); the decoded length and the
    DID binding are checked at step 6, after the content address (step 5): an
    unsigned change is a container_did_mismatch, a re-addressed and re-signed one
    (what an attacker can do) reaches step 6."""
    full = BASES["plain"]
    key = full["hmp_container"]["head"]["public_key"]
    pattern_cases = [
        "0" + key[1:], "O" + key[1:], "I" + key[1:], "l" + key[1:], "+" + key[1:],
        key[:31],  # 31 characters
        "z" * 65,  # 65 characters
        "\uff11" + key[1:],  # full-width digit one
        key + "\n", " " + key, "", b58encode(bytes(31)),
    ]
    not_32_bytes = ["z" * 44, "2" * 64, b58encode(bytes(33)), b58encode(bytes(64))]
    other_keys = [BOB.public_key_b58, MALLORY.public_key_b58, "1" * 32, b58encode(b"\x01" + bytes(31))]
    for bad in pattern_cases + not_32_bytes + other_keys:
        pattern_ok = re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{32,64}", bad) is not None
        assert pattern_ok == (bad not in pattern_cases), bad
        unsigned = _set_head(full, ("public_key",), bad)
        for raw in (encode_wire(unsigned), unsigned):
            assert_rejected(verify(raw), R.CONTAINER_DID_MISMATCH if pattern_ok else R.SCHEMA)
        signed = resign(full, lambda hmp, bad=bad: hmp["head"].__setitem__("public_key", bad), identity=MALLORY)
        expected = R.KEY_MISMATCH if bad in other_keys else R.SCHEMA
        assert (len(ref_b58(bad)) == 32) == (bad in other_keys) if pattern_ok else True
        assert_rejected(verify(encode_wire(signed)), expected)


_FIELDS_B64 = {
    "signature": ("signature",),
    "key_recipient": ("key_recipient",),
    "group_key_recipient": ("group_recipient", 0, "key_recipient"),
    "payload": None,
    "public_key": ("public_key",),
}
_JUNK = "+/*=.!~ \\\n-_A0z1lO"


@settings(max_examples=800, **HYPOTHESIS)
@given(field=st.sampled_from(sorted(_FIELDS_B64)), data=st.data())
def test_encoded_field_junk(field, data):
    name = {"key_recipient": "enc_single", "group_key_recipient": "enc_group"}.get(
        field, data.draw(st.sampled_from(["zstd", "gzip", "enc_single", "enc_group"]), label="base")
        if field == "payload" else data.draw(st.sampled_from(NAMES), label="base")
    )
    full = BASES[name]
    hmp = full["hmp_container"]
    path = _FIELDS_B64[field]
    text = hmp["payload"] if path is None else get_at(hmp["head"], path)
    op = data.draw(st.sampled_from(["insert", "replace", "truncate", "pad", "swap"]), label="op")
    c = data.draw(st.sampled_from(_JUNK), label="char")
    i = data.draw(st.integers(0, len(text) - 1), label="index")
    if op == "insert":
        bad = text[:i] + c + text[i:]
    elif op == "replace":
        bad = text[:i] + c + text[i + 1:]
    elif op == "truncate":
        bad = text[:i]
    elif op == "pad":
        bad = text + "=" * data.draw(st.integers(1, 3), label="pads")
    else:
        bad = text[:i] + text[i + 1:i + 2] + text[i:i + 1] + text[i + 2:]
    if bad == text:
        return
    mutated = copy.deepcopy(full)
    if path is None:
        mutated["hmp_container"]["payload"] = bad
    else:
        set_at(mutated["hmp_container"]["head"], path, bad)
    result = verify(encode_wire(mutated) if data.draw(st.booleans(), label="wire") else mutated)
    decoded = ref_b64url(bad)
    if field == "signature":
        if re.fullmatch(r"[A-Za-z0-9_-]*=*", bad) is None:
            assert_rejected(result, R.SCHEMA)
        elif decoded == b64url_decode(text):
            assert result.ok, result  # the same signature with padding
        else:
            assert_rejected(result, R.BAD_SIGNATURE)
    elif field in ("key_recipient", "group_key_recipient"):
        ok_envelope = decoded is not None and len(decoded) == 80 and len(bad) <= 1024
        assert_rejected(result, R.CONTAINER_DID_MISMATCH if ok_envelope else R.SCHEMA)
    elif field == "payload":
        if decoded is None:
            assert_rejected(result, R.SCHEMA)
        elif decoded == b64url_decode(text):
            assert_rejected(result, R.CONTAINER_DID_MISMATCH)
        else:
            assert_rejected(result, R.PAYLOAD_HASH_MISMATCH)
    else:  # public_key: the pattern is step 2, everything else about the key comes after step 5
        pattern_ok = re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{32,64}", bad) is not None
        assert_rejected(result, R.CONTAINER_DID_MISMATCH if pattern_ok else R.SCHEMA)


# ------------------------------------------------------------ exact reasons, step by step


def test_payload_changed_is_payload_hash_mismatch():
    for name in ("plain", "peer_announce"):
        mutated = copy.deepcopy(BASES[name])
        payload = mutated["hmp_container"]["payload"]
        first = next(iter(payload))
        payload[first] = "changed"
        assert_rejected(verify(encode_wire(mutated)), R.PAYLOAD_HASH_MISMATCH)
    # one byte of the plain payload's wire text
    raw = _replace_once(WIRES["plain"], b'"flag":false', b'"flag":true')
    assert_rejected(verify(raw), R.PAYLOAD_HASH_MISMATCH)
    raw = _replace_once(WIRES["plain"], b'"k":"v"', b'"k":"w"')
    assert_rejected(verify(raw), R.PAYLOAD_HASH_MISMATCH)


def test_future_timestamp():
    full = BASES["plain"]
    hour_ahead = format_time(NOW + timedelta(hours=1))
    assert_rejected(verify(encode_wire(_set_head(full, ("timestamp",), hour_ahead))), R.FUTURE_TIMESTAMP)
    signed = resign(full, lambda hmp: hmp["head"].__setitem__("timestamp", hour_ahead))
    assert_rejected(verify(encode_wire(signed)), R.FUTURE_TIMESTAMP)
    assert verify(encode_wire(signed), now=NOW + timedelta(minutes=55)).ok
    # the default skew is 300 s, inclusive
    for seconds, ok in ((300, True), (301, False)):
        at = format_time(NOW + timedelta(seconds=seconds))
        signed = resign(full, lambda hmp, at=at: hmp["head"].__setitem__("timestamp", at))
        result = verify(encode_wire(signed))
        assert result.ok if ok else result.reason == R.FUTURE_TIMESTAMP, (seconds, result)
    # an older, otherwise unchanged timestamp is a signed-field change
    earlier = format_time(NOW - timedelta(seconds=1))
    assert_rejected(verify(encode_wire(_set_head(full, ("timestamp",), earlier))), R.CONTAINER_DID_MISMATCH)


def test_container_did_text_elsewhere_in_the_container():
    """The verifier cuts `"container_did":<did>` out of the signed bytes when that text
    occurs once. Adding the same member text elsewhere (it cannot be signed: the DID
    hashes the content) must fall back to the full computation, not fool it."""
    full = BASES["plain"]
    did = full["hmp_container"]["head"]["container_did"]
    for target in (("meta",), ("related",), ("meta", "nested"), ("payload",)):
        tampered = copy.deepcopy(full)
        hmp = tampered["hmp_container"]
        get_at(hmp, target)["container_did"] = did
        if target == ("payload",):
            assert_rejected(verify(encode_wire(tampered)), R.PAYLOAD_HASH_MISMATCH)
            hmp["head"]["payload_hash"] = sha256_tag(canon(hmp["payload"]))
        assert encode_wire(tampered).count(b'"container_did":"' + did.encode() + b'"') == 2
        for raw in (encode_wire(tampered), tampered):
            assert_rejected(verify(raw), R.CONTAINER_DID_MISMATCH)
    # a signed container may well carry another container's DID under that key
    other = BASES["zstd"]["hmp_container"]["head"]["container_did"]
    signed = resign(full, lambda hmp: hmp["meta"].__setitem__("container_did", other))
    assert verify(encode_wire(signed)).ok and verify(signed).ok


def test_container_did_changed():
    full = BASES["plain"]
    other_qm = BASES["zstd"]["hmp_container"]["head"]["container_did"]
    assert other_qm.startswith("did:hmp:container:Qm")
    assert_rejected(verify(encode_wire(_set_head(full, ("container_did",), other_qm))), R.CONTAINER_DID_MISMATCH)
    # an opaque DID is not recomputed, but it is signed
    assert_rejected(verify(encode_wire(_set_head(full, ("container_did",), "did:example:c1"))), R.BAD_SIGNATURE)
    # a Qm-looking DID that is not a multihash is opaque too
    assert_rejected(verify(encode_wire(_set_head(full, ("container_did",), "did:hmp:container:Qm0"))),
                    R.BAD_SIGNATURE)


def test_key_mismatch():
    full = BASES["plain"]
    # Mallory puts her key in Alice's container, re-addresses and signs it
    stolen = resign(full, lambda hmp: hmp["head"].__setitem__("public_key", MALLORY.public_key_b58), MALLORY)
    assert_rejected(verify(encode_wire(stolen)), R.KEY_MISMATCH)
    # the same swap without re-addressing stops at the content address
    assert_rejected(verify(encode_wire(_set_head(full, ("public_key",), BOB.public_key_b58))),
                    R.CONTAINER_DID_MISMATCH)
    # sender_did of another agent, key left alone: the self-certifying DID does not match
    assert_rejected(verify(encode_wire(_set_head(full, ("sender_did",), BOB.did))), R.CONTAINER_DID_MISMATCH)
    signed = resign(full, lambda hmp: hmp["head"].__setitem__("sender_did", BOB.did))
    assert_rejected(verify(encode_wire(signed)), R.KEY_MISMATCH)
    # both swapped consistently, signed by the wrong key
    signed = resign(full, lambda hmp: hmp["head"].update(sender_did=BOB.did, public_key=BOB.public_key_b58))
    assert_rejected(verify(encode_wire(signed)), R.BAD_SIGNATURE)
    # an opaque sender DID whose pinned key differs
    opaque = resign(full, lambda hmp: hmp["head"].__setitem__("sender_did", "did:example:alice"))
    first = verify(encode_wire(opaque))
    assert first.ok and first.pin_candidate == ("did:example:alice", ALICE.public_key)
    registry = MemoryKeyRegistry()
    registry.pin("did:example:alice", MALLORY.public_key)
    assert_rejected(verify(encode_wire(opaque), verifier=Verifier(registry=registry)), R.KEY_MISMATCH)


def test_unknown_key_and_pinned_key():
    full = build_container(ALICE, "note", {"x": 1}, now=NOW, include_public_key=False)
    assert_rejected(verify(encode_wire(full)), R.UNKNOWN_KEY)
    registry = MemoryKeyRegistry()
    registry.pin(ALICE.did, ALICE.public_key)
    assert verify(encode_wire(full), verifier=Verifier(registry=registry)).ok
    # a pinned key that does not hash to a self-certifying DID is refused as such
    wrong = MemoryKeyRegistry()
    wrong.pin(ALICE.did, MALLORY.public_key)
    assert_rejected(verify(encode_wire(full), verifier=Verifier(registry=wrong)), R.KEY_MISMATCH)
    # an opaque DID: the pinned key is used, and the signature does not verify with it
    opaque = resign(full, lambda hmp: hmp["head"].__setitem__("sender_did", "did:example:alice"))
    assert_rejected(verify(encode_wire(opaque)), R.UNKNOWN_KEY)
    wrong_opaque = MemoryKeyRegistry()
    wrong_opaque.pin("did:example:alice", MALLORY.public_key)
    assert_rejected(verify(encode_wire(opaque), verifier=Verifier(registry=wrong_opaque)), R.BAD_SIGNATURE)
    right_opaque = MemoryKeyRegistry()
    right_opaque.pin("did:example:alice", ALICE.public_key)
    assert verify(encode_wire(opaque), verifier=Verifier(registry=right_opaque)).ok


def test_revoked():
    registry = MemoryKeyRegistry()
    registry.revoke(ALICE.did, NOW - timedelta(hours=1))
    assert_rejected(verify(WIRES["plain"], verifier=Verifier(registry=registry)), R.REVOKED)
    later = MemoryKeyRegistry()
    later.revoke(ALICE.did, NOW + timedelta(hours=1))
    result = verify(WIRES["plain"], verifier=Verifier(registry=later))
    assert result.ok and result.key_revoked_later


def test_remembered_key_still_asks_the_registry():
    """A sender key remembered from an earlier container (the verifier's key cache)
    skips the decoding and the DID hash, never the registry: a pin or a revocation
    recorded after it was cached decides the next container, and an opaque DID stays
    a pin candidate (TOFU) on a cache hit."""
    registry = MemoryKeyRegistry()
    verifier = Verifier(registry=registry)
    assert verify(WIRES["plain"], verifier=verifier).ok
    assert verify(WIRES["plain"], verifier=verifier).ok  # served by the cache
    registry.pin(ALICE.did, MALLORY.public_key)
    assert_rejected(verify(WIRES["plain"], verifier=verifier), R.KEY_MISMATCH)
    revoked = MemoryKeyRegistry()
    verifier = Verifier(registry=revoked)
    assert verify(WIRES["plain"], verifier=verifier).ok
    revoked.revoke(ALICE.did, NOW + timedelta(hours=1))
    result = verify(WIRES["plain"], verifier=verifier)
    assert result.ok and result.key_revoked_later
    revoked.revoke(ALICE.did, NOW - timedelta(hours=1))
    assert_rejected(verify(WIRES["plain"], verifier=verifier), R.REVOKED)
    opaque = encode_wire(resign(BASES["plain"], lambda hmp: hmp["head"].__setitem__("sender_did", "did:example:alice")))
    verifier = Verifier(registry=MemoryKeyRegistry())
    for _ in range(2):  # a miss, then a hit
        result = verify(opaque, verifier=verifier)
        assert result.ok and result.pin_candidate == ("did:example:alice", ALICE.public_key)


def test_unsupported_sig_algo():
    full = BASES["plain"]
    # unsigned change: the content address catches it first
    assert_rejected(verify(encode_wire(_set_head(full, ("sig_algo",), "rsa"))), R.CONTAINER_DID_MISMATCH)
    for algo in ("rsa", "Ed25519", "ed448", "ed25519 ", "none"):
        signed = resign(full, lambda hmp, algo=algo: hmp["head"].__setitem__("sig_algo", algo))
        assert_rejected(verify(encode_wire(signed)), R.UNSUPPORTED_SIG_ALGO)
    for algo in ("", "x" * 129):
        signed = resign(full, lambda hmp, algo=algo: hmp["head"].__setitem__("sig_algo", algo))
        assert_rejected(verify(encode_wire(signed)), R.SCHEMA)


def test_signature_of_another_container():
    full = BASES["plain"]
    for other in ("zstd", "gzip", "enc_single", "peer_announce"):
        sig = BASES[other]["hmp_container"]["head"]["signature"]
        assert_rejected(verify(encode_wire(_set_head(full, ("signature",), sig))), R.BAD_SIGNATURE)
    mallory = resign(full, lambda hmp: None, identity=MALLORY)  # right key in head, wrong signer
    assert_rejected(verify(encode_wire(mallory)), R.BAD_SIGNATURE)


def test_class_schema():
    if not (ROOT / "schemas" / "classes" / "peer_announce.json").is_file():
        pytest.skip("schemas/classes/peer_announce.json is missing: no class schema to violate")
    invalid_payloads = [{"addresses": "not-a-list"}, {"name": "x"}, {"addresses": [{"addr": ""}]},
                        {"addresses": [], "key_is_falsified": "yes"}]
    for payload in invalid_payloads:
        # the builder refuses them; another implementation might not
        with pytest.raises(ValueError):
            build_container(ALICE, "peer_announce", payload, now=NOW)
        plain = sign({"head": hand_head("peer_announce", payload_type="json", payload_hash=sha256_tag(canon(payload))),
                      "payload": payload})
        assert_rejected(verify(encode_wire(plain)), R.CLASS_SCHEMA)
        assert_rejected(verify(plain), R.CLASS_SCHEMA)
        for algo in ("zstd", "gzip"):
            packed = compressed_container(_compress(canon(payload), algo), algo, "peer_announce")
            assert_rejected(verify(encode_wire(packed)), R.CLASS_SCHEMA)
    # a compressed payload that is not an object
    full = compressed_container(_compress(b"[1]", "zstd"), "zstd", "peer_announce")
    assert_rejected(verify(encode_wire(full)), R.CLASS_SCHEMA)
    # the same payload under an unknown class is accepted (store-and-forward)
    unknown = build_container(ALICE, "no_such_class", {"addresses": "not-a-list"}, now=NOW)
    result = verify(encode_wire(unknown))
    assert result.ok and "class" in result.store_and_forward
    # an encrypted payload cannot be checked: accepted unchanged
    encoded = encode_payload({"addresses": "not-a-list"}, encrypt_to=[BOB.public_key], rng=_rng(1))
    head = hand_head("peer_announce", payload_type=encoded.payload_type, payload_hash=sha256_tag(encoded.hashed),
                     encryption_algo="x25519-chacha20poly1305", recipient=[BOB.did],
                     key_recipient=b64url_encode(encoded.envelopes[0]))
    sealed = sign({"head": head, "payload": encoded.value})
    assert verify(encode_wire(sealed)).ok


def test_schema_cross_field_rules():
    full = BASES["zstd"]
    cases = [
        lambda h: h.__setitem__("compression", "gzip"),  # payload_type and compression disagree
        lambda h: h.__setitem__("payload_type", "json"),  # a json payload must be an object
        lambda h: h.__setitem__("timestamp", "2026-02-30T10:15:00Z"),
        lambda h: h.__setitem__("timestamp", "2026-11-29T24:00:00Z"),
        lambda h: h.__setitem__("timestamp", "2026-11-29T10:15:00.1234567Z"),
        lambda h: h.__setitem__("timestamp", "2026-11-29T10:15:00+00:00"),
        lambda h: h.__setitem__("payload_type", "zstd+gzip+json"),
        lambda h: h.__setitem__("encryption_algo", "x25519-chacha20poly1305"),  # not encrypted
        lambda h: h.__setitem__("key_recipient", b64url_encode(bytes(80))),
    ]
    for change in cases:
        mutated = copy.deepcopy(full)
        change(mutated["hmp_container"]["head"])
        assert_rejected(verify(encode_wire(mutated)), R.SCHEMA)
    # a network form the node does not know passes the schema (stored, never forwarded:
    # profile section 13); here it fails only later, because it changes the signed bytes
    for network in ("lan:not-a-cidr/8", "lan:10.0.0.0/33", "lan:192.168.10.0"):
        mutated = copy.deepcopy(full)
        mutated["hmp_container"]["head"]["network"] = network
        assert_rejected(verify(encode_wire(mutated)), R.CONTAINER_DID_MISMATCH)
    enc = BASES["enc_single"]
    both = copy.deepcopy(enc)
    both["hmp_container"]["head"]["group_recipient"] = [{"recipient": BOB.did, "key_recipient": "AA"}]
    assert_rejected(verify(encode_wire(both)), R.SCHEMA)
    two = copy.deepcopy(enc)
    two["hmp_container"]["head"]["recipient"].append(CAROL.did)
    assert_rejected(verify(encode_wire(two)), R.SCHEMA)


def test_expired_is_not_rejected():
    full = build_container(ALICE, "note", {"x": 1}, now=NOW - timedelta(days=2), ttl=NOW - timedelta(days=1))
    result = verify(encode_wire(full))
    assert result.ok and result.expired


def test_unexpected_input_types_do_not_raise():
    for raw in (None, 5, 1.5, [], [1, 2], (), memoryview(WIRES["plain"]), b"\x00" * 64):
        result = VERIFIER.verify(raw, now=NOW)  # type: ignore[arg-type]
        assert isinstance(result, VerifyResult)
    assert VERIFIER.verify(memoryview(WIRES["plain"]), now=NOW).ok  # type: ignore[arg-type]


def test_recursion_limit_is_untouched():
    before = sys.getrecursionlimit()
    verify(b"[" * 100_000)
    assert sys.getrecursionlimit() == before
