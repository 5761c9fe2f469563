"""Recall under a budget, fail-closed (issue 5): an evidence suite in the style of the
seeds' — histories with a planted target, look-alike distractors, a supersede chain,
expired, contested and revoked twins — and budgets from tiny to large."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.evaluations import build_evaluation
from hmpnode.identity import Identity
from hmpnode.memory.recall import short_id
from hmpnode.memory.tokens import count_json_tokens
from hmpnode.net.announce import build_peer_announce
from hmpnode.node import Node, NodeError
from hmpnode.store.search import SearchQuery

from .conftest import NOW, Clock, running_node

ME, ALICE, BOB, MALLORY = (Identity(bytes([i]) * 32) for i in (60, 61, 62, 63))
QUERY = "which port does the staging database listen on"
WORDS = ("alpha budget cluster deploy ember forest garden harbor island jungle kernel lantern meadow"
         " nebula orbit planet quartz river summit tunnel velvet willow").split()



def did(c):
    return c["hmp_container"]["head"]["container_did"]


def note(identity, text, at, **options):
    return build_container(identity, "note", {"text": text}, now=NOW + timedelta(seconds=at), **options)


async def history(node: Node, size: int, seed: int = 7) -> dict[str, str]:
    """`size` containers: noise, distractors, the target and its stale twins."""
    rng = random.Random(seed)
    made = [note(ALICE, " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))), i)
            for i in range(size - 9)]
    distractors = [note(BOB, "the staging cluster listens on many ports, see the wiki", size + 1),
                   note(BOB, "production database backups run at night", size + 2)]
    v1 = note(ALICE, "the staging database listens on port 5432", size + 3)
    target = note(ALICE, "the staging database listens on port 6543 since the migration", size + 4,
                  related={"previous_version": did(v1)})
    expired = note(ALICE, "the staging database listens on port 7000 until friday", size + 5,
                   ttl=NOW + timedelta(hours=1))
    disputed = note(BOB, "the staging database listens on port 8000", size + 6)
    rebuttal = note(ALICE, "no, it does not", size + 7, related={"contradicts": did(disputed)})
    revoked = note(MALLORY, "the staging database listens on port 9999", size + 8)
    made += distractors + [v1, target, expired, disputed, rebuttal, revoked]
    results = await node.ingest(made)
    assert all(r.status == "stored" for r in results)
    (gone,) = await node.ingest([build_peer_announce(MALLORY, addresses=[], now=NOW + timedelta(hours=2),
                                                     key_is_falsified=True)])
    assert gone.status == "stored"
    return {"target": did(target), "v1": did(v1), "expired": did(expired), "disputed": did(disputed),
            "revoked": did(revoked)}


def clock() -> Clock:
    return Clock(NOW + timedelta(days=1))


@pytest.fixture
async def node(tmp_path):
    async with running_node(ME, tmp_path, clock=clock()) as n:
        yield n


def within(outcome, max_tokens: int, max_bytes: int) -> dict:
    """Recount the returned envelope independently; return it."""
    data = outcome.envelope_json
    assert data == canonical_json(outcome.envelope)
    assert len(data) <= max_bytes
    assert count_json_tokens(outcome.envelope) <= max_tokens
    assert outcome.envelope["used"] == [count_json_tokens(outcome.envelope), len(data)]
    return outcome.envelope


def ids(env) -> list[str]:
    return [i["id"] for i in env["items"]]


@pytest.mark.parametrize("size", [100, 500, 2000])
async def test_target_found_stale_twins_never_returned_budgets_kept(node, size):
    planted = await history(node, size)
    stale = {planted[k] for k in ("v1", "expired", "disputed", "revoked")}
    for max_tokens, max_bytes in ((450, 900), (2000, 8000), (100_000, 1_000_000)):
        outcome = await node.recall(QUERY, max_tokens=max_tokens, max_bytes=max_bytes, why=True)
        env = within(outcome, max_tokens, max_bytes)
        got = [w["did"] for w in env["why"]]
        assert got[0] == planted["target"], env["why"][:3]
        assert ids(env) == [short_id(d) for d in got]
        assert not stale & set(got)
        assert all("s" not in i for i in env["items"])  # active
        assert env["x"] == [1, 1, 1, 1]
        first = env["why"][0]
        assert set(first["matched"]) == {"staging", "database", "listen", "port"}  # stemmed: "listens"; no stop words
        # whole items only: each is the stored payload, unchanged
        assert env["items"][0]["p"] == {"text": "the staging database listens on port 6543 since the migration"}


async def test_deterministic_byte_identical(node):
    await history(node, 100)
    a = await node.recall(QUERY, max_tokens=3000, max_bytes=12000)
    b = await node.recall(QUERY, max_tokens=3000, max_bytes=12000)
    assert a.envelope_json == b.envelope_json


async def test_greedy_skips_what_does_not_fit_and_takes_smaller_later_items(node):
    big = note(ALICE, "kernel " * 200 + "lantern", 1)
    small = note(ALICE, "kernel lantern", 2)
    await node.ingest([big, small])
    outcome = await node.recall("kernel lantern", max_tokens=100_000, max_bytes=1200)
    env = within(outcome, 100_000, 1200)
    assert ids(env) == [short_id(did(small))]
    assert env["n"] == [2, 2]  # eligible, relevant; one item


async def test_a_payload_larger_than_the_byte_budget_is_not_opened_past_it(node, monkeypatch):
    """A compressed payload that decompresses beyond max_bytes cannot be an item: the
    node stops decompressing at the budget, counts it as eligible and packs the rest."""
    from hmpnode.container import compression

    huge = note(ALICE, "kernel lantern " * 200_000, 1, compression="zstd")  # 3 MB of text, ~1 KB on the wire
    small = note(ALICE, "kernel lantern", 2)
    assert all(r.status == "stored" for r in await node.ingest([huge, small]))
    await node.indexer.caught_up()  # the indexer opens it once, at its own limit (not recall's)
    limits: list[int] = []
    real = compression.decompress

    def watched(data, algo, *, limit):
        limits.append(limit)
        return real(data, algo, limit=limit)

    monkeypatch.setattr(compression, "decompress", watched)
    outcome = await node.recall("kernel lantern", max_tokens=100_000, max_bytes=4000)
    env = within(outcome, 100_000, 4000)
    assert ids(env) == [short_id(did(small))]
    assert env["n"] == [2, 2]
    assert limits == [4000]  # the huge one, decompressed no further than the budget
    # with room for it, it is recalled whole
    roomy = await node.recall("kernel lantern", max_tokens=10_000_000, max_bytes=8_000_000)
    assert set(ids(roomy.envelope)) == {short_id(did(huge)), short_id(did(small))}


async def test_abstain_with_reasons(node):
    planted = await history(node, 100)
    nothing = await node.recall("zeppelin xylophone", max_tokens=1000, max_bytes=4000)
    assert within(nothing, 1000, 4000)["items"] == [] and nothing.receipt["abstain"] == "no_match"
    only_stale = await node.recall("9999", max_tokens=1000, max_bytes=4000)  # only the revoked twin has it
    assert only_stale.envelope["items"] == [] and only_stale.receipt["abstain"] == "all_excluded"
    assert only_stale.receipt["x"][3] == 1
    tiny = await node.recall(QUERY, max_tokens=100_000, max_bytes=140)
    assert within(tiny, 100_000, 140)["items"] == [] and tiny.receipt["abstain"] == "budget_too_small"
    contested = await node.recall(QUERY, max_tokens=100_000, max_bytes=1_000_000, include_contested=True)
    states = {i["id"]: i.get("s", "active") for i in contested.envelope["items"]}
    assert states[short_id(planted["disputed"])] == "contested"


async def test_two_step_plan_resolves_or_fails_closed(node):
    planted = await history(node, 100)
    plan = await node.recall_plan(QUERY, max_tokens=4000, max_bytes=16000)
    assert "6543" not in str(plan["receipt"]) and "6543" not in plan["plan"]  # content-free
    one_step = await node.recall(QUERY, max_tokens=4000, max_bytes=16000)
    resolved = await node.recall_resolve(plan["plan"])
    assert resolved.envelope_json == one_step.envelope_json
    explained = await node.recall_plan(QUERY, max_tokens=4000, max_bytes=16000, why=True)  # the full receipt too
    assert (await node.recall_resolve(explained["plan"])).envelope_json == \
        (await node.recall(QUERY, max_tokens=4000, max_bytes=16000, why=True)).envelope_json
    # the target is superseded after planning: resolving refuses
    newer = note(ALICE, "the staging database moved to port 7777", 10_000,
                 related={"previous_version": planted["target"]})
    await node.ingest([newer])
    with pytest.raises(NodeError) as err:
        await node.recall_resolve(plan["plan"])
    assert err.value.reason == "stale_plan" and err.value.status == 409
    # the refusal names the state, not "no longer held": it is held, superseded
    assert f"{planted['target']}: now superseded, planned active" in err.value.detail, err.value.detail
    assert "no longer held" not in err.value.detail
    # a negative evaluation makes a planned item contested: stale as well
    plan2 = await node.recall_plan(QUERY, max_tokens=4000, max_bytes=16000)
    first = (await node.recall_resolve(plan2["plan"])).selected[0].did
    await node.add_evaluation(first, build_evaluation(BOB, value=-1.0, type="accuracy", target=first, now=NOW))
    with pytest.raises(NodeError) as err:
        await node.recall_resolve(plan2["plan"])
    assert err.value.reason == "stale_plan"
    # retracted by its sender after planning: named so too
    plan3 = await node.recall_plan(QUERY, max_tokens=4000, max_bytes=16000)
    picked = (await node.recall_resolve(plan3["plan"])).selected[0]
    sender = next(i for i in (ALICE, BOB) if i.did == picked.sender)
    await node.ingest([note(sender, "scratch that", 10_001, related={"contradicts": picked.did})])
    with pytest.raises(NodeError) as err:
        await node.recall_resolve(plan3["plan"])
    assert f"{picked.did}: now retracted, planned active" in err.value.detail, err.value.detail
    # forged or foreign plans are refused
    token = plan2["plan"]
    with pytest.raises(NodeError) as err:
        await node.recall_resolve(token[:-2] + ("AA" if not token.endswith("AA") else "BA"))
    assert err.value.reason == "bad_plan"


async def test_budget_invariant_over_random_budgets(node):
    await history(node, 200, seed=11)
    rng = random.Random(3)
    for _ in range(60):
        max_tokens, max_bytes = rng.randint(1, 6000), rng.randint(1, 20000)
        outcome = await node.recall(rng.choice([QUERY, "kernel lantern river", "port", "garden summit"]),
                                    max_tokens=max_tokens, max_bytes=max_bytes)
        if outcome.packed is not None:
            within(outcome, max_tokens, max_bytes)
        else:
            assert outcome.envelope["abstain"] == "budget_too_small"


@pytest.mark.parametrize("seed", range(4))
async def test_invariants_over_random_stores_and_budgets(tmp_path, seed):
    """Random stores (supersede chains, contradictions, expiry, evaluations, revocation) and
    random budgets: never over budget, nothing stale, whole items, deterministic."""
    rng = random.Random(seed)
    async with running_node(ME, tmp_path, clock=clock()) as node:
        people = [ALICE, BOB, MALLORY]
        made: list[dict] = []
        texts: dict[str, dict] = {}
        for i in range(60):
            author = rng.choice(people)
            options: dict = {}
            roll = rng.random()
            if made and roll < 0.15:
                options["related"] = {"previous_version": did(rng.choice(made))}
            elif made and roll < 0.25:
                options["related"] = {"contradicts": did(rng.choice(made))}
            elif roll < 0.35:
                options["ttl"] = NOW + timedelta(minutes=rng.randint(1, 3000))
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
            container = note(author, text, i, **options)
            made.append(container)
            texts[did(container)] = {"text": text}
        await node.ingest(made)
        for c in rng.sample(made, 8):
            await node.add_evaluation(did(c), build_evaluation(rng.choice(people), value=rng.uniform(-1, 1),
                                                               type="usefulness", target=did(c), now=NOW))
        if rng.random() < 0.5:
            await node.ingest([build_peer_announce(MALLORY, addresses=[], now=NOW + timedelta(hours=1),
                                                   key_is_falsified=True)])
        for _ in range(25):
            query = " ".join(rng.sample(WORDS, rng.randint(1, 4)))
            max_tokens, max_bytes = rng.randint(1, 5000), rng.randint(1, 20000)
            contested = rng.random() < 0.3
            a = await node.recall(query, max_tokens=max_tokens, max_bytes=max_bytes, include_contested=contested)
            b = await node.recall(query, max_tokens=max_tokens, max_bytes=max_bytes, include_contested=contested)
            assert a.envelope_json == b.envelope_json
            if a.packed is None:  # below an empty answer: the fixed abstain, which says what would do
                assert a.envelope["abstain"] == "budget_too_small" and a.envelope["items"] == []
                continue
            env = within(a, max_tokens, max_bytes)
            allowed = {"active", "contested"} if contested else {"active"}
            for item, c in zip(env["items"], a.selected):
                assert item["id"] == short_id(c.did) and item.get("s", "active") == c.state in allowed
                assert item["p"] == texts[c.did]
            states = await node.search(query, SearchQuery("", limit=1000))
            by_did = {h["did"]: h["state"] for h in states["items"]}
            assert all(by_did[c.did] == c.state for c in a.selected)


# ---------------------------------------------------------------- issue 12: recall an agent can trust


async def test_a_200_version_chain_is_recalled(node):
    """A fact updated 199 times with the same wording: the 200 versions tie on BM25, and the
    top 100 hits (ties oldest first) were all superseded: the answer was all_excluded."""
    chain, prev = [], None
    for i in range(200):
        c = note(ALICE, f"the cache-a1 server listens on port {10_000 + i}", i,
                 related={"previous_version": did(prev)} if prev else None)
        chain.append(c)
        prev = c
    assert all(r.status == "stored" for r in await node.ingest(chain))
    outcome = await node.recall("which port does the cache-a1 server listen on?", max_tokens=800, max_bytes=8000)
    env = within(outcome, 800, 8000)
    assert ids(env) == [short_id(did(chain[-1]))] and env["items"][0]["p"]["text"].endswith("10199")
    assert env["x"][0] == 199 and env["abstain"] is None  # every superseded version counted, none returned


async def test_an_unknown_entity_abstains(node):
    """Asked about a database never stored, with familiar words: no other entity's fact."""
    await node.ingest([note(ALICE, f"the billing-v{v} database listens on port {5400 + v}", v) for v in (1, 2, 3)]
                      + [note(ALICE, "the orders database listens on port 6000", 4),
                         note(BOB, "Anna Novak is the database owner of the storage team", 5)])
    for question in ("what port does the billing-v7 database use?", "which port does the payments-v2 database use",
                     "what does Anna Kowalski own?"):
        outcome = await node.recall(question, max_tokens=4000, max_bytes=16000)
        env = within(outcome, 4000, 16000)
        assert env["items"] == [] and env["abstain"] == "no_relevant_match", (question, env)
    known = await node.recall("what port does the billing-v2 database use?", max_tokens=4000, max_bytes=16000)
    assert [i["p"]["text"] for i in known.envelope["items"]] == ["the billing-v2 database listens on port 5402"]
    assert known.envelope["n"] == [1, 1]  # the index query requires the identifying words: others not even looked at


