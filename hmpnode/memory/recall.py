"""Recall under a token budget and a byte budget, fail-closed (sans-IO).

The node gathers candidates (full-text hits with their lifecycle state,
evaluations, confidence and opened payload); this module ranks them, drops
what lifecycle excludes, packs whole items into both budgets
(`hmpnode.memory.budget.pack`) and seals a content-free plan.

Envelope (the canonical JSON the node returns; `pack` guarantees that its
canonical bytes and `hmpnode-approx-v1` tokens fit both budgets)::

    {"query": <query text>,
     "items": [{"did", "class", "sender", "timestamp", "state", "payload"}, ...],
     "receipt": {"tokenizer_id", "tokenizer_version", "max_tokens", "max_bytes",
                 "used_tokens", "used_bytes", "remaining_tokens", "remaining_bytes", "selected_count",
                 "considered": <hits>, "eligible": <hits not excluded>,
                 "excluded": {"superseded": n, "expired": n, "contested": n, "revoked": n},
                 "abstain": null | "no_match" | "all_excluded" | "budget_too_small",
                 "why": [{"did", "matched": [terms], "bm25", "evaluations", "confidence",
                          "timestamp"}, ...]}}

`payload` is the opened payload (decrypted for this agent). Items are never
truncated; an item that does not fit is skipped and later, smaller ones are
still tried; `eligible - selected_count` were skipped for the budget. A
candidate whose payload alone is larger than `max_bytes` (`OVERSIZE`: the node
stops decompressing it at the budget) is counted as eligible and never packed.
`remaining_*` = `max_* - used_*`. Because the receipt states the size of the
envelope it is part of, the numbers are found as a fixed point (see
hmpnode.memory.budget); `remaining_*` shrinks in width as `used_*` grows, so
rarely (at a digit boundary) no self-consistent receipt exists for a
selection: that candidate is then skipped (`receipt_unstable`), never
returned with a wrong count.

Ranking, deterministic for a fixed store, query and clock: BM25 relevance
first (rounded to 9 decimals), then the sum of active evaluations (higher
first), then `confidence` (higher first; absent counts as 0), then recency
(newer first), then store order. Default exclusions: superseded, expired,
contested and revoked; `include_contested` keeps contested ones, marked
`"state": "contested"`.

Plan (two-step recall): `seal_plan` returns an opaque token (base64url of
the canonical plan JSON, "." and an HMAC-SHA256 tag under a node-local key)
holding the query, budgets, the receipt's counts and, per selected item, its
DID, store seq, `payload_hash` and state. Resolving re-reads each item: it
must still be held with the same seq and `payload_hash`, and its lifecycle
state must still be the one planned; otherwise the plan is stale (the node
answers 409) and the agent plans again. Content never enters the plan.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode
from hmpnode.memory.budget import PackResult, pack
from hmpnode.memory.tokens import count_canonical_tokens

__all__ = [
    "Candidate", "RecallOutcome", "PlanError", "EXCLUDED_BY_DEFAULT", "CANDIDATES", "rank", "recall", "seal_plan",
    "open_plan", "PLAN_LABEL",
]

EXCLUDED_BY_DEFAULT = ("superseded", "expired", "contested", "revoked")
#: full-text hits considered per recall (best BM25 first, whatever their state)
CANDIDATES = 100
#: the label of the node-local HMAC key of plans (`Identity.local_key(PLAN_LABEL)`)
PLAN_LABEL = b"hmpnode-recall-plan-v1"
_MAX_PLAN_TEXT = 256 * 1024


@dataclass(frozen=True)
class Candidate:
    did: str
    seq: int
    class_: str
    sender: str
    timestamp: str
    ts_us: int
    state: str
    bm25: float  # lower is better (SQLite's sign)
    matched: tuple[str, ...]
    evaluations: float
    confidence: float | None
    payload_hash: str
    payload: Any = field(repr=False)

    def item(self) -> dict[str, Any]:
        return {"did": self.did, "class": self.class_, "sender": self.sender, "timestamp": self.timestamp,
                "state": self.state, "payload": self.payload}

    def why(self) -> dict[str, Any]:
        return {"did": self.did, "matched": list(self.matched), "bm25": round(-self.bm25, 6),
                "evaluations": round(self.evaluations, 6), "confidence": self.confidence,
                "timestamp": self.timestamp}


#: the payload of a candidate that is larger than the byte budget on its own
OVERSIZE: Any = type("Oversize", (), {"__repr__": lambda self: "OVERSIZE"})()


def rank(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (round(c.bm25, 9), -c.evaluations, -(c.confidence or 0.0),
                                             -c.ts_us, c.seq))


@dataclass(frozen=True)
class RecallOutcome:
    envelope: Any  # None when even the empty envelope is over budget
    envelope_json: bytes | None
    selected: list[Candidate]
    receipt: dict[str, Any] | None
    packed: PackResult


def recall(candidates: list[Candidate], *, query: str, max_tokens: int, max_bytes: int,
           include_contested: bool = False, counts: dict[str, Any] | None = None) -> RecallOutcome:
    """Rank, exclude by lifecycle, pack. `counts` (from a plan) replaces the
    considered/eligible/excluded counts when re-packing a planned selection."""
    excluded_states = [s for s in EXCLUDED_BY_DEFAULT if not (include_contested and s == "contested")]
    ranked = rank(candidates)
    eligible = [c for c in ranked if c.state not in excluded_states]
    if counts is None:
        excluded = Counter(c.state for c in ranked if c.state in excluded_states)
        counts = {"considered": len(ranked), "eligible": len(eligible),
                  "excluded": {s: excluded.get(s, 0) for s in EXCLUDED_BY_DEFAULT}}
    abstain = ("no_match" if not counts["considered"] else "all_excluded" if not counts["eligible"]
               else "budget_too_small")

    def envelope(items: list[Candidate], receipt: dict[str, Any]) -> dict[str, Any]:
        return {
            "query": query,
            "items": [c.item() for c in items],
            "receipt": {**receipt, **counts, "abstain": None if items else abstain,
                        "remaining_tokens": receipt["max_tokens"] - receipt["used_tokens"],
                        "remaining_bytes": receipt["max_bytes"] - receipt["used_bytes"],
                        "why": [c.why() for c in items]},
        }

    def lower_bound(c: Candidate) -> tuple[int, int]:
        # an item and its `why` entry each sit whole in an array of the envelope
        item, why = canonical_json(c.item()), canonical_json(c.why())
        return count_canonical_tokens(item) + count_canonical_tokens(why), len(item) + len(why)

    packable = [c for c in eligible if c.payload is not OVERSIZE]
    packed = pack(packable, max_tokens=max_tokens, max_bytes=max_bytes, envelope=envelope, lower_bound=lower_bound)
    receipt = packed.envelope["receipt"] if packed.envelope is not None else None
    return RecallOutcome(packed.envelope, packed.envelope_json, list(packed.selected), receipt, packed)


# -- plans --------------------------------------------------------------------------------


class PlanError(ValueError):
    """Not a plan this node issued (tampered, foreign or malformed)."""


def seal_plan(key: bytes, *, query: str, max_tokens: int, max_bytes: int, include_contested: bool,
              outcome: RecallOutcome) -> str:
    receipt = outcome.receipt or {}
    plan = {
        "v": 1, "query": query, "max_tokens": max_tokens, "max_bytes": max_bytes,
        "include_contested": include_contested,
        "counts": {k: receipt.get(k) for k in ("considered", "eligible", "excluded")},
        "items": [{"did": c.did, "seq": c.seq, "payload_hash": c.payload_hash, "state": c.state}
                  for c in outcome.selected],
    }
    body = canonical_json(plan)
    return b64url_encode(body) + "." + b64url_encode(_plan_tag(key, body))


def _plan_tag(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, PLAN_LABEL + body, hashlib.sha256).digest()


def open_plan(key: bytes, token: Any) -> dict[str, Any]:
    if not isinstance(token, str) or not 0 < len(token) <= _MAX_PLAN_TEXT or token.count(".") != 1:
        raise PlanError("not a recall plan")
    body_text, tag_text = token.split(".")
    try:
        body, tag = b64url_decode(body_text), b64url_decode(tag_text)
    except EncodingError:
        raise PlanError("not a recall plan") from None
    if not hmac.compare_digest(tag, _plan_tag(key, body)):
        raise PlanError("not a plan issued by this node")
    plan = orjson.loads(body)
    if not isinstance(plan, dict) or plan.get("v") != 1:
        raise PlanError("unsupported plan version")
    return plan
