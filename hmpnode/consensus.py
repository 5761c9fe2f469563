"""CogConsensus (HMP §6.2.4-6.2.7): the procedure over one proposal and its votes.

Pure functions over (proposal, votes, now): no clock, no I/O. The node reads
the containers and calls these; a peer recounts a received `consensus_result`
with the same functions (docs/protocol.md, "Consensus").

The procedure (hmpnode's choices where the spec leaves them open):

* A **proposal** is any held container with a `head.ttl`; its `ttl` is the
  voting **deadline**. A container without `ttl` never closes (state `open`).
  Its rules come from the optional `consensus` member of its payload
  (`quorum`, `threshold`, `voters`, `weighting`), else the defaults below, so
  every node recounts with the rules the proposer signed.
* A **vote** is a `vote` container whose `payload.target_did` is the proposal
  and whose `related.in_reply_to` names it (that link is how nodes find it).
  `vote_value` is a number in [-1, 1] or a boolean (true = 1, false = -1).
* **Eligibility**: any agent, or only the DIDs listed in `voters`. A vote
  timestamped before the proposal or after the deadline does not count
  (`early`, `late`). One vote per agent counts: the latest by `head.timestamp`
  (spec §6.2.3 "the most recent is considered current"; ties: the greater
  vote DID), the others are `superseded`.
* **Weights**: `equal` (1 each) or `trust` (the closing node's trust figure of
  the voter, in (0, 1), hmpnode.trust). The weights used are written in the
  result, so a recount checks the arithmetic; a trust weight itself is the
  closer's local view and cannot be recomputed elsewhere.
* **Score** = sum(value * weight) / sum(weight) (spec §6.2.4 example formula,
  without time decay: all counted votes are from the voting window).
* **Quorum**: at least `quorum` counted voters (neutral 0 votes count toward
  it, §6.2.7).
* **States**: before the deadline `open`, with `leading`: `accepted` or
  `rejected` if it closed so now, else null and `reason` (`no_quorum`,
  `no_majority`) saying why neither leads. At or after the deadline: `accepted`
  if quorum and score >= threshold; `rejected` if quorum and score <= -threshold;
  else `expired` (reason `no_quorum` or `no_majority`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hmpnode.container.encoding import format_time, parse_time

__all__ = [
    "OPEN", "ACCEPTED", "REJECTED", "EXPIRED", "WEIGHTINGS", "DEFAULT_RULES",
    "ConsensusError", "Policy", "Rules", "Proposal", "Vote", "Outcome", "Recount",
    "rules_from_payload", "rules_payload", "proposal_from", "vote_from", "vote_value",
    "select_votes", "decide", "result_payload", "recount",
]

OPEN, ACCEPTED, REJECTED, EXPIRED = "open", "accepted", "rejected", "expired"
WEIGHTINGS = ("equal", "trust")
#: score and fractions are written rounded to this many digits; a recount allows the rounding
DIGITS = 6
_TOLERANCE = 2 * 10 ** -DIGITS
#: counted votes a consensus_result can reference: the container schema bounds every
#: `related` list at 4096 items
MAX_VOTERS = 4096
#: excluded votes listed in a consensus_result (all are counted in excluded_total): with
#: 4096 counted votes the result stays under the default 1 MiB container limit
EXCLUDED_LISTED = 256


class ConsensusError(ValueError):
    """A proposal or vote that the procedure cannot use; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Rules:
    quorum: int = 2
    threshold: float = 0.5
    voters: tuple[str, ...] | None = None
    weighting: str = "equal"


DEFAULT_RULES = Rules()


@dataclass(frozen=True, slots=True)
class Proposal:
    did: str
    proposer: str
    created: datetime
    deadline: datetime | None
    rules: Rules = DEFAULT_RULES


@dataclass(frozen=True, slots=True)
class Vote:
    did: str
    agent: str
    target: str
    value: float
    timestamp: datetime


@dataclass(slots=True)
class Outcome:
    state: str
    reason: str | None
    score: float | None
    weight: float
    counted: list[tuple[Vote, float]]  # (vote, weight), by agent
    excluded: list[dict[str, Any]]
    leading: str | None = None  # while open: accepted or rejected were it to close now, else None
    quorum_reached: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state, "reason": self.reason, "leading": self.leading,
            "score": _round(self.score), "weight": _round(self.weight), "quorum_reached": self.quorum_reached,
            "counted": [_counted_json(v, w) for v, w in self.counted], "excluded": self.excluded,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, DIGITS)


def _counted_json(vote: Vote, weight: float) -> dict[str, Any]:
    return {"agent_did": vote.agent, "vote": vote.did, "value": vote.value, "weight": _round(weight)}


