"""Interests (docs/protocol.md 33): the pure matcher, the peer_query a session sends and
takes (budget, bad input), and the forwarding filter of `plan_forward`."""

from __future__ import annotations

import random

import pytest

from hmpnode.container.build import build_container
from hmpnode.net import session as SE
from hmpnode.net.interests import ALWAYS, InterestError, InterestLimits, Interests, topic_changes
from tests.test_session import did_of, feed, make, mce, note, refused, sent

ME = "did:hmp:agent:someone"


def head(class_="note", tags=(), sender=ME, broadcast=True):
    h = {"class": class_, "sender_did": sender, "tags": list(tags) if isinstance(tags, tuple) else tags}
    if broadcast:
        h["broadcast"] = True
    return h


# -- the matcher ---------------------------------------------------------------------------------


def test_nothing_declared_and_everything_mode_match_everything():
    for i in (Interests(), Interests("everything", tags=("x",))):
        assert i.everything and i.matches(head(tags=["y"])) and i.matches(head(class_="goal"))
    assert not Interests().declared and Interests("everything").declared


def test_a_container_matches_when_any_declared_entry_does():
    i = Interests(classes=("goal",), tags=("x",), senders=("did:hmp:agent:bob",), topics=("ethics",))
    assert i.declared and not i.everything
    assert i.matches(head(tags=["x", "z"]))
    assert i.matches(head(tags=["ethics"]))  # a topic is a tag that is also in the DHT
    assert i.matches(head(class_="goal"))
    assert i.matches(head(sender="did:hmp:agent:bob"))
    assert not i.matches(head(tags=["y"]))
    assert not i.matches(head(tags=[]))
    assert not i.matches(head(tags="x"))  # not a list: nothing to match
    assert not i.matches(head(tags=[["x"]]))
    assert not i.matches("not a head")


def test_peer_announce_always_matches():
    assert "peer_announce" in ALWAYS
    assert Interests(tags=("x",)).matches(head(class_="peer_announce"))


def test_an_index_entry_head_matches_like_the_container_head(alice, now):
    from hmpnode.net import mce as M

    c = note(alice, now, broadcast=True, tags=["x"])
    entry = M.index_entry(c["hmp_container"])["head"]
    assert Interests(tags=("x",)).matches(entry) and not Interests(tags=("y",)).matches(entry)
    assert Interests(senders=(alice.did,)).matches(entry)


@pytest.mark.parametrize("obj, field", [
    ({"tags": "x"}, "tags"),
    ({"tags": [""]}, "tags"),
    ({"tags": ["x" * 129]}, "tags"),
    ({"tags": ["a\nb"]}, "tags"),
    ({"tags": [1]}, "tags"),
    ({"senders": ["bob"]}, "senders"),
    ({"mode": "some"}, "mode"),
    ({"colour": ["x"]}, "colour"),
    ({"classes": [f"c{i}" for i in range(5)]}, "classes"),
])
def test_bad_declarations_are_refused_with_the_field(obj, field):
    with pytest.raises(InterestError) as excinfo:
        Interests.parse(obj, InterestLimits(max_entries=4))
    assert excinfo.value.field == field


def test_parse_drops_repeats_and_round_trips():
    i = Interests.parse({"tags": ["x", "x", "y"], "topics": ["t"]})
    assert i.tags == ("x", "y")
    assert Interests.parse(i.to_dict()) == i


def test_the_peer_query_payload_maps_to_the_spec_members_and_back():
    i = Interests(classes=("goal",), tags=("x",), senders=("did:hmp:agent:bob",), topics=("t",))
    p = i.query_payload(["relay"])
    assert p == {"classes": ["goal"], "interests": ["x"], "senders": ["did:hmp:agent:bob"], "topics": ["t"],
                 "roles": ["relay"], "mode": "selective"}
    assert Interests.from_query(p) == i
    # a spec peer_query (4.8): expertise and roles are no filters
    assert Interests.from_query({"interests": ["ethics"], "expertise": ["nlp"], "roles": ["relay"]}).tags == ("ethics",)
    assert not Interests.from_query({"expertise": ["nlp"]}).declared


def test_topic_changes_keep_the_standing_topics():
    old, new = Interests(topics=("a", "b", "n")), Interests(topics=("b", "c"))
    assert topic_changes(old, new, standing=("n",)) == (["c"], ["a"])
    assert topic_changes(Interests(), Interests(topics=("n",)), standing=("n",)) == ([], [])


# -- peer_query on a session ---------------------------------------------------------------------


def test_a_broadcast_kept_from_a_peer_counts_once_however_often_it_is_found_again(alice, bob, now):
    """Each reconciliation finds again what a filtering peer lacks (33.3): the count is of
    broadcasts withheld on the connection, not of the times one was looked at."""
    s = make(alice, bob)
    feed(s, mce(bob, alice, "peer_query", {"interests": ["x"]}, now), now)
    for _ in range(3):
        assert not s.wants(head(tags=["y"]), "did:y1")
    assert not s.wants(head(tags=["y"]), "did:y2") and s.wants(head(tags=["x"]), "did:x1")
    assert s.withheld == 2 and s.counters["interests_filtered"] == 2