async def test_a_decision_question_finds_the_decision(node):
    """"What did we decide about X": the decision says "decision", short look-alikes won on length."""
    made = [note(ALICE, "Decision on session cache: we chose redis over memcached because the team knows it", 1),
            note(ALICE, "session cache notes", 2), note(ALICE, "session cache: open questions about memcached", 3),
            note(ALICE, "the session cache hit rate dropped on monday", 4)]
    made += [note(BOB, " ".join(random.Random(i).sample(WORDS, 6)), 10 + i) for i in range(30)]
    await node.ingest(made)
    outcome = await node.recall("what did we decide about the session cache?", max_tokens=800, max_bytes=8000,
                                why=True)
    env = within(outcome, 800, 8000)
    assert env["items"][0]["p"]["text"].startswith("Decision on session cache"), env["why"]
    assert "decide" in env["why"][0]["matched"]  # "decide" meets "decision"


async def test_a_query_of_only_stop_words_abstains(node):
    await node.ingest([note(ALICE, "what it is, it is", 1), note(ALICE, "that was how it was", 2)])
    for question in ("what is it?", "how was that", "and the of"):
        outcome = await node.recall(question, max_tokens=800, max_bytes=8000)
        env = within(outcome, 800, 8000)
        assert env["items"] == [] and env["abstain"] == "no_query_terms"


