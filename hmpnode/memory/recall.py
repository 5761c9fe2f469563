"""Recall under a token budget and a byte budget, fail-closed (sans-IO).

The node gathers candidates (full-text hits with their lifecycle state,
evaluations, confidence, whether they replaced an earlier version, and their
opened payload) and the query's terms with their weights; this module decides
what is relevant, ranks it, drops what lifecycle excludes, packs whole items
into both budgets (`hmpnode.memory.budget.pack`) and seals a plan.

Candidates (issue 12). The node scans the full-text hits of the index query
(see below: only hits that can be relevant) best BM25 first (ties newest
first), reading their lifecycle state in growing windows until it holds
`CANDIDATES` hits that lifecycle does not exclude, or has looked at
`MAX_SCAN` hits; excluded hits are counted, never read: a fact updated 200
times cannot crowd its current version out of the candidates.

Relevance: when does the memory answer the query? A query's terms are its
content words (`hmpnode.memory.index.recall_terms`: stop words and question
filler dropped; "decide" also matches "decision"). Each term weighs its
inverse document frequency, ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))`` (N
indexed memories, df those matching the term; a word never seen weighs the
most), counted in the recall's scope when it has one, else in the whole store:
what other scopes hold never changes a scoped answer (`hmpnode.store.search.ranked`
ranks a scope's hits by BM25 over the scope's own statistics as well). A
candidate is *relevant* when

1. it matches every *identifying* term: one with a digit ("v7", "5432"), a
   part of a compound ("billing-v7", "retry_limit"), capitalised past the
   query's first word (a name), or, whatever its case, a word that no memory
   in scope holds and that names something (`unknown_terms`: Latin letters,
   neither a common English word nor one typo from one, see
   `hmpnode.memory.index.unknown_name`, nor one typo from a word the memories
   in scope hold): a memory about "billing-v3" or
   "payments-v7" does not answer a question about "billing-v7", nor one about
   the felbur cluster's backup window a question about the zarnik cluster's
   (a memory that has never seen "zarnik" abstains). An unseen English word
   ("tonight"), a typo ("bakup", "felbru"), an inflection ("clusters": the
   index stems) or a word in another script only weighs, as any term; and
2. its coverage, the share of the query's weight it matches, is at least
   `MIN_COVERAGE` (0.5, calibrated on scripts/bench_recall_quality at 2 000
   memories: 0.5-0.8 keep every planted answer and abstain on every unknown
   entity, 0.4 answers 2 % of the unknowns, 0.9 loses 17 % of the answers;
   0.5 tolerates most of a question worded unlike the memory).

The index query already requires what both rules require: every identifying
term, and one of the `required_clauses` (the minimal sets of the other terms
that reach the floor), so common words cannot make recall rank thousands of
hits that could never be relevant. Only relevant candidates are opened,
ranked and packed. When none is, recall abstains with ``no_relevant_match``
instead of returning the closest filler; a query with no content words at all
abstains with ``no_query_terms``.

Ranking, one deterministic formula over the relevant candidates (higher first;
ties: newer first, then store order)::

    score = 0.60 * coverage                 share of the query's idf weight matched
          + 0.20 * proximity                per adjacent pair of query terms: 1 if the
                                            text has them as a phrase (as written), 0.5
                                            if within 3 words in order; mean over pairs
          + 0.05 * bm25 / best bm25         BM25 relative to the best candidate (FTS5's;
                                            in a scope, over the scope's statistics)
          + 0.05 * head                     1 when it replaced an earlier version of its own
          + 0.04 * (1 + tanh(evaluations)) / 2      sum of active evaluations
          + 0.03 * confidence               its head.confidence, 0.5 when absent
          + 0.03 * 1 / (1 + age_days / 30)  recency at `now`
          - 0.10 if contested (only with include_contested)

rounded to 9 decimals before sorting. Default exclusions: superseded,
expired, contested and revoked; `include_contested` keeps contested ones,
marked ``"s": "contested"``.

Envelope (the canonical JSON the node returns; `pack` guarantees that its
canonical bytes and `hmpnode-approx-v1` tokens fit both budgets)::

    {"items": [{"id": <8 letters>, "at": <YYYY-MM-DD>, "p": <payload>,
                "by": <6 letters, only when the sender is not this agent>,
                "s": <state, only when not active>, "c": <class, only when not note>}, ...],
     "used": [tokens, bytes],
     "n": [eligible, relevant],
     "x": [superseded, expired, contested, revoked],
     "abstain": null | "no_query_terms" (only stop words and filler)
                | "no_match" (no stored memory has any of the query's words)
                | "all_excluded" (every hit excluded by lifecycle)
                | "no_relevant_match" (hits, none relevant: see "Relevance")
                | "budget_too_small" (relevant items, none fits),
     ... and with "why": true only:
     "tokenizer": "hmpnode-approx-v1", "max": [tokens, bytes],
     "why": [{"id", "did", "sender", "timestamp", "class", "state", "matched",
              "score": {"total", "coverage", "proximity", "bm25", "head",
                        "evaluations", "confidence", "recency"}}, ...]}

`id` and `by` are short labels (`short_id`: letters of the SHA-256 of the
DID, cheap in tokens); the full DIDs and the ranking signals are in the
receipt with ``"why": true`` (counted in the budget like everything sent, and
sent once). An empty answer costs about 45-60 tokens; an item 29 tokens
beyond its payload (38 from another sender). `used` is exact for the envelope
it is part of (a fixed point, see hmpnode.memory.budget); the remaining budget
is max - used. `n`: the hits lifecycle did not exclude, and the relevant ones
(relevant minus items were skipped for the budget); `x`: the hits excluded,
per state (hits looked at = eligible + excluded). A candidate whose payload
alone is larger than `max_bytes` (`OVERSIZE`: the node stops decompressing it
at the budget) is counted and never packed.

When even an empty answer does not fit the budget, the node answers with
`budget_abstain(...)`: ``{"items": [], "abstain": "budget_too_small",
"need": [tokens, bytes]}``, a fixed form that holds nothing of the memory and
says the smallest budget that would give an answer.

Default exclusions: superseded, expired, contested, revoked and retracted;
`include_contested` keeps contested ones, marked ``"s": "contested"``, never
retracted ones (the author's own `contradicts` is final). `x` lists the first
four counts always and a fifth, `retracted`, only when there is one.

Plan (two-step recall): `seal_plan` returns an opaque token: the canonical
plan JSON sealed (encrypted and authenticated) with PyNaCl's SecretBox
(XSalsa20-Poly1305) under a node-local key, base64url. It holds the query,
budgets, scope and, per selected item, its DID, store seq,
`payload_hash` and state, but whoever holds the token reads none of it: only
this node opens it. The nonce is a keyed BLAKE2b hash of the plan, so the same
plan seals to the same token (deterministic) and two different plans never
share a nonce. Resolving re-reads each item: it must still be held with the
same seq and `payload_hash`, in the plan's scope, and its lifecycle state must
still be the one planned; otherwise the plan is stale (the node answers 409)
and the agent plans again; a planned item the agent forgot since answers 410.
The planned items are packed in the planned order (no re-ranking: the clock
moved); the counts (`n`, `x`) are those of the query now (`tally`): a memory
forgotten since the plan is not counted.

`explain` (the `explain` request flag) is the content-free summary of an
outcome for logs: counts, abstain reason and budgets; never a DID, a term or
text.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import nacl.encoding
import nacl.exceptions
import nacl.hash
import nacl.secret
import orjson

from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode
from hmpnode.memory.budget import PackResult, pack
from hmpnode.memory.index import QueryTerm, fts_any, payload_text, stem, text_words, typos_of, unknown_name
from hmpnode.memory.tokens import TOKENIZER_ID

__all__ = [
    "Candidate", "RecallLimits", "RecallOutcome", "PlanError", "EXCLUDED_BY_DEFAULT", "CANDIDATES", "MAX_SCAN", "MIN_COVERAGE",
    "idf", "relevant", "relevant_terms", "unknown_terms", "tally", "excluded_states", "necessary_terms", "required_clauses", "index_query", "rank", "recall", "seal_plan", "open_plan", "PLAN_LABEL", "short_id", "budget_abstain", "explain",
]

#: `retracted` (the author's own `contradicts`) is excluded even with include_contested
EXCLUDED_BY_DEFAULT = ("superseded", "expired", "contested", "revoked", "retracted")
#: hits lifecycle does not exclude that recall ranks (the node scans until it has these)
CANDIDATES = 100
#: full-text hits looked at per recall at most, whatever their state
MAX_SCAN = 5000
#: the share of the query's weight a relevant memory matches (see "Relevance")
MIN_COVERAGE = 0.5
#: the label of the node-local key that seals plans (`Identity.local_key(PLAN_LABEL)`)
PLAN_LABEL = b"hmpnode-recall-plan-v2"
_MAX_PLAN_TEXT = 256 * 1024
_DAY_US = 86_400_000_000
_PROXIMITY = 3
WEIGHTS = {"coverage": 0.60, "proximity": 0.20, "bm25": 0.05, "head": 0.05, "evaluations": 0.04,
           "confidence": 0.03, "recency": 0.03}
CONTESTED_PENALTY = 0.10


@dataclass(frozen=True)
class RecallLimits:
    """The configurable bounds of recall ([recall] in the node's settings)."""
    candidates: int = CANDIDATES
    max_scan: int = MAX_SCAN
    min_coverage: float = MIN_COVERAGE


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
    matched: tuple[str, ...]  # the query terms (QueryTerm.word) it matches
    evaluations: float
    confidence: float | None
    payload_hash: str
    payload: Any = field(repr=False)
    head: bool = False  # it replaced an earlier version of its own


@functools.lru_cache(maxsize=65_536)
def short_id(did: str, letters: int = 8) -> str:
    """A short label for a DID in an answer: lowercase letters of its SHA-256 (about two
    tokens for eight letters, where a DID costs 20-25)."""
    digest = hashlib.sha256(did.encode()).digest()
    return "".join(chr(97 + b % 26) for b in digest[:letters])


def idf(df: int, n: int) -> float:
    """BM25's inverse document frequency of a term in `df` of `n` memories."""
    return math.log(1 + (max(n, df) - df + 0.5) / (df + 0.5))


#: the OVERSIZE payload: larger than the byte budget on its own
OVERSIZE: Any = type("Oversize", (), {"__repr__": lambda self: "OVERSIZE"})()


@dataclass(frozen=True)
class Scored:
    c: Candidate
    total: float
    signals: dict[str, float]


def _coverage(matched: tuple[str, ...] | list[str], weights: dict[str, float]) -> float:
    total = sum(weights.values())
    return sum(weights[w] for w in matched if w in weights) / total if total > 0 else 0.0


def unknown_terms(terms: list[QueryTerm], dfs: list[int], holds_any: Callable[[list[str]], bool]) -> list[QueryTerm]:
    """`terms` with those that name something the memory never heard of made identifying
    (rule 1 of "Relevance"): held by no memory searched (`dfs`: the memories matching each),
    an `unknown_name`, and not one typo from a word the memories searched hold
    (`holds_any(words)`: "felbru" when "felbur" is held, "failovr" when "failover" is)."""
    return [dataclasses.replace(t, identifying=True)
            if not (t.identifying or df) and unknown_name(t.word) and not holds_any(sorted(typos_of(t.word))) else t
            for t, df in zip(terms, dfs)]


def relevant_terms(matched: tuple[str, ...] | list[str], terms: list[QueryTerm], weights: dict[str, float],
                   min_coverage: float = MIN_COVERAGE) -> bool:
    """Rules 1 and 2 of "Relevance" (module docstring) for a memory matching `matched`."""
    if any(t.identifying and t.word not in matched for t in terms):
        return False
    return _coverage(matched, weights) >= min_coverage


def relevant(c: Candidate, terms: list[QueryTerm], weights: dict[str, float],
             min_coverage: float = MIN_COVERAGE) -> bool:
    return relevant_terms(c.matched, terms, weights, min_coverage)


def necessary_terms(terms: list[QueryTerm], weights: dict[str, float],
                    min_coverage: float = MIN_COVERAGE) -> list[QueryTerm]:
    """The heaviest terms such that the others weigh less than `min_coverage` of the
    query: a memory matching none of them cannot be relevant (rule 2), so the index
    query requires one of them (with the identifying ones, rule 1)."""
    total = sum(weights.get(t.word, 0.0) for t in terms)
    rest = total
    out = []
    for t in sorted(terms, key=lambda t: -weights.get(t.word, 0.0)):  # stable: query order on ties
        if min_coverage <= 0 or rest < min_coverage * total:
            break
        out.append(t)
        rest -= weights.get(t.word, 0.0)
    return out


#: above this many non-identifying terms the index query uses `necessary_terms` only
_MAX_CLAUSE_TERMS = 8


def required_clauses(terms: list[QueryTerm], weights: dict[str, float],
                     min_coverage: float = MIN_COVERAGE) -> list[list[QueryTerm]] | None:
    """Sets of terms of which a relevant memory matches at least one whole set (beside
    the identifying terms, which it matches all of): the minimal sets of non-identifying
    terms whose weight, with the identifying ones', reaches `min_coverage` of the query.
    None: no condition (the identifying terms are enough); []: nothing can be relevant.
    With many terms, one set per `necessary_terms` member (a weaker condition, still
    necessary)."""
    total = sum(weights.get(t.word, 0.0) for t in terms)
    need = min_coverage * total - sum(weights.get(t.word, 0.0) for t in terms if t.identifying)
    others = [t for t in terms if not t.identifying]
    if need <= 0 or not others:
        return None
    if len(others) > _MAX_CLAUSE_TERMS:
        return [[t] for t in necessary_terms(terms, weights, min_coverage)]
    out: list[list[QueryTerm]] = []
    for mask in range(1, 1 << len(others)):  # subsets in increasing order: minimal ones first
        chosen = [t for i, t in enumerate(others) if mask >> i & 1]
        if sum(weights.get(t.word, 0.0) for t in chosen) < need - 1e-9 * total:  # rounding: keep, never lose
            continue
        if any(all(t in chosen for t in smaller) for smaller in out):
            continue  # a subset of it already qualifies
        out.append(chosen)
    return out


def index_query(terms: list[QueryTerm], weights: dict[str, float],
                min_coverage: float = MIN_COVERAGE) -> str | None:
    """The FTS5 query of recall's candidates: every identifying term (rule 1) and one of
    the `required_clauses` (rule 2), or any term when they say nothing; hits that could
    never be relevant are left out by the index. None: nothing can be relevant."""
    expr = {t.word: "(" + fts_any(t.forms) + ")" for t in terms}
    clauses = required_clauses(terms, weights, min_coverage)
    if clauses == []:
        return None
    rest = (" OR ".join("(" + " AND ".join(expr[t.word] for t in c) + ")" for c in clauses) if clauses
            else "(" + " OR ".join(fts_any(t.forms) for t in terms) + ")")
    return " AND ".join([expr[t.word] for t in terms if t.identifying] + ["(" + rest + ")"])


def _proximity(c: Candidate, terms: list[QueryTerm]) -> float:
    """Per adjacent pair of query terms: 1 when the text has them as written, next to
    each other, in order (a phrase); 0.5 when it has them (stemmed, any family form)
    within `_PROXIMITY` words, in order; the mean over the pairs."""
    if len(terms) < 2 or c.payload is OVERSIZE:
        return 0.0
    words = text_words(payload_text(c.payload))
    exact: dict[str, set[int]] = {}
    near: dict[str, set[int]] = {}
    for i, w in enumerate(words):
        exact.setdefault(w, set()).add(i)
        near.setdefault(stem(w), set()).add(i)
    found = 0.0
    for a, b in zip(terms, terms[1:]):
        if any(p + 1 in exact.get(b.word, ()) for p in exact.get(a.word, ())):
            found += 1
            continue
        later = {p for f in b.forms for p in near.get(stem(f), ())}
        if any(p + d in later for f in a.forms for p in near.get(stem(f), ()) for d in range(1, _PROXIMITY + 1)):
            found += 0.5
    return found / (len(terms) - 1)


def rank(candidates: list[Candidate], terms: list[QueryTerm], weights: dict[str, float], now_us: int) -> list[Scored]:
    """The ranking formula of the module docstring, best first, deterministic."""
    best = min((c.bm25 for c in candidates), default=0.0)
    out = []
    for c in candidates:
        age_days = max(0, now_us - c.ts_us) / _DAY_US
        signals = {
            "coverage": _coverage(c.matched, weights),
            "proximity": _proximity(c, terms),
            "bm25": c.bm25 / best if best < 0 else 0.0,
            "head": 1.0 if c.head else 0.0,
            "evaluations": (1 + math.tanh(c.evaluations)) / 2,
            "confidence": 0.5 if c.confidence is None else min(1.0, max(0.0, c.confidence)),
            "recency": 1 / (1 + age_days / 30),
        }
        total = sum(WEIGHTS[k] * v for k, v in signals.items())
        if c.state == "contested":
            total -= CONTESTED_PENALTY
        out.append(Scored(c, round(total, 9), {k: round(v, 4) for k, v in signals.items()}))
    out.sort(key=lambda s: (-s.total, -s.c.ts_us, s.c.seq))
    return out


@dataclass(frozen=True)
class RecallOutcome:
    envelope: Any
    envelope_json: bytes
    selected: list[Candidate]
    receipt: dict[str, Any]  # the envelope without its items
    counts: dict[str, Any]  # considered, eligible, relevant, excluded
    packed: PackResult | None  # None: the budget is below an empty answer (`budget_abstain`)


def excluded_states(include_contested: bool) -> list[str]:
    """The lifecycle states a recall leaves out."""
    return [s for s in EXCLUDED_BY_DEFAULT if not (include_contested and s == "contested")]


def tally(candidates: list[Candidate], *, terms: list[QueryTerm], weights: dict[str, float],
          include_contested: bool = False, excluded: dict[str, int] | None = None, irrelevant: int = 0,
          min_coverage: float = MIN_COVERAGE, **_: Any) -> dict[str, Any]:
    """The counts of a recall over `candidates` (and the hits the node left out: `excluded`
    per state, `irrelevant`): considered, eligible, relevant and excluded per state. Extra
    keyword arguments (the rest of what the node gathers) are ignored."""
    left_out = excluded_states(include_contested)
    eligible = [c for c in candidates if c.state not in left_out]
    dropped = Counter(c.state for c in candidates if c.state in left_out) + Counter(excluded or {})
    return {"considered": len(eligible) + irrelevant + sum(dropped.values()), "eligible": len(eligible) + irrelevant,
            "relevant": sum(1 for c in eligible if relevant(c, terms, weights, min_coverage)),
            "excluded": {s: dropped[s] for s in EXCLUDED_BY_DEFAULT if dropped.get(s)}}


def budget_abstain(need_tokens: int, need_bytes: int) -> dict[str, Any]:
    """The fixed answer when even an empty answer is over the budget (no memory in it)."""
    return {"items": [], "abstain": "budget_too_small", "need": [need_tokens, need_bytes]}


def recall(candidates: list[Candidate], *, terms: list[QueryTerm], weights: dict[str, float], now_us: int,
           self_did: str, max_tokens: int, max_bytes: int, include_contested: bool = False, why: bool = False,
           excluded: dict[str, int] | None = None, irrelevant: int = 0, known_terms: int | None = None,
           counts: dict[str, Any] | None = None, planned: bool = False,
           min_coverage: float = MIN_COVERAGE) -> RecallOutcome:
    """Exclude by lifecycle, keep the relevant, rank, pack. `excluded`: hits the node
    already left out per state (counted with those of `candidates`); `irrelevant`: hits
    not excluded that it already left out as not relevant (counted); `known_terms`: how
    many query terms the store holds at all (none: ``no_match``, else a query that hits
    nothing abstains ``no_relevant_match``: the index query requires identifying terms). With `planned`,
    `candidates` are a plan's items, packed in their order as they are, and `counts`
    (`tally` of the query at resolution) replaces the counts."""
    eligible = [c for c in candidates if c.state not in excluded_states(include_contested)]
    if planned:  # the plan's order; the signals as they are now (for "why")
        order = {id(c): i for i, c in enumerate(eligible)}
        scored = sorted(rank(eligible, terms, weights, now_us), key=lambda s: order[id(s.c)])
    else:
        scored = rank([c for c in eligible if relevant(c, terms, weights, min_coverage)], terms, weights, now_us)
    if counts is None:
        counts = tally(candidates, terms=terms, weights=weights, include_contested=include_contested,
                       excluded=excluded, irrelevant=irrelevant, min_coverage=min_coverage)
    if not terms:
        abstain = "no_query_terms"
    elif not counts["considered"]:
        abstain = "no_relevant_match" if known_terms else "no_match"
    elif not counts["eligible"]:
        abstain = "all_excluded"
    else:
        abstain = "no_relevant_match" if not counts["relevant"] else "budget_too_small"

    def item(s: Scored) -> dict[str, Any]:
        c = s.c
        out = {"id": short_id(c.did), "at": c.timestamp[:10], "p": c.payload}
        if c.sender != self_did:
            out["by"] = short_id(c.sender, 6)
        if c.state != "active":
            out["s"] = c.state
        if c.class_ != "note":
            out["c"] = c.class_
        return out

    def explain(s: Scored) -> dict[str, Any]:
        c = s.c
        return {"id": short_id(c.did), "did": c.did, "sender": c.sender, "timestamp": c.timestamp,
                "class": c.class_, "state": c.state, "matched": list(c.matched),
                "score": {"total": s.total, **s.signals}}

    def envelope(items: list[Scored], receipt: dict[str, Any]) -> dict[str, Any]:
        # item-additive: the frame depends on the receipt only (selected_count, not len(items))
        out: dict[str, Any] = {"items": [item(s) for s in items],
                               "used": [receipt["used_tokens"], receipt["used_bytes"]],
                               "n": [counts["eligible"], counts["relevant"]],
                               "x": _excluded_counts(counts["excluded"]),
                               "abstain": None if receipt["selected_count"] else abstain}
        if why:
            out["tokenizer"] = TOKENIZER_ID
            out["max"] = [receipt["max_tokens"], receipt["max_bytes"]]
            out["why"] = [explain(s) for s in items]
        return out

    packable = [s for s in scored if s.c.payload is not OVERSIZE]
    packed = pack(packable, max_tokens=max_tokens, max_bytes=max_bytes, envelope=envelope)
    if packed.envelope is None:
        empty = pack([], max_tokens=10**9, max_bytes=10**9, envelope=envelope)
        value = budget_abstain(empty.tokens_used, empty.bytes_used)
        return RecallOutcome(value, canonical_json(value), [], _receipt(value), counts, None)
    return RecallOutcome(packed.envelope, packed.envelope_json, [s.c for s in packed.selected],
                         _receipt(packed.envelope), counts, packed)


def _receipt(envelope: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in envelope.items() if k != "items"}


# -- plans --------------------------------------------------------------------------------


class PlanError(ValueError):
    """Not a plan this node issued (tampered, foreign or malformed)."""


def seal_plan(key: bytes, *, query: str, max_tokens: int, max_bytes: int, include_contested: bool,
              outcome: RecallOutcome, why: bool = False, scope: str | None = None) -> str:
    plan = {
        "v": 2, "query": query, "max_tokens": max_tokens, "max_bytes": max_bytes,
        "include_contested": include_contested, "why": why, "scope": scope,
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


def _excluded_counts(excluded: dict[str, int]) -> list[int]:
    """`x` of the envelope: superseded, expired, contested, revoked, and retracted only when
    there is one (rare: the answer stays as small as before)."""
    counts = [excluded.get(s, 0) for s in EXCLUDED_BY_DEFAULT[:4]]
    return counts + [excluded["retracted"]] if excluded.get("retracted") else counts


def explain(outcome: RecallOutcome, *, max_tokens: int, max_bytes: int, scoped: bool) -> dict[str, Any]:
    """Counts, reasons and budgets of a recall, without a DID, a term or any text (for logs).
    `skipped_for_budget`: relevant items not selected (they did not fit the budgets)."""
    counts, answer = outcome.counts, outcome.receipt
    used = answer.get("used") or [0, 0]  # the budget_too_small answer has none
    return {"max_tokens": max_tokens, "max_bytes": max_bytes, "used_tokens": used[0], "used_bytes": used[1],
            "remaining_tokens": max_tokens - used[0], "remaining_bytes": max_bytes - used[1],
            "selected_count": len(outcome.selected), "considered": counts["considered"],
            "eligible": counts["eligible"], "relevant": counts["relevant"],
            "excluded": {s: counts["excluded"].get(s, 0) for s in EXCLUDED_BY_DEFAULT
                         if s != "retracted" or counts["excluded"].get(s)},
            "skipped_for_budget": max(0, counts["relevant"] - len(outcome.selected)),
            "abstain": answer.get("abstain"), "tokenizer_id": TOKENIZER_ID, "scoped": scoped}