@dataclass(frozen=True, slots=True)
class Policy:
    """The node's consensus settings ([consensus] in the config)."""

    default_ttl_seconds: int = 3600
    quorum: int = 2
    threshold_percent: int = 50
    weighting: str = "equal"
    close_grace_seconds: int = 10
    check_seconds: int = 5
    trust_damping: int = 3
    max_votes: int = MAX_VOTERS

    def rules(self) -> Rules:
        return Rules(quorum=self.quorum, threshold=self.threshold_percent / 100, weighting=self.weighting)


# -- reading proposals and votes ------------------------------------------------------


def rules_from_payload(payload: Any) -> Rules:
    """The rules a proposal's payload states (its `consensus` member), else the defaults."""
    spec = payload.get("consensus") if isinstance(payload, Mapping) else None
    if spec is None:
        return DEFAULT_RULES
    if not isinstance(spec, Mapping):
        raise ConsensusError("invalid_rules", "payload.consensus must be an object")
    quorum = spec.get("quorum", DEFAULT_RULES.quorum)
    if isinstance(quorum, bool) or not isinstance(quorum, int) or not 1 <= quorum <= MAX_VOTERS:
        raise ConsensusError("invalid_rules", f"consensus.quorum must be an integer 1..{MAX_VOTERS}")
    threshold = spec.get("threshold", DEFAULT_RULES.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold) \
            or not 0 < threshold <= 1:
        raise ConsensusError("invalid_rules", "consensus.threshold must be a number in (0, 1]")
    voters = spec.get("voters")
    if voters is not None:
        if not isinstance(voters, list) or not voters or len(voters) > MAX_VOTERS \
                or not all(isinstance(v, str) and v.startswith("did:") for v in voters):
            raise ConsensusError("invalid_rules", f"consensus.voters must list 1..{MAX_VOTERS} DIDs")
        voters = tuple(sorted(set(voters)))
    weighting = spec.get("weighting", DEFAULT_RULES.weighting)
    if weighting not in WEIGHTINGS:
        raise ConsensusError("invalid_rules", f"consensus.weighting must be one of {', '.join(WEIGHTINGS)}")
    return Rules(quorum=quorum, threshold=float(threshold), voters=voters, weighting=weighting)


def rules_payload(rules: Rules) -> dict[str, Any]:
    """The `consensus` member written into a new proposal (the inverse of rules_from_payload)."""
    out: dict[str, Any] = {"quorum": rules.quorum, "threshold": rules.threshold, "weighting": rules.weighting}
    if rules.voters is not None:
        out["voters"] = list(rules.voters)
    return out


def proposal_from(did: str, head: Mapping[str, Any], payload: Any) -> Proposal:
    """A verified container's head and (opened) payload as a proposal."""
    ttl = head.get("ttl")
    return Proposal(did=did, proposer=head["sender_did"], created=parse_time(head["timestamp"]),
                    deadline=parse_time(ttl) if isinstance(ttl, str) else None,
                    rules=rules_from_payload(payload))


def vote_value(raw: Any) -> float:
    if isinstance(raw, bool):
        return 1.0 if raw else -1.0
    if isinstance(raw, int | float) and math.isfinite(raw) and -1 <= raw <= 1:
        return float(raw)
    raise ConsensusError("invalid_vote", "vote_value must be a number in [-1, 1] or a boolean")


def vote_from(did: str, head: Mapping[str, Any], payload: Any) -> Vote:
    """A verified `vote` container as a Vote (ConsensusError if its payload is unusable)."""
    if head.get("class") != "vote" or not isinstance(payload, Mapping) or not isinstance(payload.get("target_did"), str):
        raise ConsensusError("not_a_vote", f"{did} is not a readable vote container")
    return Vote(did=did, agent=head["sender_did"], target=payload["target_did"],
                value=vote_value(payload.get("vote_value")), timestamp=parse_time(head["timestamp"]))


# -- the procedure ------------------------------------------------------------------------


def _excluded(vote: Vote, reason: str) -> dict[str, Any]:
    return {"agent_did": vote.agent, "target": vote.did, "value": vote.value, "reason": reason}