def test_a_peer_query_sets_what_the_peer_is_sent(alice, bob, now):
    s = make(alice, bob)
    assert s.interests is None and s.wants(head(tags=["y"]), "did:y")
    assert feed(s, mce(bob, alice, "peer_query", {"interests": ["x"], "roles": []}, now), now) == []
    assert s.interests == Interests(tags=("x",))
    assert s.wants(head(tags=["x"]), "did:x") and not s.wants(head(tags=["y"]), "did:y")
    assert s.wants(head(tags=["y"], broadcast=False), "did:d")  # directed: delivered whatever it declared
    assert s.counters["interests_filtered"] == 1 and s.counters["peer_queries_received"] == 1
    # a later one replaces it; one that declares nothing means everything again
    feed(s, mce(bob, alice, "peer_query", {"mode": "everything", "topics": ["t"]}, now), now)
    assert s.wants(head(tags=["y"]), "did:y")
    feed(s, mce(bob, alice, "peer_query", {"interests": ["x"]}, now), now)
    feed(s, mce(bob, alice, "peer_query", {}, now), now)
    assert s.interests is None


def test_send_interests_is_a_peer_query_the_other_side_takes(alice, bob, now):
    ours, theirs = make(alice, bob), make(bob, alice)
    declared = Interests(classes=("goal",), tags=("x",), topics=("t",))
    ours.send_interests(declared, ["relay"], now)
    (frame,) = ours.data_to_send()
    assert feed(theirs, frame, now) == []
    assert theirs.interests == declared


def test_peer_queries_beyond_the_budget_are_rate_limited(alice, bob, now):
    s = make(alice, bob, peer_queries_per_minute=2.0)
    for tag in ("w", "x"):
        feed(s, mce(bob, alice, "peer_query", {"interests": [tag]}, now), now)
    err = refused(feed, s, mce(bob, alice, "peer_query", {"interests": ["y"]}, now), now)
    assert err.reason == "rate_limited"
    assert s.interests == Interests(tags=("x",))  # the refused one changed nothing
    feed(s, mce(bob, alice, "peer_query", {"interests": ["z"]}, now), now, mono=1000.0 + 31)  # refilled
    assert s.interests == Interests(tags=("z",))


@pytest.mark.parametrize("payload", [
    {"interests": [f"t{i}" for i in range(5)]},  # over max_interest_entries
    {"interests": ["x" * 200]},  # within the schema (256), over ours (128: a DHT topic key)
    {"senders": ["not-a-did"]},
    {"mode": "all"},
])
def test_bad_peer_queries_are_bad_mce_and_keep_the_old_declaration(alice, bob, now, payload):
    s = make(alice, bob, max_interest_entries=4)
    feed(s, mce(bob, alice, "peer_query", {"interests": ["x"]}, now), now)
    err = refused(feed, s, mce(bob, alice, "peer_query", payload, now), now)
    assert err.reason == "bad_mce" and err.detail.startswith("peer_query:")
    assert s.interests == Interests(tags=("x",))


@pytest.mark.parametrize("payload", [{"interests": ["x" * 300]}, {"topics": "ethics"}, {"roles": [1]}])
def test_a_peer_query_against_its_class_schema_is_bad_mce(alice, bob, now, payload):
    from hmpnode.container.schema import SchemaSet, default_schemas
    from hmpnode.net import mce as M

    s = make(alice, bob)
    lax = SchemaSet(default_schemas().base_schema, {})  # builds what the class schema refuses
    message = build_container(bob, "peer_query", payload, now=now, recipients=[alice.did], schemas=lax)
    err = refused(feed, s, M.frame("mce", container=message), now)
    assert err.reason == "bad_mce"
    assert s.interests is None


# -- forwarding --------------------------------------------------------------------------------


def test_plan_forward_skips_peers_whose_interests_do_not_match(alice, bob, carol, now):
    from hmpnode.identity import Identity

    dave = Identity(bytes([4]) * 32)
    peers = {p.did: make(alice, p) for p in (bob, carol, dave)}
    peers[bob.did].interests = Interests(tags=("x",))
    peers[carol.did].interests = Interests("everything")  # a relay: everything
    peers[dave.did].lazy = True  # announced to, not pushed: filtered alike
    peers[dave.did].interests = Interests(tags=("x",))
    sessions = list(peers.values())
    for fanout in (0, 4):
        x, y = note(alice, now, "x", broadcast=True, tags=["x"]), note(alice, now, "y", broadcast=True, tags=["y"])
        ex, lx = SE.plan_forward(x["hmp_container"]["head"], did_of(x), sessions, origin=None, now=now, fanout=fanout,
                                 rng=random.Random(1))
        ey, ly = SE.plan_forward(y["hmp_container"]["head"], did_of(y), sessions, origin=None, now=now, fanout=fanout,
                                 rng=random.Random(1))
        assert {s.did for s in ex + lx} == {bob.did, carol.did, dave.did}
        assert {s.did for s in ey + ly} == {carol.did}
    # a directed container goes to the peer that serves its recipient whatever it declared
    directed = build_container(alice, "note", {"text": "z"}, now=now, recipients=[bob.did], tags=["y"])
    eager, lazy = SE.plan_forward(directed["hmp_container"]["head"], did_of(directed), sessions, origin=None, now=now,
                                  fanout=1, rng=random.Random(1))
    assert [s.did for s in eager] == [bob.did] and lazy == []


def test_sent_peer_query_lists_roles(alice, bob, now):
    s = make(alice, bob)
    s.send_interests(Interests(tags=("x",)), ("relay",), now)
    (msg,) = sent(s)
    assert msg["class"] == "peer_query" and msg["payload"]["roles"] == ["relay"]
    assert msg["payload"]["interests"] == ["x"]