async def test_compact_envelope_overhead(node):
    """An empty answer at most 60 tokens, at most 40 per item beyond its payload (here from
    another sender, the larger form); with 800 tokens at least 8 one-line notes fit."""
    lines = [note(ALICE, f"deploy note {i}: the kernel lantern job runs at {i:02d}:00 on the harbor host", i)
             for i in range(20)]
    await node.ingest(lines)
    empty = within(await node.recall("zeppelin xylophone", max_tokens=800, max_bytes=8000), 800, 8000)
    assert empty["items"] == [] and empty["used"][0] <= 60
    outcome = await node.recall("when does the kernel lantern job run on the harbor host", max_tokens=800,
                                max_bytes=100_000)
    env = within(outcome, 800, 100_000)
    assert len(env["items"]) >= 8
    assert all("by" in i for i in env["items"])  # ALICE is not this node's agent
    payload = sum(count_json_tokens(i["p"]) for i in env["items"])
    assert (env["used"][0] - payload - empty["used"][0]) / len(env["items"]) <= 40
    # the full receipt on request, counted once, in the same budget
    full = await node.recall("when does the kernel lantern job run on the harbor host", max_tokens=800,
                             max_bytes=100_000, why=True)
    full_env = within(full, 800, 100_000)
    assert [w["id"] for w in full_env["why"]] == ids(full_env) and full_env["max"] == [800, 100_000]
    assert len(full_env["items"]) < len(env["items"])  # the why entries took their share


