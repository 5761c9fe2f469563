"""The base container schema (schemas/container.schema.json) as straight-line Python.

Every container pays for this check, so it is written out by hand: a few
microseconds instead of ~15 us through a generic validator. The JSON Schema
file stays the contract; tests/test_structure.py checks on generated inputs that
this code and `jsonschema` accept exactly the same containers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["check_structure", "passed_before", "DID_RE"]

Check = Callable[[Any], "str | None"]

#: DIDs are printable ASCII; this pattern means the same in ECMAScript and Python.
DID_RE = re.compile(r"did:[a-z0-9]+:[!-~]+")
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z")
_B64URL = re.compile(r"[A-Za-z0-9_-]*=*")
_B58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")
_CLASS = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_PAYLOAD_TYPE = re.compile(r"[a-z0-9]+(\+[a-z0-9]+)*")
_HASH = re.compile(r"sha256:[0-9a-f]{64}")


def _string(max_len: int, min_len: int = 0, pattern: re.Pattern[str] | None = None) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is not str:
            return "must be a string"
        if not min_len <= len(value) <= max_len:
            return f"length must be {min_len}..{max_len}"
        if pattern is not None and pattern.fullmatch(value) is None:
            return "has the wrong form"
        return None

    return check


def _array(max_items: int, item: Check, min_items: int = 0) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is not list:
            return "must be an array"
        if not min_items <= len(value) <= max_items:
            return f"must have {min_items}..{max_items} items"
        for i, entry in enumerate(value):
            problem = item(entry)
            if problem is not None:
                return f"[{i}] {problem}"
        return None

    return check


def _boolean(value: Any) -> str | None:
    return None if type(value) is bool else "must be a boolean"


def _unit_number(value: Any) -> str | None:
    if type(value) is not int and type(value) is not float:
        return "must be a number"
    return None if 0 <= value <= 1 else "must be within 0..1"


_did = _string(512, 0, DID_RE)
_token = _string(128, 1)
_envelope = _string(1024, 0, _B64URL)


def _group_entry(value: Any) -> str | None:
    if type(value) is not dict:
        return "must be an object"
    for name, check in (("recipient", _did), ("key_recipient", _envelope)):
        if name not in value:
            return f"needs {name}"
        problem = check(value[name])
        if problem is not None:
            return f"{name} {problem}"
    return None


_REQUIRED_HEAD = (
    "version", "class", "class_version", "class_id", "container_did", "schema",
    "sender_did", "timestamp", "payload_hash", "sig_algo", "signature", "payload_type",
)

_HEAD: dict[str, Check] = {
    "version": _string(32, 1),
    "class": _string(128, 1, _CLASS),
    "subclass": _string(256),
    "class_version": _string(64),
    "class_id": _string(256),
    "schema": _string(2048),
    "timestamp": _string(64, 0, _TIME),
    "ttl": _string(64, 0, _TIME),
    "tags": _array(256, _string(256)),
    "container_did": _did,
    "sender_did": _did,
    "public_key": _string(64, 32, _B58),
    "recipient": _array(1024, _did),
    "key_recipient": _envelope,
    "group_recipient": _array(1024, _group_entry, min_items=1),
    "broadcast": _boolean,
    "network": _string(256),  # any form: one the node does not know is stored, never forwarded
    "encryption_algo": _token,
    "sig_algo": _token,
    "signature": _string(4096, 0, _B64URL),
    "compression": _token,
    "payload_type": _string(128, 0, _PAYLOAD_TYPE),
    "payload_hash": _string(71, 0, _HASH),
    "confidence": _unit_number,
    "magnet_uri": _string(4096),
}

_related_targets = _array(4096, _did)


def _related(value: Any) -> str | None:
    if type(value) is not dict:
        return "must be an object"
    if len(value) > 256:
        return "has more than 256 relations"
    for name, targets in value.items():
        problem = _did(targets) if type(targets) is str else _related_targets(targets)
        if problem is not None:
            return f"{name} {problem}"
    return None


# Most head members repeat from container to container (version, class, schema,
# sender_did, public_key, sig_algo, ...): remember string values already found
# valid. Bounded; values are immutable strings, so a hit is always still valid.
_KNOWN_GOOD: set[tuple[str, Any]] = set()
_KNOWN_GOOD_SIZE = 8192
#: members unique to each container: never found in the memo, so never looked up or added
_UNIQUE = frozenset({"container_did", "signature", "payload_hash"})
_REQUIRED_SET = frozenset(_REQUIRED_HEAD)


def check_structure(hmp: Any) -> str | None:
    """None when `hmp` (the hmp_container object) matches the base schema, else why not."""
    if type(hmp) is not dict:
        return "hmp_container must be an object"
    if "head" not in hmp or "payload" not in hmp:
        return "hmp_container needs head and payload"
    head = hmp["head"]
    if type(head) is not dict:
        return "head must be an object"
    if not head.keys() >= _REQUIRED_SET:  # one C-level test; the loop names the first missing
        for name in _REQUIRED_HEAD:
            if name not in head:
                return f"head needs {name}"
    stable = _stable_key(head)
    if stable is not None and stable in _STABLE_HEADS:
        # every other member is as in a head that passed: check the four that differ
        for name in STABLE_CUT:
            value = head[name]
            if name == "timestamp" and type(value) is str and (name, value) in _KNOWN_GOOD:
                continue
            if _HEAD[name](value) is not None:
                break  # the loop below names the first problem in the head's order
        else:
            return _check_blocks(hmp)
    problem = _check_members(head)
    if problem is not None:
        return problem
    if stable is not None and len(_STABLE_HEADS) < _KNOWN_GOOD_SIZE:
        _STABLE_HEADS.add(stable)
    return _check_blocks(hmp)


def passed_before(hmp: dict[str, Any]) -> bool:
    """True when `hmp` (a dict whose head is a dict) matches the base schema because
    the rest of its head (all but STABLE_CUT) passed before and its timestamp and blocks
    pass, with the other three STABLE_CUT members left unchecked: the verifier's
    canonical fast path proves those later (`payload_hash` equals the hash it computes,
    `container_did` is the content-addressed DID it computes, `signature` decodes to 64
    bytes) and otherwise runs the full checks. False means: not known, check in full."""
    head = hmp["head"]
    if not head.keys() >= _REQUIRED_SET:
        return False
    stamp, signature = head["timestamp"], head["signature"]
    if type(stamp) is not str or len(stamp) > 64 or type(signature) is not str or len(signature) > 4096:
        return False
    if ("timestamp", stamp) not in _KNOWN_GOOD and _TIME.fullmatch(stamp) is None:
        return False
    stable = _stable_key(head)
    return stable is not None and stable in _STABLE_HEADS and _check_blocks(hmp) is None


def _check_members(head: dict[str, Any]) -> str | None:
    good = _KNOWN_GOOD
    unique = _UNIQUE
    for name, value in head.items():
        memo = type(value) is str and name not in unique
        if memo and (name, value) in good:
            continue
        check = _HEAD.get(name)
        if check is not None:
            problem = check(value)
            if problem is not None:
                return f"head/{name} {problem}"
            if memo and len(good) < _KNOWN_GOOD_SIZE:
                good.add((name, value))
    return None


def _check_blocks(hmp: dict[str, Any]) -> str | None:
    if "meta" in hmp and type(hmp["meta"]) is not dict:
        return "meta must be an object"
    if "related" in hmp:
        problem = _related(hmp["related"])
        if problem is not None:
            return f"related/{problem}"
    return None


#: Head members that differ from one container to the next; the rest of a head (class,
#: schema, sender, key, tags, ...) repeats across a sender's containers.
STABLE_CUT = ("container_did", "payload_hash", "signature", "timestamp")
#: JSON texts of the rest of heads that passed (bounded like _KNOWN_GOOD)
_STABLE_HEADS: set[bytes] = set()


def _stable_key(head: dict[str, Any]) -> bytes | None:
    """The JSON text of `head` without the members of STABLE_CUT (None when one is
    missing or the rest has no JSON text). Equal texts are equal members with equal
    values, and every member check is a function of its value alone."""
    rest = dict(head)
    try:
        for name in STABLE_CUT:
            del rest[name]
        return orjson.dumps(rest, option=orjson.OPT_PASSTHROUGH_SUBCLASS)  # a str subclass is no str here
    except (KeyError, orjson.JSONEncodeError):
        return None
