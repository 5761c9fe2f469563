"""The `evaluations` block (HMP §3.17, profile section 9).

Each item is one agent's signed reaction to a container:

    {"value": -0.4, "type": "oppose", "target": "did:hmp:container:...",
     "timestamp": "2026-11-29T10:15:00Z", "agent_did": "did:hmp:agent:...",
     "public_key": base58btc, "sig_algo": "ed25519", "signature": base64url}

signed over the UTF-8 bytes of
`value + ", " + type + ", " + target + ", " + timestamp + ", " + agent_did`,
where `value` is written exactly as canonical JSON writes the number
(`-0.4`, `1`, `0.5`; a JSON `1.0` and `1` both sign as `1`) and every other
field is taken verbatim. `public_key` is optional; without it the key comes
from the registry.

Field rules (hmpnode's choices, checked by `build_evaluation` and
`verify_evaluation`):

* `value`: a finite JSON number in [-1, 1]; `true`/`false` are not numbers.
* `type`: one of `support`, `oppose`, `extend`, `replace`, `comment`, or a
  custom type: a non-empty string of at most 64 characters.
* `type` and `target` must not contain `", "` (comma + space). The signed
  string is comma-joined; with these two fields free of the separator (the
  number and the RFC 3339 timestamp never contain it) the string splits back
  into its fields in exactly one way, so one signature can never be read as
  signing a different (type, target) pair. `agent_did`, the last field, needs
  no such rule.
* `timestamp`: RFC 3339 UTC with `Z` (profile section 1).
* Members beyond the ones above are allowed and ignored (spec 3.2, profile
  section 13): the signed string does not cover them, so anyone relaying the
  item could change them. They are therefore never kept: `kept_form` drops
  them (and the signature's base64url padding) before an item is stored or
  merged, so one signed item has one stored form and one `evaluations_hash`.

Replay rule (closes the gap profile section 9 names)
----------------------------------------------------

The signed string does not name the evaluated container, so an item copied
from the evaluations of container A onto container B verifies just as well.
hmpnode counts an item for container C only if one of these holds:

1. `target == C`: the agent evaluated C directly, without a justification
   container; or
2. `target` is a container the node holds whose `head.sender_did` equals the
   item's `agent_did`, and whose `related` block points at C under any
   relation (string or array value). The agent's own signed justification
   container thus names the evaluated container, and nobody else can sign
   one in the agent's name.

Otherwise the item is rejected as `replay`. When `target != C` and the node
does not hold the target container yet, the item is neither accepted nor
rejected: `verify_evaluation` returns `pending=True` with reason
`target_unknown`, and the node re-checks the item when the target arrives
(its signature has already been checked by then).

Residual risks:

* A justification container whose `related` block points at several
  containers (say A and B) makes the item count for each of them: the same
  value and type then apply to both. An agent that wants an evaluation to
  count for one container only should point its justification at that one
  container only, or use the container itself as `target`.
* The rule binds an item to a container, not to a moment: a peer can
  withhold an agent's newer item and serve an older one (rollback by
  suppression). Merging keeps the latest item a node has ever seen, but no
  node can prove that no newer item exists.
* Timestamps are the agent's own claim. A compromised key can backdate items
  to before its revocation (those still verify), and an agent can post-date
  an item so that it outranks its later ones; `verify_evaluation(now=...)`
  rejects items more than `max_skew` ahead of the caller's clock.
* Case 2 trusts that the node verified the target container (signature and
  key binding) before `resolve` reports its sender.

Merge rule: one active item per `agent_did` (per evaluated container): the
later `timestamp` wins, comparing parsed instants, not strings; on an equal
instant the lexicographically greater `signature` string wins; if even the
signatures are equal (the same signed item, with and without `public_key`),
the greater `canonical_json(item)` wins, so the result never depends on input
order. `items` are sorted by `agent_did` (code point order) and
`evaluations_hash` = sha256_tag(canonical_json(items)).

All functions are pure: no clock, no I/O. `verify_evaluation` never raises
on hostile input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from hmpnode.container.backlinks import links_from_related
from hmpnode.container.canonical import canonical_json, jcs_number
from hmpnode.container.encoding import (
    EncodingError,
    b64url_decode,
    b64url_encode,
    format_time,
    parse_time,
    sha256_tag,
)
from hmpnode.identity.keys import Identity, ed25519_verify, public_key_from_b58
from hmpnode.identity.registry import KeyRegistry, bind_key

__all__ = [
    "EVALUATION_TYPES",
    "MAX_TYPE_LENGTH",
    "SEPARATOR",
    "SIG_ALGO",
    "DEFAULT_MAX_SKEW",
    "EvaluationError",
    "EvaluationCheck",
    "Resolve",
    "is_valid_type",
    "signed_string",
    "build_evaluation",
    "verify_evaluation",
    "kept_form",
    "merge_evaluations",
    "evaluations_hash",
    "evaluations_block",
]

EVALUATION_TYPES = ("support", "oppose", "extend", "replace", "comment")
MAX_TYPE_LENGTH = 64
SEPARATOR = ", "
SIG_ALGO = "ed25519"
DEFAULT_MAX_SKEW = timedelta(seconds=300)
_REQUIRED = ("value", "type", "target", "timestamp", "agent_did", "sig_algo", "signature")
_ALLOWED = frozenset(_REQUIRED) | {"public_key"}

# resolve(target_did) -> (sender_did, related) of the container the node holds, or None.
Resolve = Callable[[str], "tuple[str, Any] | None"]


class EvaluationError(ValueError):
    """An evaluation item cannot be built or written as its signed string."""


@dataclass(frozen=True, slots=True)
class EvaluationCheck:
    """Outcome of `verify_evaluation`. `reason` is a stable code when not ok:
    `malformed`, `future_timestamp`, `unknown_key`, `key_mismatch`, `revoked`,
    `unsupported_sig_algo`, `bad_signature`, `replay`, `target_unknown`.
    `pending` is True only with `target_unknown`: authentic, but not yet
    known to belong to the evaluated container."""

    ok: bool
    reason: str | None = None
    detail: str = ""
    pending: bool = False


def _fail(reason: str, detail: str, pending: bool = False) -> EvaluationCheck:
    return EvaluationCheck(False, reason, detail, pending)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _format_value(value: Any) -> str:
    if not _is_number(value):
        raise EvaluationError("value must be a JSON number (not a boolean)")
    if isinstance(value, float):
        return jcs_number(value)  # raises CanonicalError (a ValueError) for NaN/Infinity
    return str(int(value))


def _value_in_range(value: Any) -> bool:
    if not _is_number(value):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return -1 <= value <= 1


def is_valid_type(kind: Any) -> bool:
    """A standard type, or a custom one: non-empty, ≤ 64 characters, no ", "."""
    return (
        isinstance(kind, str)
        and 0 < len(kind) <= MAX_TYPE_LENGTH
        and SEPARATOR not in kind
    )


def _is_valid_target(target: Any) -> bool:
    return isinstance(target, str) and bool(target) and SEPARATOR not in target


def signed_string(item: Mapping[str, Any]) -> bytes:
    """UTF-8 of `value, type, target, timestamp, agent_did` joined by ", ".

    Raises EvaluationError when a field is missing or of the wrong type
    (value must be a number and not a boolean; the others strings)."""
    try:
        value = item["value"]
        fields = [item[name] for name in ("type", "target", "timestamp", "agent_did")]
    except (KeyError, TypeError):
        raise EvaluationError("item lacks value/type/target/timestamp/agent_did") from None
    if not all(isinstance(f, str) for f in fields):
        raise EvaluationError("type, target, timestamp and agent_did must be strings")
    try:
        text = SEPARATOR.join([_format_value(value), *fields])
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise EvaluationError("item strings are not valid Unicode") from None
    except ValueError as exc:
        raise EvaluationError(str(exc)) from None


def kept_form(item: Mapping[str, Any]) -> dict[str, Any]:
    """What a node keeps of a verified item: the signed members, `sig_algo`,
    `public_key` and the signature without padding. Unsigned extras are dropped
    (anyone relaying could have changed them), and a re-padded signature is the
    same item, so merging and `evaluations_hash` do not depend on either."""
    kept = {k: v for k, v in item.items() if k in _ALLOWED}
    if isinstance(kept.get("signature"), str):
        kept["signature"] = kept["signature"].rstrip("=")
    return kept


def build_evaluation(
    identity: Identity, *, value: float, type: str, target: str, now: datetime
) -> dict[str, Any]:
    """A signed evaluation item by `identity`, timestamped `now` (timezone-aware)."""
    if not _value_in_range(value):
        raise EvaluationError("value must be a finite number in [-1, 1]")
    if not is_valid_type(type):
        raise EvaluationError(f"invalid evaluation type {type!r:.80}")
    if not _is_valid_target(target):
        raise EvaluationError("target must be a non-empty DID without ', '")
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise EvaluationError("now must be a timezone-aware datetime")
    item: dict[str, Any] = {
        "value": value,
        "type": type,
        "target": target,
        "timestamp": format_time(now),
        "agent_did": identity.did,
        "public_key": identity.public_key_b58,
        "sig_algo": SIG_ALGO,
    }
    item["signature"] = b64url_encode(identity.sign(signed_string(item)))
    return item


def verify_evaluation(
    item: Any,
    evaluated_did: Any,
    *,
    registry: KeyRegistry | None = None,
    resolve: Resolve | None = None,
    now: datetime | None = None,
    max_skew: timedelta = DEFAULT_MAX_SKEW,
) -> EvaluationCheck:
    """Check that `item` is an authentic evaluation that counts for `evaluated_did`.

    Order of checks, first failure wins:

    1. shape: an object with the item members (others ignored), strings where strings
       are due, `value` a number in [-1, 1], `type`/`target` valid (see module
       doc), `timestamp` RFC 3339, `public_key` (if present) base58btc of 32
       bytes -- `malformed`
    2. if `now` is given: timestamp ≤ now + max_skew -- `future_timestamp`
    3. key binding: the key is the item's `public_key`, else the registry's
       pinned key; none -- `unknown_key`; item key and pinned key differ, or a
       self-certifying `agent_did` does not hash to the key -- `key_mismatch`;
       item timestamped after the agent's revocation -- `revoked`
       (`identity.bind_key`, the same rule as for containers)
    4. `sig_algo` is `ed25519` -- `unsupported_sig_algo`
    5. Ed25519 signature over `signed_string(item)` -- `bad_signature`
    6. the replay rule (module doc): `replay`, or pending `target_unknown`
       when `target != evaluated_did` and `resolve` is absent or returns None.
    """
    try:
        return _verify(item, evaluated_did, registry, resolve, now, max_skew)
    except Exception as exc:  # defence in depth: hostile input must not crash the node
        return _fail("malformed", f"unexpected {type(exc).__name__} while verifying")


def _verify(
    item: Any,
    evaluated_did: Any,
    registry: KeyRegistry | None,
    resolve: Resolve | None,
    now: datetime | None,
    max_skew: timedelta,
) -> EvaluationCheck:
    if not isinstance(evaluated_did, str) or not evaluated_did:
        return _fail("malformed", "evaluated container DID is not a non-empty string")
    if not isinstance(item, dict):
        return _fail("malformed", "evaluation item is not an object")
    missing = [name for name in _REQUIRED if name not in item]
    if missing:
        return _fail("malformed", f"missing {', '.join(missing)}")
    for name in ("type", "target", "timestamp", "agent_did", "sig_algo", "signature"):
        if not isinstance(item[name], str):
            return _fail("malformed", f"{name} is not a string")
    if not _value_in_range(item["value"]):
        return _fail("malformed", "value is not a finite number in [-1, 1]")
    if not is_valid_type(item["type"]):
        return _fail("malformed", "type is empty, longer than 64 characters or contains ', '")
    if not _is_valid_target(item["target"]):
        return _fail("malformed", "target is empty or contains ', '")
    agent_did: str = item["agent_did"]
    if not agent_did:
        return _fail("malformed", "agent_did is empty")
    try:
        stamped = parse_time(item["timestamp"])
    except EncodingError:
        return _fail("malformed", "timestamp is not RFC 3339 UTC")
    item_key: bytes | None = None
    if "public_key" in item:
        try:
            item_key = public_key_from_b58(item["public_key"])
        except EncodingError:
            return _fail("malformed", "public_key is not base58btc of 32 bytes")
    try:
        message = signed_string(item)
    except EvaluationError as exc:
        return _fail("malformed", str(exc))

    if now is not None and stamped > now + max_skew:
        return _fail("future_timestamp", "timestamp is ahead of the local clock")

    binding = bind_key(agent_did, item_key, registry, stamped)
    if binding.reason is not None:
        return _fail(binding.reason, f"agent_did: {binding.detail}")
    key = binding.key

    if item["sig_algo"] != SIG_ALGO:
        return _fail("unsupported_sig_algo", f"sig_algo {item['sig_algo']!r:.40} not supported")
    try:
        signature = b64url_decode(item["signature"])
    except EncodingError:
        return _fail("bad_signature", "signature is not base64url")
    if not ed25519_verify(key, message, signature):
        return _fail("bad_signature", "Ed25519 signature does not verify")

    target: str = item["target"]
    if target == evaluated_did:
        return EvaluationCheck(True)
    held = resolve(target) if resolve is not None else None
    if held is None:
        return _fail("target_unknown", "justification container not held yet", pending=True)
    if not isinstance(held, tuple) or len(held) != 2:
        return _fail("replay", "justification container could not be read")
    sender_did, related = held
    if sender_did != agent_did:
        return _fail("replay", "justification container was not sent by the evaluating agent")
    if not any(dest == evaluated_did for _, dest in links_from_related(target, related)):
        return _fail("replay", "justification container does not point at the evaluated container")
    return EvaluationCheck(True)


def _rank(item: Mapping[str, Any]) -> tuple[datetime, str, bytes]:
    return (parse_time(item["timestamp"]), item["signature"], canonical_json(item))


def merge_evaluations(items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One active item per `agent_did`, sorted by `agent_did`.

    Later parsed `timestamp` wins; on an equal instant the greater `signature`
    string; then the greater canonical JSON. Items should have passed
    `verify_evaluation` for the same container; an item without string
    `agent_did`/`timestamp`/`signature` raises EvaluationError."""
    best: dict[str, tuple[tuple[datetime, str, bytes], Mapping[str, Any]]] = {}
    for item in items:
        try:
            agent = item["agent_did"]
            if not isinstance(agent, str) or not isinstance(item["signature"], str):
                raise TypeError
            rank = _rank(item)
        except (KeyError, TypeError, ValueError):
            raise EvaluationError(
                "merge needs verified items (agent_did, timestamp, signature)"
            ) from None
        current = best.get(agent)
        if current is None or rank > current[0]:
            best[agent] = (rank, item)
    return [dict(best[agent][1]) for agent in sorted(best)]


def evaluations_hash(items: Iterable[Mapping[str, Any]]) -> str:
    """`sha256:` hex of canonical_json of the merged, sorted items."""
    return sha256_tag(canonical_json(merge_evaluations(items)))


def evaluations_block(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """`{"evaluations_hash", "items"}` with items merged and sorted by agent_did."""
    merged = merge_evaluations(items)
    return {"evaluations_hash": sha256_tag(canonical_json(merged)), "items": merged}