def select_votes(proposal: Proposal, votes: Iterable[Vote]) -> tuple[dict[str, Vote], list[dict[str, Any]]]:
    """The one counted vote per eligible agent, and every other vote with why it is left out.
    Input order never matters."""
    latest: dict[str, Vote] = {}
    excluded: list[dict[str, Any]] = []
    allowed = set(proposal.rules.voters) if proposal.rules.voters is not None else None
    for vote in sorted(votes, key=lambda v: v.did):
        if vote.target != proposal.did:
            excluded.append(_excluded(vote, "wrong_target"))
        elif allowed is not None and vote.agent not in allowed:
            excluded.append(_excluded(vote, "ineligible"))
        elif vote.timestamp < proposal.created:
            excluded.append(_excluded(vote, "early"))
        elif proposal.deadline is not None and vote.timestamp > proposal.deadline:
            excluded.append(_excluded(vote, "late"))
        else:
            current = latest.get(vote.agent)
            if current is not None and (current.timestamp, current.did) == (vote.timestamp, vote.did):
                continue  # the same vote twice
            if current is None or (vote.timestamp, vote.did) > (current.timestamp, current.did):
                latest[vote.agent] = vote
                if current is not None:
                    excluded.append(_excluded(current, "superseded"))
            else:
                excluded.append(_excluded(vote, "superseded"))
    excluded.sort(key=lambda e: (e["agent_did"], e["target"]))
    return dict(sorted(latest.items())), excluded


def decide(proposal: Proposal, votes: Iterable[Vote], now: datetime,
           weight_of: Mapping[str, float] | None = None) -> Outcome:
    """The state of `proposal` at `now`. `weight_of` (agent -> weight in [0, 1]) is used
    when the rules say `trust`; a voter missing from it weighs 0."""
    counted, excluded = select_votes(proposal, votes)
    trust = proposal.rules.weighting == "trust"
    pairs = [(v, _clamp01(weight_of.get(a, 0.0)) if trust and weight_of is not None else (0.0 if trust else 1.0))
             for a, v in counted.items()]
    return _judge(proposal, pairs, excluded, now)


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, float(x))) if math.isfinite(x) else 0.0


def _judge(proposal: Proposal, pairs: list[tuple[Vote, float]], excluded: list[dict[str, Any]],
           now: datetime) -> Outcome:
    weight = math.fsum(w for _, w in pairs)
    score = math.fsum(v.value * w for v, w in pairs) / weight if weight > 0 else None
    quorum = len(pairs) >= proposal.rules.quorum and weight > 0
    if quorum and score is not None and score >= proposal.rules.threshold - 1e-12:
        final, reason = ACCEPTED, None
    elif quorum and score is not None and score <= -proposal.rules.threshold + 1e-12:
        final, reason = REJECTED, None
    else:
        final, reason = EXPIRED, ("no_majority" if quorum else "no_quorum")
    out = Outcome(state=final, reason=reason, score=score, weight=weight, counted=pairs, excluded=excluded,
                  quorum_reached=quorum)
    if proposal.deadline is None or now < proposal.deadline:
        # open: `leading` is the side that would win now; none while it would expire (`reason` says why)
        out.state, out.leading = OPEN, None if final == EXPIRED else final
    return out


# -- the consensus_result container --------------------------------------------------------


def _bucket(value: float) -> str:
    """The §6.2.6 histogram bucket of a vote value, in tenths."""
    if value == 0:
        return "X=0.0"
    tenth = min(10, max(1, math.ceil(abs(value) * 10 - 1e-9)))
    lo, hi = (tenth - 1) / 10, tenth / 10
    return f"{lo:.1f}<X≤{hi:.1f}" if value > 0 else f"-{hi:.1f}≤X<-{lo:.1f}"


def _summary(pairs: Sequence[tuple[Vote, float]], weight: float) -> tuple[dict[str, float], dict[str, int]]:
    share = {"approved": 0.0, "rejected": 0.0, "neutral": 0.0}
    buckets: dict[str, int] = {}
    for vote, w in pairs:
        key = "approved" if vote.value > 0 else "rejected" if vote.value < 0 else "neutral"
        share[key] += w
        buckets[_bucket(vote.value)] = buckets.get(_bucket(vote.value), 0) + 1
    return ({k: round(v / weight, DIGITS) if weight > 0 else 0.0 for k, v in share.items()},
            dict(sorted(buckets.items())))


def result_payload(proposal: Proposal, outcome: Outcome) -> tuple[dict[str, Any], dict[str, Any]]:
    """(payload, related) of the consensus_result that closes `proposal`: the §6.2.6
    entry plus hmpnode's members (state, reason, score, rules, deadline, excluded_total,
    and under trust weighting `weights`, one per counted vote in depends_on order);
    `related.depends_on` lists every counted vote (sorted), `in_reply_to` the proposal."""
    if outcome.state == OPEN:
        raise ConsensusError("still_open", "a proposal is closed only at or after its deadline")
    percent, distribution = _summary(outcome.counted, outcome.weight)
    entry: dict[str, Any] = {
        "type": "original",
        "summary_percent": percent,
        "summary_distribution": distribution,
        "excluded": outcome.excluded[:EXCLUDED_LISTED],
        "excluded_total": len(outcome.excluded),
        "state": outcome.state,
        "score": _round(outcome.score),
        "rules": rules_payload(proposal.rules),
        "deadline": format_time(proposal.deadline) if proposal.deadline else None,
    }
    if outcome.reason:
        entry["reason"] = outcome.reason
    counted = sorted(outcome.counted, key=lambda pair: pair[0].did)
    if proposal.rules.weighting != "equal":
        entry["weights"] = [_round(w) for _, w in counted]  # in depends_on order
    related = {"in_reply_to": [proposal.did], "depends_on": [v.did for v, _ in counted]}
    return {proposal.did: entry}, related


