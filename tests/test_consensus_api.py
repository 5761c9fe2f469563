"""Consensus and trust through the agent API and the CLI: propose, vote, close,
read the state, recount a received consensus_result (honest and forged)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hmpnode.container.build import build_container
from hmpnode.container.encoding import parse_time
from hmpnode.container.evaluations import build_evaluation
from hmpnode.identity import Identity
from tests.conftest import NOW, Clock, running_node
from tests.nodeproc import hmp
from tests.test_api import BOB, CAROL, NODE_SEED
from tests import test_api

make_api = test_api.make_api  # the fixture: a Node behind the API on 127.0.0.1, with a hand-set clock

DAVE = Identity(bytes([4]) * 32)


def vote(identity: Identity, proposal: str, value: Any, at, **kw) -> dict[str, Any]:
    return build_container(identity, "vote", {"target_did": proposal, "vote_value": value}, now=at,
                           related={"in_reply_to": [proposal]}, **kw)


async def ingest(node, *containers) -> None:
    results = await node.ingest(list(containers), source="peer:did:hmp:agent:relay")
    assert all(r.status == "stored" for r in results), results


async def propose_and_close(api) -> tuple[str, dict[str, Any], list[dict[str, Any]], str]:
    """The node proposes (quorum 2, 1 h), votes yes; Bob votes no then yes, Carol yes,
    Dave votes after the deadline; the node closes. Returns (proposal DID, its container, the votes, the result DID)."""
    status, created = await api.post("/v1/consensus", {"text": "adopt the new relay policy", "ttl": "1h",
                                                       "quorum": 2, "tags": ["policy"]})
    assert status == 201, created
    did = created["did"]
    head = created["container"]["hmp_container"]["head"]
    assert head["class"] == "proposal" and parse_time(head["ttl"]) == NOW + timedelta(hours=1)
    status, state = await api.get(f"/v1/consensus/{did}")
    assert status == 200 and (state["state"], state["counted"], state["deadline"]) == ("open", [], head["ttl"])
    assert state["rules"] == {"quorum": 2, "threshold": 0.5, "weighting": "equal"}
    api.clock.now = NOW + timedelta(minutes=10)
    status, mine = await api.post(f"/v1/consensus/{did}/votes", {"value": True, "reason": "cheaper"})
    assert status == 201, mine
    votes = [
        vote(BOB, did, -1, NOW + timedelta(minutes=1)),
        vote(BOB, did, 1, NOW + timedelta(minutes=5)),
        vote(CAROL, did, 0.5, NOW + timedelta(minutes=6)),
    ]
    await ingest(api.node, *votes)
    status, state = await api.get(f"/v1/consensus/{did}")
    assert (state["state"], state["leading"], len(state["counted"])) == ("open", "accepted", 3)
    assert [e["reason"] for e in state["excluded"]] == ["superseded"]
    # after the deadline: no more votes from this agent, and a late one from a peer does not count
    api.clock.now = NOW + timedelta(hours=1, seconds=5)
    status, refused = await api.post(f"/v1/consensus/{did}/votes", {"value": -1})
    assert (status, refused["reason"]) == (409, "voting_closed")
    late = vote(DAVE, did, -1, NOW + timedelta(hours=1, seconds=2))
    await ingest(api.node, late)
    # within close_grace_seconds (10) nothing closes yet
    assert await api.node.close_due() == []
    api.clock.now = NOW + timedelta(hours=1, seconds=11)
    (result_did,) = await api.node.close_due()
    assert await api.node.close_due() == []  # closed once
    return did, created["container"], [mine["container"], *votes, late], result_did


async def test_propose_vote_close_and_read_the_state(make_api):
    api = await make_api()
    did, _, votes, result_did = await propose_and_close(api)
    status, state = await api.get(f"/v1/consensus/{did}")
    assert status == 200
    assert (state["state"], state["closed_by"], state["score"]) == ("accepted", result_did, round(2.5 / 3, 6))
    assert {e["reason"] for e in state["excluded"]} == {"superseded", "late"}
    (result,) = state["results"]
    assert result["authoritative"] and result["recount"] == {
        "status": "match", "problems": [], "missing": [], "uncounted": [], "state": "accepted"}
    stored = (await api.node.get(result_did))["container"]["hmp_container"]
    assert stored["head"]["class"] == "consensus_result" and stored["head"]["broadcast"] is True
    counted = {votes[0]["hmp_container"]["head"]["container_did"], votes[2]["hmp_container"]["head"]["container_did"],
               votes[3]["hmp_container"]["head"]["container_did"]}
    assert stored["related"] == {"in_reply_to": [did], "depends_on": sorted(counted)}


async def test_another_node_recounts_honest_and_forged_results(make_api, tmp_path):
    api = await make_api()
    did, proposal, votes, result_did = await propose_and_close(api)
    result = (await api.node.get(result_did))["container"]
    proposer = Identity(NODE_SEED)
    clock = Clock(NOW + timedelta(hours=2))
    async with running_node(Identity(bytes([9]) * 32), tmp_path / "other", clock=clock) as other:
        # the result first: its votes are not here yet
        await ingest(other, proposal, result)
        state = await other.consensus(did)
        assert state["results"][0]["recount"]["status"] == "incomplete"
        await ingest(other, *votes)
        state = await other.consensus(did)
        assert (state["state"], state["closed_by"]) == ("accepted", result_did)
        assert state["results"][0]["recount"]["status"] == "match"
        # the proposer's key signs a result that says rejected: flagged and counted once
        hmp = result["hmp_container"]
        forged_payload = {did: {**hmp["payload"][did], "state": "rejected"}}
        forged = build_container(proposer, "consensus_result", forged_payload, now=NOW + timedelta(hours=1, minutes=1),
                                 related=hmp["related"], broadcast=True)
        await ingest(other, forged)
        assert (await other.status())["ingest"]["consensus_result_mismatch"] == 1
        state = await other.consensus(did)
        checks = {r["did"]: r["recount"] for r in state["results"]}
        forged_did = forged["hmp_container"]["head"]["container_did"]
        assert checks[forged_did]["status"] == "mismatch" and checks[forged_did]["problems"] == ["state_differs"]
        assert state["closed_by"] == result_did and state["state"] == "accepted"
        assert (await other.status())["ingest"]["consensus_result_mismatch"] == 1
        # a result by someone else than the proposer is recounted, not authoritative
        rival = build_container(BOB, "consensus_result", hmp["payload"], now=NOW + timedelta(hours=1, minutes=2),
                                related=hmp["related"])
        await ingest(other, rival)
        rival_check = next(r for r in (await other.consensus(did))["results"] if r["sender"] == BOB.did)
        assert not rival_check["authoritative"] and rival_check["recount"]["problems"] == ["not_proposer"]


async def test_trust_figure_and_trust_weighted_votes(make_api):
    api = await make_api()
    node = api.node
    # Bob's containers: Carol approves one; Bob floods approvals of his own; Dave floods one
    # evaluation per container of Bob's (counts once)
    bobs = [build_container(BOB, "diary_entry", {"title": str(i), "content": "c"}, now=NOW) for i in range(20)]
    await ingest(node, *bobs)
    for i, c in enumerate(bobs):
        did = c["hmp_container"]["head"]["container_did"]
        assert await node.add_evaluation(did, build_evaluation(BOB, value=1, type="support", target=did, now=NOW)) \
            == "active"
        assert await node.add_evaluation(did, build_evaluation(DAVE, value=1, type="support", target=did, now=NOW)) \
            == "active"
        if i == 0:
            await node.add_evaluation(did, build_evaluation(CAROL, value=1, type="support", target=did, now=NOW))
    status, figure = await api.get(f"/v1/trust/{BOB.did}")
    assert status == 200
    assert (figure["trust"], figure["evaluators"], figure["evaluations"]) == (round(0.5 + 0.5 * 2 / 5, 6), 2, 21)
    status, nobody = await api.get(f"/v1/trust/{CAROL.did}")
    assert (nobody["trust"], nobody["evaluators"]) == (0.5, 0)
    assert (await api.get("/v1/trust/nodid"))[0] == 400
    # a trust-weighted proposal: Bob (0.7) for, Carol (0.5) against -> score 0.2/1.2: no majority
    status, created = await api.post("/v1/consensus", {"text": "t", "ttl": "1h", "weighting": "trust",
                                                       "threshold": 0.1})
    assert status == 201
    did = created["did"]
    await ingest(node, vote(BOB, did, 1, NOW + timedelta(minutes=1)), vote(CAROL, did, -1, NOW + timedelta(minutes=1)))
    state = (await api.get(f"/v1/consensus/{did}"))[1]
    assert {c["agent_did"]: c["weight"] for c in state["counted"]} == {BOB.did: 0.7, CAROL.did: 0.5}
    assert (state["leading"], state["score"]) == ("accepted", round(0.2 / 1.2, 6))


async def test_bad_requests_get_clear_errors(make_api):
    api = await make_api()
    cases = [
        ({"text": "x", "payload": {"a": 1}}, "payload"),
        ({}, "payload"),
        ({"text": "x", "quorum": 0}, "quorum"),
        ({"text": "x", "quorum": 1.5}, "quorum"),
        ({"text": "x", "threshold": 2}, "threshold"),
        ({"text": "x", "weighting": "stake"}, "weighting"),
        ({"text": "x", "voters": ["nodid"]}, "voters"),
        ({"text": "x", "ttl": "2020-01-01T00:00:00Z"}, "ttl"),
        ({"payload": {"consensus": {}}}, "payload"),
        ({"text": "x", "extra": 1}, "extra"),
    ]
    for body, field in cases:
        status, out = await api.post("/v1/consensus", body)
        assert status == 400 and field in out["detail"], (body, out)
    unknown = "did:hmp:container:QmUnknownUnknownUnknownUnknownUnknownUnknown1"
    assert (await api.get(f"/v1/consensus/{unknown}"))[0] == 404
    assert (await api.post(f"/v1/consensus/{unknown}/votes", {"value": 1}))[0] == 404
    did = (await api.post("/v1/consensus", {"text": "x"}))[1]["did"]
    for body in ({"value": 2}, {"value": "yes"}, {}, {"value": 1, "weight": 3}):
        status, out = await api.post(f"/v1/consensus/{did}/votes", body)
        assert status == 400, (body, out)
    # a peer's proposal whose rules are unusable: the state cannot be computed, said so
    odd = build_container(BOB, "proposal", {"text": "x", "consensus": {"quorum": -1}}, now=NOW,
                          ttl=NOW + timedelta(hours=1))
    await ingest(api.node, odd)
    status, out = await api.get(f"/v1/consensus/{odd['hmp_container']['head']['container_did']}")
    assert (status, out["reason"]) == (422, "invalid_rules")


def test_cli_refuses_a_bad_vote_value_before_asking_the_node(tmp_path):
    proc = hmp("vote", "did:hmp:container:QmX", "maybe", "--data-dir", str(tmp_path))
    assert proc.returncode == 2 and b"give yes, no, abstain or a number in [-1, 1]" in proc.stderr
    proc = hmp("propose", "x", "--weighting", "stake", "--data-dir", str(tmp_path))
    assert proc.returncode == 2