async def test_a_budget_below_an_empty_answer_abstains(node):
    """Not an error (HTTP 422): the abstain says the smallest budget that gives an answer."""
    await history(node, 100)
    outcome = await node.recall(QUERY, max_tokens=5, max_bytes=5)
    assert outcome.packed is None and outcome.envelope["items"] == []
    assert outcome.envelope["abstain"] == "budget_too_small"
    need_tokens, need_bytes = outcome.envelope["need"]
    enough = await node.recall(QUERY, max_tokens=need_tokens, max_bytes=need_bytes)
    assert within(enough, need_tokens, need_bytes)["abstain"] == "budget_too_small"  # an empty answer, exactly


async def test_recall_limits_are_settings(tmp_path):
    """[recall] min_coverage_percent and candidates reach recall (hmpnode.config.RecallSettings)."""
    from hmpnode.config import RecallSettings

    made = [note(ALICE, "the staging database listens on port 6543", 1)]
    made += [note(ALICE, f"kernel lantern note {i}", 2 + i) for i in range(30)]
    strict = RecallSettings(candidates=5, min_coverage_percent=100).recall_limits()
    async with running_node(ME, tmp_path, clock=clock(), recall_limits=strict) as node:
        await node.ingest(made)
        partial = await node.recall("which port does the staging cluster use", max_tokens=800, max_bytes=8000)
        assert partial.envelope["items"] == [] and partial.envelope["abstain"] == "no_relevant_match"
        many = await node.recall("kernel lantern", max_tokens=100_000, max_bytes=1_000_000)
        assert many.envelope["n"] == [5, 5]  # the scan stops at `candidates` eligible hits
    async with running_node(ME, tmp_path / "default", clock=clock()) as node:
        await node.ingest(made)
        partial = await node.recall("which port does the staging cluster use", max_tokens=800, max_bytes=8000)
        assert [i["p"]["text"] for i in partial.envelope["items"]] == ["the staging database listens on port 6543"]


