"""CogConsensus procedure (hmpnode.consensus) and the trust figure (hmpnode.trust):
pure functions, no sockets, no clock."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest

from hmpnode import consensus as C
from hmpnode.trust import trust_figure
from tests.conftest import NOW

P = "did:hmp:container:proposal"
START, DEADLINE = NOW, NOW + timedelta(hours=1)


def proposal(**rules) -> C.Proposal:
    return C.Proposal(P, "did:hmp:agent:proposer", START, DEADLINE, C.Rules(**rules))


def vote(agent: str, value: float, minutes: float = 1, did: str | None = None, target: str = P) -> C.Vote:
    return C.Vote(did or f"did:hmp:container:v-{agent}-{minutes}", f"did:hmp:agent:{agent}", target, value,
                  START + timedelta(minutes=minutes))


AFTER = DEADLINE + timedelta(seconds=1)


# -- states -------------------------------------------------------------------------------


def test_open_before_the_deadline_with_the_leading_outcome():
    out = C.decide(proposal(), [vote("a", 1), vote("b", 1)], DEADLINE - timedelta(seconds=1))
    assert (out.state, out.leading, out.reason) == ("open", "accepted", None)
    # exactly at the deadline the vote is closed
    assert C.decide(proposal(), [vote("a", 1), vote("b", 1)], DEADLINE).state == "accepted"


def test_an_open_proposal_that_would_expire_has_nothing_leading_and_says_why():
    """Not `open` with `leading: expired`: while open, no side leads, and `reason` says why."""
    before = DEADLINE - timedelta(seconds=1)
    few = C.decide(proposal(), [vote("a", 1)], before)
    assert (few.state, few.leading, few.reason) == ("open", None, "no_quorum")
    split = C.decide(proposal(), [vote("a", 1), vote("b", -1)], before)
    assert (split.state, split.leading, split.reason) == ("open", None, "no_majority")
    assert split.to_json()["leading"] is None
    against = C.decide(proposal(), [vote("a", -1), vote("b", -1)], before)
    assert (against.state, against.leading, against.reason) == ("open", "rejected", None)


def test_accepted_rejected_expired():
    assert C.decide(proposal(), [vote("a", 1), vote("b", 0.5)], AFTER).state == "accepted"
    assert C.decide(proposal(), [vote("a", -1), vote("b", -0.5)], AFTER).state == "rejected"
    split = C.decide(proposal(), [vote("a", 1), vote("b", -1)], AFTER)
    assert (split.state, split.reason, split.score) == ("expired", "no_majority", 0.0)
    lone = C.decide(proposal(), [vote("a", 1)], AFTER)
    assert (lone.state, lone.reason) == ("expired", "no_quorum")
    nobody = C.decide(proposal(), [], AFTER)
    assert (nobody.state, nobody.reason, nobody.score) == ("expired", "no_quorum", None)


def test_threshold_edges_are_inclusive():
    # score exactly 0.5: accepted; just under: not
    assert C.decide(proposal(), [vote("a", 1), vote("b", 0)], AFTER).state == "accepted"
    assert C.decide(proposal(), [vote("a", 0.99), vote("b", 0)], AFTER).reason == "no_majority"
    assert C.decide(proposal(), [vote("a", -1), vote("b", 0)], AFTER).state == "rejected"
    assert C.decide(proposal(threshold=1.0), [vote("a", 1), vote("b", 0.9)], AFTER).state == "expired"


def test_quorum_counts_neutral_votes_and_distinct_agents():
    # quorum 3: two agents voting three times each are still two voters
    many = [vote("a", 1, m) for m in (1, 2, 3)] + [vote("b", 1, m) for m in (1, 2, 3)]
    assert C.decide(proposal(quorum=3), many, AFTER).reason == "no_quorum"
    # a neutral vote counts toward the quorum (§6.2.7) and dilutes the score
    out = C.decide(proposal(quorum=3), [vote("a", 1), vote("b", 1), vote("c", 0)], AFTER)
    assert out.state == "accepted" and out.quorum_reached and round(out.score, 6) == round(2 / 3, 6)
    assert C.decide(proposal(quorum=1), [vote("a", 1)], AFTER).state == "accepted"


def test_the_latest_vote_of_an_agent_counts_and_duplicates_count_once():
    first, second = vote("a", -1, 1), vote("a", 1, 5)
    out = C.decide(proposal(), [second, first, vote("b", 1)], AFTER)
    assert out.state == "accepted"
    assert [v.did for v, _ in out.counted] == [second.did, vote("b", 1).did]
    assert {"agent_did": first.agent, "target": first.did, "value": -1, "reason": "superseded"} in out.excluded
    # the very same vote twice (two relays delivered it): counted once, not listed as superseded
    twice = C.decide(proposal(), [vote("b", 1), vote("b", 1), vote("c", 1)], AFTER)
    assert len(twice.counted) == 2 and twice.excluded == []
    # equal timestamps: the greater vote DID wins, whatever the input order
    x, y = vote("a", 1, 2, did="did:hmp:container:x"), vote("a", -1, 2, did="did:hmp:container:y")
    for order in ([x, y], [y, x]):
        assert [v.did for v, _ in C.decide(proposal(), order, AFTER).counted] == [y.did]


def test_late_early_ineligible_and_wrong_target_votes_do_not_count():
    late = vote("c", -1, 61)
    early = vote("d", -1, -1)
    outsider = vote("e", -1)
    wrong = vote("f", -1, target="did:hmp:container:other")
    rules = {"voters": ("did:hmp:agent:a", "did:hmp:agent:b", "did:hmp:agent:c", "did:hmp:agent:d",
                        "did:hmp:agent:f")}
    out = C.decide(proposal(**rules), [vote("a", 1), vote("b", 1), late, early, outsider, wrong], AFTER)
    assert out.state == "accepted" and len(out.counted) == 2
    assert {e["target"]: e["reason"] for e in out.excluded} == {
        late.did: "late", early.did: "early", outsider.did: "ineligible", wrong.did: "wrong_target"}


def test_a_late_vote_does_not_replace_an_agents_timely_vote():
    out = C.decide(proposal(), [vote("a", 1, 10), vote("a", -1, 70), vote("b", 1)], AFTER)
    assert out.state == "accepted"


def test_trust_weights():
    votes = [vote("a", 1), vote("b", -1), vote("c", -1)]
    assert C.decide(proposal(quorum=3), votes, AFTER).state == "expired"
    weights = {"did:hmp:agent:a": 0.9, "did:hmp:agent:b": 0.1, "did:hmp:agent:c": 0.1}
    out = C.decide(proposal(quorum=3, weighting="trust"), votes, AFTER, weights)
    assert out.state == "accepted" and round(out.score, 6) == round(0.7 / 1.1, 6)
    # weights are ignored under equal weighting; a voter without a figure weighs 0 under trust
    assert C.decide(proposal(quorum=3), votes, AFTER, weights).state == "expired"
    assert C.decide(proposal(quorum=3, weighting="trust"), votes, AFTER, {}).reason == "no_quorum"


def test_a_proposal_without_ttl_stays_open():
    forever = C.Proposal(P, "did:hmp:agent:p", START, None)
    assert C.decide(forever, [vote("a", 1), vote("b", 1)], NOW + timedelta(days=999)).state == "open"


def test_rules_from_the_payload():
    assert C.rules_from_payload({"text": "x"}) == C.DEFAULT_RULES
    rules = C.rules_from_payload({"consensus": {"quorum": 3, "threshold": 0.66, "voters": ["did:a:2", "did:a:1"],
                                                "weighting": "trust"}})
    assert rules == C.Rules(3, 0.66, ("did:a:1", "did:a:2"), "trust")
    assert C.rules_from_payload({"consensus": C.rules_payload(rules)}) == rules
    for bad in ({"quorum": 0}, {"quorum": True}, {"quorum": 1.5}, {"threshold": 0}, {"threshold": 2},
                {"threshold": float("nan")}, {"voters": []}, {"voters": ["x"]}, {"weighting": "stake"}, "all"):
        with pytest.raises(C.ConsensusError) as exc:
            C.rules_from_payload({"consensus": bad})
        assert exc.value.reason == "invalid_rules"


def test_vote_values():
    assert C.vote_value(True) == 1 and C.vote_value(False) == -1 and C.vote_value(0) == 0
    for bad in (2, -1.5, float("inf"), "1", None):
        with pytest.raises(C.ConsensusError):
            C.vote_value(bad)


# -- results and recounts -------------------------------------------------------------------

VOTES = [vote("a", 1), vote("b", 0.9), vote("c", -0.2), vote("a", -1, 0.5)]


def closed(prop: C.Proposal, votes=VOTES, weights=None):
    payload, related = C.result_payload(prop, C.decide(prop, votes, AFTER, weights))
    held = {v.did: v for v in votes}
    return payload, related, held


def test_result_payload_references_every_counted_vote():
    prop = proposal()
    payload, related, _ = closed(prop)
    entry = payload[P]
    assert related == {"in_reply_to": [P], "depends_on": sorted(v.did for v in VOTES[:3])}
    assert entry["state"] == "accepted" and entry["type"] == "original"
    assert entry["summary_percent"] == {"approved": round(2 / 3, 6), "rejected": round(1 / 3, 6), "neutral": 0.0}
    assert entry["summary_distribution"] == {"-0.2≤X<-0.1": 1, "0.8<X≤0.9": 1, "0.9<X≤1.0": 1}
    assert [e["reason"] for e in entry["excluded"]] == ["superseded"]
    with pytest.raises(C.ConsensusError):
        C.result_payload(prop, C.decide(prop, VOTES, START))


def test_an_honest_result_recounts():
    prop = proposal()
    payload, related, held = closed(prop)
    check = C.recount(prop, prop.proposer, AFTER, payload, related, held)
    assert (check.status, check.problems, check.state) == ("match", [], "accepted")
    trust = proposal(weighting="trust")
    weights = {"did:hmp:agent:a": 0.3, "did:hmp:agent:b": 0.2, "did:hmp:agent:c": 0.9}
    payload, related, held = closed(trust, weights=weights)
    assert payload[P]["weights"] == [0.3, 0.2, 0.9] and payload[P]["state"] == "expired"
    assert C.recount(trust, trust.proposer, AFTER, payload, related, held).status == "match"
    # the weights moved to other votes: the arithmetic no longer gives the stated score
    payload[P]["weights"] = [0.9, 0.2, 0.3]
    assert "score_differs" in C.recount(trust, trust.proposer, AFTER, payload, related, held).problems


def test_excluded_votes_listed_are_bounded():
    prop = proposal()
    votes = [vote("a", 1, m / 100) for m in range(1, C.EXCLUDED_LISTED + 10)] + [vote("b", 1)]
    payload, _, _ = closed(prop, votes)
    assert len(payload[P]["excluded"]) == C.EXCLUDED_LISTED
    assert payload[P]["excluded_total"] == C.EXCLUDED_LISTED + 8


@pytest.mark.parametrize("forge, problem", [
    (lambda p, r: p[P].__setitem__("state", "rejected"), "state_differs"),
    (lambda p, r: p[P].__setitem__("score", 0.99), "score_differs"),
    (lambda p, r: p[P]["summary_percent"].__setitem__("approved", 1.0), "summary_differs"),
    (lambda p, r: p[P]["rules"].__setitem__("quorum", 1), "rules_differ"),
    (lambda p, r: p[P].__setitem__("weights", [0.5, 1, 1]), "bad_weight"),
    (lambda p, r: p[P].__setitem__("weights", [1, 1]), "bad_weight"),
    (lambda p, r: r["depends_on"].remove(r["depends_on"][0]), "score_differs"),
    (lambda p, r: r["depends_on"].append(VOTES[3].did), "vote_not_countable"),
    (lambda p, r: r.__setitem__("depends_on", "x"), "not_a_vote"),
    (lambda p, r: p.pop(P), "no_entry"),
])
def test_a_forged_result_does_not_recount(forge, problem):
    prop = proposal()
    payload, related, held = closed(prop)
    payload, related = copy.deepcopy(payload), copy.deepcopy(related)
    forge(payload, related)
    check = C.recount(prop, prop.proposer, AFTER, payload, related, {**held, "x": None})
    assert check.status == "mismatch" and problem in check.problems, check


def test_a_result_from_someone_else_or_before_the_deadline_is_flagged():
    prop = proposal()
    payload, related, held = closed(prop)
    assert C.recount(prop, "did:hmp:agent:mallory", AFTER, payload, related, held).problems == ["not_proposer"]
    assert C.recount(prop, prop.proposer, START, payload, related, held).problems == ["closed_early"]


def test_a_result_whose_votes_are_not_held_is_incomplete_and_uncounted_votes_are_listed():
    prop = proposal()
    payload, related, held = closed(prop)
    missing = related["depends_on"][0]
    check = C.recount(prop, prop.proposer, AFTER, payload, related, {k: v for k, v in held.items() if k != missing})
    assert (check.status, check.missing) == ("incomplete", [missing])
    extra = vote("z", 1)
    check = C.recount(prop, prop.proposer, AFTER, payload, related, held, others=[*VOTES, extra, vote("y", 1, 99)])
    assert check.status == "match" and check.uncounted == [extra.did]


def test_a_reference_to_something_that_is_not_a_vote_is_a_mismatch():
    prop = proposal()
    payload, related, held = closed(prop)
    related = {**related, "depends_on": [*related["depends_on"], "did:hmp:container:note"]}
    check = C.recount(prop, prop.proposer, AFTER, payload, related, {**held, "did:hmp:container:note": None})
    assert "not_a_vote" in check.problems


# -- trust ---------------------------------------------------------------------------------


def test_trust_is_neutral_without_evidence_and_bounded():
    assert trust_figure("did:a:x", []).trust == 0.5
    high = trust_figure("did:a:x", [(f"did:a:{i}", 1.0, 1) for i in range(1000)])
    low = trust_figure("did:a:x", [(f"did:a:{i}", -1.0, 1) for i in range(1000)])
    assert 0.99 < high.trust < 1 and 0 < low.trust < 0.01
    # damping: one evaluator moves it a little
    assert trust_figure("did:a:x", [("did:a:e", 1.0, 1)], damping=3).trust == 0.625
    with pytest.raises(ValueError):
        trust_figure("did:a:x", [], damping=0)


def test_trust_ignores_self_evaluation_caps_and_counts_an_evaluator_once():
    self_praise = trust_figure("did:a:x", [("did:a:x", 1.0, 100_000)])
    assert (self_praise.trust, self_praise.evaluators) == (0.5, 0)
    # a flood from one evaluator weighs as one capped evaluation
    flood = trust_figure("did:a:x", [("did:a:e", 50.0, 100_000)])
    assert flood.trust == trust_figure("did:a:x", [("did:a:e", 1.0, 1)]).trust
    twice = trust_figure("did:a:x", [("did:a:e", 1.0, 1), ("did:a:e", 1.0, 1)])
    assert twice.evaluators == 1


@pytest.mark.parametrize("entry", [
    {"state": "accepted", "weights": [["x"], {"a": 1}, "junk"]},
    {"state": "accepted", "weights": "x"},
    {"state": ["x"], "score": "high", "summary_percent": {"approved": "all"}, "rules": None, "counted": "x"},
    {"state": "accepted", "score": True, "summary_percent": {"approved": True, "rejected": float("nan")}},
    {"score": float("inf"), "summary_percent": []},
])
def test_hostile_result_members_are_a_mismatch_never_an_exception(entry):
    prop = proposal()
    payload, related, held = closed(prop)
    check = C.recount(prop, prop.proposer, AFTER, {P: {**payload[P], **entry}}, related, held)
    assert check.status == "mismatch" and check.problems


def test_a_result_for_max_votes_fits_in_one_container():
    """4096 counted votes (consensus.max_votes), trust weights, as many excluded: the
    signed consensus_result stays under the default container limit, so it can close."""
    import hashlib

    from hmpnode.container.build import build_container
    from hmpnode.container.canonical import canonical_json
    from hmpnode.container.encoding import b58encode
    from hmpnode.container.verify import Limits
    from hmpnode.identity import Identity

    def did(i: int) -> str:  # as long as a real container DID
        return "did:hmp:container:" + b58encode(hashlib.sha256(str(i).encode()).digest())

    prop = C.Proposal(did(-1), "did:hmp:agent:p", START, DEADLINE, C.Rules(weighting="trust"))
    votes = [C.Vote(did(i), f"did:hmp:agent:{i % C.MAX_VOTERS:05d}" + "x" * 40, prop.did, 0.7,
                    START + timedelta(milliseconds=1 + i)) for i in range(2 * C.MAX_VOTERS)]
    outcome = C.decide(prop, votes, AFTER, {v.agent: 0.123456 for v in votes})
    assert len(outcome.counted) == C.MAX_VOTERS and len(outcome.excluded) == C.MAX_VOTERS
    payload, related = C.result_payload(prop, outcome)
    full = build_container(Identity(bytes([5]) * 32), "consensus_result", payload, now=AFTER, related=related)
    assert len(canonical_json(full["hmp_container"])) < Limits().max_container_bytes