@dataclass(slots=True)
class Recount:
    """`status`: match | mismatch | incomplete (a counted vote is not held here yet)."""

    status: str
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    #: votes held here that would count but the result left out (late delivery, or withheld)
    uncounted: list[str] = field(default_factory=list)
    state: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "problems": self.problems, "missing": self.missing,
                "uncounted": self.uncounted, "state": self.state}


def _dids(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return list(value)
    return None


def recount(proposal: Proposal, sender: str, timestamp: datetime, payload: Any, related: Any,
            held: Mapping[str, Vote | None], others: Iterable[Vote] = ()) -> Recount:
    """Check a received consensus_result against the votes it references.

    `held` maps every DID in `related.depends_on` that this node holds to its Vote
    (None: held but not a readable vote); `others` are further votes for the proposal
    held here. A result matches when its sender is the proposer, it was made at or
    after the deadline, its rules are the proposal's, the referenced votes are
    exactly the counted ones under those rules, the weights fit the rules and the
    stated state, score and shares follow from them."""
    problems: list[str] = []
    entry = payload.get(proposal.did) if isinstance(payload, Mapping) else None
    related = related if isinstance(related, Mapping) else {}
    deps = _dids(related.get("depends_on", []))
    if not isinstance(entry, Mapping) or deps is None:
        return Recount("mismatch", ["no_entry" if not isinstance(entry, Mapping) else "bad_depends_on"])
    state = entry.get("state")
    if sender != proposal.proposer:
        problems.append("not_proposer")
    if proposal.deadline is None or timestamp < proposal.deadline:
        problems.append("closed_early")
    if entry.get("rules") != rules_payload(proposal.rules):
        problems.append("rules_differ")
    missing = sorted(d for d in set(deps) if d not in held)
    if missing:
        return Recount("incomplete", problems, missing=missing, state=state if isinstance(state, str) else None)
    votes = [held[d] for d in sorted(set(deps))]
    if len(set(deps)) != len(deps):
        problems.append("duplicate_reference")
    if any(v is None for v in votes):
        problems.append("not_a_vote")
    counted, excluded = select_votes(proposal, [v for v in votes if v is not None])
    if excluded:
        problems.append("vote_not_countable")
    weights = entry.get("weights", [1] * len(deps) if proposal.rules.weighting == "equal" else None)
    if not isinstance(weights, list) or len(weights) != len(deps):
        problems.append("bad_weight")
        weights = [0.0] * len(deps)
    stated = dict(zip(deps, weights, strict=True))
    pairs: list[tuple[Vote, float]] = []
    for vote in counted.values():
        w = stated.get(vote.did)
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1 \
                or (proposal.rules.weighting == "equal" and w != 1):
            problems.append("bad_weight")
            w = 1.0 if proposal.rules.weighting == "equal" else 0.0
        pairs.append((vote, float(w)))
    mine = _judge(proposal, pairs, [], max(timestamp, proposal.deadline) if proposal.deadline else timestamp)
    if state != mine.state:
        problems.append("state_differs")
    score = entry.get("score")
    if (mine.score is None) != (score is None) or (mine.score is not None and (
            isinstance(score, bool) or not isinstance(score, int | float) or not abs(score - mine.score) <= _TOLERANCE)):
        problems.append("score_differs")
    percent, _ = _summary(pairs, mine.weight)
    given = entry.get("summary_percent")
    if not isinstance(given, Mapping) or any(
            isinstance(given.get(k, 0), bool) or not isinstance(given.get(k, 0), int | float)
            or not abs(given.get(k, 0) - v) <= _TOLERANCE for k, v in percent.items()):
        problems.append("summary_differs")
    counted_dids = {v.did for v in counted.values()}
    extra_counted, _ = select_votes(proposal, [*counted.values(), *others])
    uncounted = sorted(v.did for v in extra_counted.values() if v.did not in counted_dids)
    problems = sorted(set(problems))
    return Recount("mismatch" if problems else "match", problems, uncounted=uncounted, state=mine.state)
