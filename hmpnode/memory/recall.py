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
                 "excluded": {"superseded": n, "expired": n, "contested": n, "revoked": n[, "retracted": n]},
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
contested, revoked and retracted; `include_contested` keeps contested ones, marked
`"state": "contested"`, never retracted ones (the author's own `contradicts` is final).

Plan (two-step recall): `seal_plan` returns an opaque token: the canonical
plan JSON sealed (encrypted and authenticated) with PyNaCl's SecretBox
(XSalsa20-Poly1305) under a node-local key, base64url. It holds the query,
budgets, scope, the receipt's counts and, per selected item, its DID, store
seq, `payload_hash` and state, but whoever holds the token reads none of it:
only this node opens it. The nonce is a keyed BLAKE2b hash of the plan, so the
same plan seals to the same token (deterministic) and two different plans never
share a nonce. Resolving re-reads each item: it must still be held with the
same seq and `payload_hash`, in the plan's scope, and its lifecycle state must
still be the one planned; otherwise the plan is stale (the node answers 409)
and the agent plans again; a planned item the agent forgot since answers 410.

`explain` (the `explain` request flag) is the content-free summary of an
outcome for logs: counts, abstain reason and budgets; never a DID, a term or
text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import nacl.encoding
import nacl.exceptions
import nacl.hash
import nacl.secret
import orjson

from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode
from hmpnode.memory.budget import PackResult, pack
from hmpnode.memory.tokens import count_canonical_tokens

__all__ = [
    "Candidate", "RecallOutcome", "PlanError", "EXCLUDED_BY_DEFAULT", "CANDIDATES", "rank", "recall", "seal_plan",
    "open_plan", "PLAN_LABEL", "explain",
]

#: `retracted` (the author's own `contradicts`) is excluded even with include_contested
EXCLUDED_BY_DEFAULT = ("superseded", "expired", "contested", "revoked", "retracted")
#: full-text hits considered per recall (best BM25 first, whatever their state)
CANDIDATES = 100
#: the label of the node-local key that seals plans (`Identity.local_key(PLAN_LABEL)`)
PLAN_LABEL = b"hmpnode-recall-plan-v2"
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
                  # `retracted` only when there is one (it is rare; the receipt stays as small as before)
                  "excluded": {s: excluded.get(s, 0) for s in EXCLUDED_BY_DEFAULT
                               if s != "retracted" or excluded.get(s)}}
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
              outcome: RecallOutcome, scope: str | None = None) -> str:
    receipt = outcome.receipt or {}
    plan = {
        "v": 2, "query": query, "max_tokens": max_tokens, "max_bytes": max_bytes,
        "include_contested": include_contested, "scope": scope,
        "counts": {k: receipt.get(k) for k in ("considered", "eligible", "excluded")},
        "items": [{"did": c.did, "seq": c.seq, "payload_hash": c.payload_hash, "state": c.state}
                  for c in outcome.selected],
    }
    body = canonical_json(plan)
    nonce = nacl.hash.blake2b(body, digest_size=nacl.secret.SecretBox.NONCE_SIZE, key=key,
                              person=b"hmpnode-plan-nce", encoder=nacl.encoding.RawEncoder)
    return b64url_encode(bytes(nacl.secret.SecretBox(key).encrypt(body, nonce)))


def open_plan(key: bytes, token: Any) -> dict[str, Any]:
    if not isinstance(token, str) or not 0 < len(token) <= _MAX_PLAN_TEXT:
        raise PlanError("not a recall plan")
    try:
        sealed = b64url_decode(token)
    except EncodingError:
        raise PlanError("not a recall plan") from None
    try:
        body = nacl.secret.SecretBox(key).decrypt(sealed)
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise PlanError("not a plan issued by this node") from None
    plan = orjson.loads(body)
    if not isinstance(plan, dict) or plan.get("v") != 2:
        raise PlanError("unsupported plan version")
    return plan


#: receipt fields that `explain` shows: numbers and codes, never ids or text
_EXPLAIN_FIELDS = ("max_tokens", "max_bytes", "used_tokens", "used_bytes", "remaining_tokens", "remaining_bytes",
                   "selected_count", "considered", "eligible", "excluded", "abstain", "tokenizer_id")


def explain(outcome: RecallOutcome, *, max_tokens: int, max_bytes: int, scoped: bool) -> dict[str, Any]:
    """Counts, reasons and budgets of a recall, without a DID, a term or any text (for logs).
    `skipped_for_budget`: eligible items not selected (they did not fit the budgets)."""
    receipt = outcome.receipt
    if receipt is None:  # not even an empty answer fits
        return {"max_tokens": max_tokens, "max_bytes": max_bytes, "selected_count": 0,
                "abstain": "budget_too_small", "scoped": scoped}
    out: dict[str, Any] = {k: receipt[k] for k in _EXPLAIN_FIELDS if k in receipt}
    out["skipped_for_budget"] = max(0, (receipt.get("eligible") or 0) - len(outcome.selected))
    out["scoped"] = scoped
    return out
