"""The canonical fast path of verification (issue 15).

A container whose wire text is exactly `canonical_json` of its full form (what
`encode_wire` writes) is parsed once and proven canonical without the per-value
walk of the full parse; the payload's canonical text, the signed bytes and the
container-DID input are built from one serialisation of the payload and of the
(small) head. For anything else, or any doubt, `canonical_wire` returns None and
the verifier runs its full parse, so reason codes and check order never depend on
this module (tests/test_verify_differential.py compares the two paths).

The proof, for text `data` that parses to `doc`:
- the sorted, strict-integer orjson text of `doc` (joined from its parts) is
  `data`: compact, keys sorted by code point, no duplicate key (a duplicate would
  be dropped, the text would be shorter), integers within ±(2**53-1), strings
  escaped as canonical JSON does;
- every float literal in `data` is already its RFC 8785 form (msgspec hands each
  literal's text to `_float_literal`; orjson does not show it), so the text
  `prepare` + `dumps_prepared` would write is `data` itself;
- nothing nests `max_depth` deep (`_nesting_below`).
msgspec is the dependency for the second point: the one fast parser that exposes
float literals; without it the fast path costs more than the full parse
(docs/benchmarks-journal.md, "Issue 15: the canonical fast path").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from hmpnode.container.canonical import jcs_number

__all__ = ["CanonicalWire", "canonical_wire", "cut_member"]

_SORTED = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER
_FULL_PREFIX = b'{"hmp_container":'
#: the head of a canonical container built by hmpnode starts with one of these keys
_HEAD_AT = b'"hmp_container":{"head":{"'
_FIRST_HEAD_KEYS = (b'broadcast"', b'class"')


class _NotCanonical(Exception):
    pass


_FLOATS: dict[str, float] = {}
_FLOAT_CACHE_SIZE = 4096


def _float_literal(text: str) -> float:
    """msgspec's float hook: the value of a float literal that is already canonical."""
    value = _FLOATS.get(text)
    if value is None:
        value = float(text)
        if math.isinf(value) or jcs_number(value) != text:
            raise _NotCanonical
        if len(_FLOATS) < _FLOAT_CACHE_SIZE:
            _FLOATS[text] = value
    return value


_DECODER = msgspec.json.Decoder(float_hook=_float_literal)


@dataclass(frozen=True, slots=True)
class CanonicalWire:
    """A full-form container whose wire text is canonical, with the bytes verification hashes."""

    container: dict[str, Any]  # the full form as parsed
    signed: bytes  # canonical hmp_container without head.signature (the signed bytes)
    payload: bytes  # canonical text of hmp_container.payload (what payload_hash covers for "json")
    did_input: bytes | None  # ... without head.container_did as well (None: not cut, serialise)
    hmp: bytes  # canonical text of hmp_container (what the store keeps: VerifyResult.body)


def cut_member(text: bytes, key: bytes, value: bytes) -> bytes | None:
    """`text`, the canonical JSON of an object, without its member `key` (`"name":` as
    canonical JSON writes it) and that member's comma, when the member's value is the
    text `value`. None unless `key` occurs exactly once in `text` (then, if the
    object has that member, it is that one: a JSON string cannot hold an unescaped
    quote), is followed by `value` and has a neighbour. (A short key is found with
    skips; a search for the whole member, a long random-looking needle, reads every byte.)"""
    at = text.find(key)
    if at < 0 or text.find(key, at + 1) >= 0:
        return None
    end = at + len(key) + len(value)
    if not text.startswith(value, at + len(key)):
        return None
    if text[end:end + 1] == b",":
        return text[:at] + text[end + 1:]
    if text[at - 1:at] == b",":
        return text[:at - 1] + text[end:]
    return None


def _nesting_below(data: bytes, doc: dict[str, Any], max_depth: int) -> bool:
    """True when nothing in `doc` (parsed from `data`) nests `max_depth` deep.
    Fewer than `max_depth` brackets in the text prove it (one memchr per bracket);
    otherwise no line of the 2-space indented form may be indented 2*max_depth
    spaces (JSON strings hold no raw newline; a dict or list at depth d >= 1 is
    written on a line indented 2*d)."""
    n = 0
    for bracket in b"{[":
        at = data.find(bracket)
        while at >= 0:
            n += 1
            if n > max_depth:
                return orjson.dumps(doc, option=orjson.OPT_INDENT_2).find(b"\n" + b" " * (2 * max_depth)) < 0
            at = data.find(bracket, at + 1)
    return True


def _members(obj: dict[str, Any], texts: dict[str, bytes]) -> bytes:
    """Canonical text of `obj` from its members' canonical texts (`texts`, else serialised)."""
    return b"{" + b",".join(
        orjson.dumps(k) + b":" + (texts[k] if k in texts else orjson.dumps(obj[k], option=_SORTED)) for k in sorted(obj)
    ) + b"}"


def _hmp_text(hmp: dict[str, Any], head: bytes, payload: bytes) -> bytes:
    """Canonical text of hmp_container given those of its head and payload."""
    if len(hmp) == 2:
        return b"".join((b'{"head":', head, b',"payload":', payload, b"}"))
    return _members(hmp, {"head": head, "payload": payload})


def canonical_wire(data: bytes, max_bytes: int, max_depth: int) -> CanonicalWire | None:
    """The parts of a canonical full-form container, or None when `data` is not one
    (or is over `max_bytes`, or nests `max_depth` deep): the caller then parses in full.

    The head and the payload are serialised once each; the canonical text of the
    whole, joined from them, must be `data` byte for byte; the signed bytes and the
    DID input are joined from the same payload text and the head serialised without
    signature (and container_did)."""
    if len(data) > max_bytes or max_depth < 2:
        return None
    at = data.find(_HEAD_AT)
    if at < 0 or not data.startswith(_FIRST_HEAD_KEYS, at + len(_HEAD_AT)):
        return None  # not sorted the way hmpnode writes; cheap to tell before parsing
    try:
        doc = _DECODER.decode(data)
    except Exception:  # noqa: BLE001 - not JSON, not canonical, too deep for the parser: the full parse says which
        return None
    if type(doc) is not dict:
        return None
    hmp = doc.get("hmp_container")
    if type(hmp) is not dict or "payload" not in hmp:
        return None
    head = hmp.get("head")
    if type(head) is not dict or type(head.get("signature")) is not str:
        return None
    try:
        head_text = orjson.dumps(head, option=_SORTED)
        payload = orjson.dumps(hmp["payload"], option=_SORTED)
        if len(doc) == 1 and len(hmp) == 2:
            whole = b"".join((_FULL_PREFIX, b'{"head":', head_text, b',"payload":', payload, b"}}"))
            if whole != data:
                return None
            hmp_text = data[len(_FULL_PREFIX):-1]
        else:
            hmp_text = _hmp_text(hmp, head_text, payload)
            if _members(doc, {"hmp_container": hmp_text}) != data:
                return None
        # the head without signature, then without container_did too: serialising the
        # small head again costs less than finding the members in its text
        unsigned = dict(head)
        del unsigned["signature"]
        unsigned_head = orjson.dumps(unsigned, option=_SORTED)
        did_input = None
        if type(unsigned.pop("container_did", None)) is str:
            did_input = _hmp_text(hmp, orjson.dumps(unsigned, option=_SORTED), payload)
    except orjson.JSONEncodeError:
        return None
    if not _nesting_below(data, doc, max_depth):
        return None
    return CanonicalWire(doc, _hmp_text(hmp, unsigned_head, payload), payload, did_input, hmp_text)