# ---------------------------------------------------------------- issue 21: recall quality and scope isolation


CLUSTERS = [note(ALICE, "the felbur cluster's backup window is 02:00 UTC", 1),
            note(ALICE, "the morvane cluster's patch window is tuesday night", 2),
            note(ALICE, "the morvane cluster's failover region is north", 4),
            note(BOB, "Anna Novak is the database owner of the storage team", 3)]
CLUSTERS += [note(BOB, " ".join(random.Random(i).sample(WORDS, 6)), 10 + i) for i in range(12)]


async def test_a_lowercase_unknown_name_abstains(node):
    """A name the memory never saw, in lowercase, among familiar words: "zarnik" carried less
    weight than "backup", "window" and "cluster" together, so the felbur cluster's fact was
    the answer; a word no memory holds that is no English word names something unknown."""
    await node.ingest(CLUSTERS)
    for question in ("what is the backup window of the zarnik cluster?", "zarnik cluster backup window",
                     "what is the patch window of the kelvora cluster", "what role does anna kowalski have?",
                     "Backup window of the Zarnik cluster?"):
        env = within(await node.recall(question, max_tokens=4000, max_bytes=16000), 4000, 16000)
        assert env["items"] == [] and env["abstain"] == "no_relevant_match", (question, env)


async def test_known_names_still_answer_through_typos_inflections_and_common_words(node):
    """What is not an unknown name: an English word no memory holds ("tonight"), a typo of
    one ("bakup") or of a word the memory holds ("felbru", "failovr": no English word),
    an inflection ("windows"), a number the memory holds, stop words."""
    await node.ingest(CLUSTERS)
    felbur = "the felbur cluster's backup window is 02:00 UTC"
    for question in ("what is the backup window of the felbur cluster?", "what is the bakup window of the felbur cluster",
                     "what are the backup windows of the felbur clusters?", "felbur cluster backup window tonight",
                     "is the felbur cluster backed up at 02:00 UTC?", "what is the backup window of the Felbur cluster",
                     "what is the backup window of the felbru cluster"):
        env = within(await node.recall(question, max_tokens=4000, max_bytes=16000), 4000, 16000)
        assert [i["p"]["text"] for i in env["items"]][:1] == [felbur], (question, env)
    env = (await node.recall("what is the failovr region of the morvane cluster", max_tokens=4000, max_bytes=16000)).envelope
    assert [i["p"]["text"] for i in env["items"]] == ["the morvane cluster's failover region is north"]


async def test_a_plan_resolved_after_a_forget_counts_what_is_held_now(node):
    """The counts of a resolved plan are those of the query now: the superseded version it
    counted and the agent forgot since is not counted (the plan's own counts still held it)."""
    old = note(ALICE, "the ferry to kelp island leaves at noon", 1)
    new = note(ALICE, "the ferry to kelp island leaves at one", 2, related={"previous_version": did(old)})
    await node.ingest([old, new])
    plan = await node.recall_plan("when does the ferry to kelp island leave", max_tokens=4000, max_bytes=16000)
    assert plan["receipt"]["x"] == [1, 0, 0, 0] and plan["receipt"]["n"] == [1, 1]
    assert (await node.forget(did=did(old)))["forgotten"] == 1
    resolved = await node.recall_resolve(plan["plan"])
    assert resolved.envelope["x"] == [0, 0, 0, 0] and [i["id"] for i in resolved.envelope["items"]] == [short_id(did(new))]
    now = await node.recall("when does the ferry to kelp island leave", max_tokens=4000, max_bytes=16000)
    assert resolved.envelope_json == now.envelope_json
