"""The container index on request (hmpnode.net.index; docs/protocol.md 31), sans-IO.

Selections (spec 12.9.2 and hmpnode's members), the entry of a container (spec 5.1),
the page (scope through the session's own `may_receive`, limits, cursor), the version
edges read out of a peer's untrusted entries, the merge of mesh-wide versions; then two
`PeerSession`s back to back: request, answer, budget, declines, answers that are not offers.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmpnode.container.backlinks import build_referenced_by
from hmpnode.container.build import build_container
from hmpnode.container.encoding import format_time
from hmpnode.container.evaluations import build_evaluation, evaluations_block
from hmpnode.net import index as IX
from hmpnode.net import mce as M
from hmpnode.net import session as SE
from hmpnode.node import merge_versions
from tests.test_session import MONO, ask, feed, make, mce, sent

NONCES = (f"n{i}" for i in itertools.count())


def made(identity, now, text="x", **kw) -> dict:
    return build_container(identity, "note", {"text": text}, now=now, **kw)["hmp_container"]


def rows_of(*containers) -> list[SimpleNamespace]:
    return [SimpleNamespace(seq=i + 1, did=c["head"]["container_did"], hmp_container=c)
            for i, c in enumerate(containers)]


def query(*selections, **kw) -> IX.IndexQuery:
    return IX.parse_query(IX.request_payload(list(selections), **kw))


# -- selections ----------------------------------------------------------------------------------


def test_selection_fields_are_and_ed_and_selections_or_ed(alice, bob, now):
    goal = build_container(alice, "goal", {"title": "t"}, now=now, subclass="research", tags=["a", "b"])["hmp_container"]
    other = made(bob, now + timedelta(hours=2), tags=["a"])
    assert query({"class": "goal"}).matches(goal) and not query({"class": "goal"}).matches(other)
    assert query({"subclass": "research"}).matches(goal) and not query({"subclass": "other"}).matches(goal)
    assert query({"tags": ["a", "b"]}).matches(goal) and not query({"tags": ["a", "b"]}).matches(other)  # all tags
    assert query({"sender_did": bob.did}).matches(other) and not query({"sender_did": [bob.did]}).matches(goal)
    window = {"timestamp_begin": format_time(now), "timestamp_end": format_time(now + timedelta(hours=1))}
    assert query(window).matches(goal) and not query(window).matches(other)
    assert query({"timestamp_begin": None, "timestamp_end": None}).matches(other)
    assert not query({"class": "goal", "sender_did": bob.did}).matches(goal)  # AND within one selection
    both = query({"class": "goal"}, {"sender_did": bob.did})  # OR across selections
    assert both.matches(goal) and both.matches(other)
    assert query().matches(goal)  # no selection: everything (12.9.1)


def test_related_selection_by_target_and_relation(alice, now):
    v1 = made(alice, now, "v1")
    v1_did = v1["head"]["container_did"]
    v2 = made(alice, now, "v2", related={"previous_version": v1_did})
    reply = made(alice, now, "r", related={"in_reply_to": [v1_did, "did:hmp:container:zz"]})
    versions = query({"related_to": v1_did, "relation": "previous_version"})
    assert versions.matches(v2) and not versions.matches(reply) and not versions.matches(v1)
    assert query({"related_to": [v1_did]}).matches(reply)  # any relation
    assert query({"relation": "in_reply_to"}).matches(reply) and not query({"relation": "in_reply_to"}).matches(v2)


@pytest.mark.parametrize("selection, error", [
    ({"class": 5}, "class"),  # (the class schema refuses it before: bad_mce)
    ({"tags": []}, "tags"),
    ({"tags": ["x"] * (IX.MAX_LIST + 1)}, "tags"),
    ({"sender_did": "bob"}, "sender_did"),
    ({"related_to": ["did:x", 1]}, "related_to"),
    ({"timestamp_begin": "yesterday"}, "timestamp_begin"),
    ({"relation": ""}, "relation"),
    ("goal", "object"),
])
def test_unreadable_selections_are_refused_with_the_member_named(selection, error):
    with pytest.raises(IX.SelectionError, match=error):
        IX.parse_query({"request_container_selection": [selection]})


def test_request_bounds_and_extensions():
    with pytest.raises(IX.SelectionError):
        IX.parse_query({"request_container_selection": [{}] * (IX.MAX_SELECTIONS + 1)})
    for bad in ({"index_after": "-1"}, {"index_after": 7}, {"index_limit": 0}, {"index_limit": True}):
        with pytest.raises(IX.SelectionError):
            IX.parse_query(bad)
    q = IX.parse_query({"request_container_selection": {"class": "goal", "mood": "x"}, "index_after": "41",
                        "index_limit": 3})
    assert (q.after, q.limit, q.ignored) == (41, 3, ["mood"])  # a single object is read as a list of one
    assert IX.is_index_request({}) and IX.is_index_request({"request_container_selection": []})
    assert not IX.is_index_request({"request_container": ["did:x"]}) and not IX.is_index_request({"after": ""})


def test_prefilter_only_for_a_single_selection(now):
    q = query({"class": "goal", "tags": ["a", "b"], "sender_did": "did:s", "related_to": "did:r",
               "timestamp_begin": format_time(now)})
    assert q.prefilter() == {"class_": "goal", "tag": "a", "sender": "did:s", "related_to": "did:r", "since": now}
    assert query({"sender_did": ["did:a", "did:b"]}).prefilter() == {}  # several values: OR, filtered after the read
    assert query({"class": "a"}, {"class": "b"}).prefilter() == {}


# -- entries ---------------------------------------------------------------------------------------


def test_entry_carries_the_spec_fields_and_stays_a_superset_of_todays(alice, bob, now):
    meta = {"created_by": "AGENT", "agents_class": "Knowledge Genome", "sources": ["secret"], "interpretation": "x",
            "abstraction": {"agents_class": "KG", "path": {"L1": "did:hmp:container:a1", "L2": 7}},
            "axes": {"did:hmp:container:ax": 512, "label": 3, "did:hmp:container:ay": "high"}}
    hmp = build_container(alice, "goal", {"title": "t"}, now=now, subclass="plan", tags=["t1"], meta=meta,
                          related={"depends_on": ["did:hmp:container:g1"], "in_reply_to": "did:hmp:container:m"}
                          )["hmp_container"]
    old = M.index_entry(hmp)
    entry = IX.entry_of(hmp)
    assert {k: entry["head"][k] for k in old["head"]} == old["head"]  # what peers read today, unchanged
    assert entry["head"]["timestamp"] == hmp["head"]["timestamp"] and entry["head"]["subclass"] == "plan"
    assert entry["meta"] == {"created_by": "AGENT", "agents_class": "Knowledge Genome",
                             "abstraction": {"agents_class": "KG", "path": {"L1": "did:hmp:container:a1"}},
                             "axes": {"did:hmp:container:ax": 512}}  # spec 5.1 item 4: no sources/interpretation
    assert entry["related"] == hmp["related"]  # every relation field
    assert "referenced-by_hash" not in entry and "evaluations_hash" not in entry  # no blocks: no hashes
    did = hmp["head"]["container_did"]
    links = [("in_reply_to", "did:hmp:container:z2"), ("depends_on", "did:hmp:container:z1")]
    items = [build_evaluation(bob, type="accuracy", value=0.5, target=did, now=now)]
    full = IX.entry_of(hmp, links, items)
    assert full["referenced-by_hash"] == build_referenced_by([{"type": r, "target": t} for r, t in links],
                                                             alice)["referenced-by_hash"]
    assert full["evaluations_hash"] == evaluations_block(items)["evaluations_hash"]


# -- pages: scope, limits, cursor -------------------------------------------------------------------


def test_page_holds_only_what_the_peer_may_be_sent(alice, bob, carol, now):
    """The same check gossip makes (`PeerSession.may_receive`): bob's session, over loopback."""
    session = make(alice, bob)
    visible = [made(alice, now, "b", broadcast=True), made(alice, now, "to bob", recipients=[bob.did])]
    hidden = [made(alice, now, "to carol", recipients=[carol.did]),  # someone else's
              made(alice, now, "private"),  # neither broadcast nor recipients
              made(alice, now, "lan", broadcast=True, network="lan:10.99.0.0/16"),  # out of scope for loopback
              made(alice, now - timedelta(hours=2), "old", broadcast=True, ttl=now - timedelta(hours=1))]  # expired
    rows = rows_of(*hidden[:2], visible[0], *hidden[2:], visible[1])
    p = IX.page(rows, query(), eligible=lambda r: session.may_receive(r.hmp_container["head"], now),
                entry=lambda r: IX.entry_of(r.hmp_container), limit=100, max_bytes=1 << 20, more=lambda: False)
    assert list(p.entries) == [c["head"]["container_did"] for c in visible]
    assert (p.cursor, p.complete) == (6, True)


def test_pages_follow_the_cursor_to_the_end(alice, now):
    rows = rows_of(*[made(alice, now, str(i), broadcast=True, tags=["even" if i % 2 == 0 else "odd"])
                     for i in range(10)])
    got, after, pages = [], 0, 0
    while True:
        q = query({"tags": ["even"]}, after=str(after) if after else None)
        p = IX.page([r for r in rows if r.seq > q.after], q, eligible=lambda r: True,
                    entry=lambda r: IX.entry_of(r.hmp_container), limit=2, max_bytes=1 << 20, more=lambda: False)
        got += list(p.entries)
        after, pages = p.cursor, pages + 1
        if p.complete:
            break
        assert pages < 10
    assert got == [r.did for r in rows if r.seq % 2 == 1] and pages == 3  # 2 + 2 + 1, each once


def test_page_bounds_bytes_and_says_when_the_read_was_cut(alice, now):
    rows = rows_of(*[made(alice, now, f"{i}" * 50, broadcast=True) for i in range(5)])
    one = len(str(IX.entry_of(rows[0].hmp_container)))
    p = IX.page(rows, query(), eligible=lambda r: True, entry=lambda r: IX.entry_of(r.hmp_container),
                limit=100, max_bytes=one * 2, more=lambda: False)
    assert 1 <= len(p.entries) < 5 and not p.complete and p.cursor == len(p.entries)
    p = IX.page(rows, query(), eligible=lambda r: True, entry=lambda r: IX.entry_of(r.hmp_container),
                limit=100, max_bytes=1 << 20, more=lambda: True)
    assert len(p.entries) == 5 and not p.complete and p.cursor == 5  # more rows may follow the read


# -- versions -----------------------------------------------------------------------------------------


def test_version_edges_skip_what_is_malformed():
    entries = {
        "did:c:1": {"head": {"sender_did": "did:a"}, "related": {"previous_version": "did:p"}},
        "did:c:2": {"head": {"sender_did": "did:b"}, "related": {"previous_version": ["did:q", "did:p"]}},
        "did:c:3": {"head": {"sender_did": "did:b"}, "related": {"previous_version": "did:elsewhere"}},
        "did:c:4": {"head": "junk", "related": {"previous_version": "did:p"}},
        "did:c:5": {"head": {"sender_did": 5}, "related": {"previous_version": "did:p"}},
        "did:c:6": {"head": {"sender_did": "did:b"}, "related": "junk"},
        "did:c:7": ["junk"],
        "junk": {"head": {"sender_did": "did:b"}, "related": {"previous_version": "did:p"}},
    }
    assert IX.version_edges(entries, ["did:p", "did:q"]) == [
        ("did:c:1", "did:p", "did:a"), ("did:c:2", "did:p", "did:b"), ("did:c:2", "did:q", "did:b")]


def test_merge_marks_local_and_remote_versions():
    local = [("did:v2", "did:v1", "did:a")]
    remote = {("did:v3", "did:v2"): ("did:a", {"did:peer:b", "did:peer:c"}),
              ("did:v2", "did:v1"): ("did:a", {"did:peer:b"})}
    out = merge_versions("did:v1", "did:a", local, remote, asked={"did:peer:b", "did:peer:c"},
                         answered={"did:peer:b"}, complete=False)
    assert out["descendants"] == [
        {"did": "did:v2", "parent": "did:v1", "sender": "did:a", "local": True, "peers": ["did:peer:b"]},
        {"did": "did:v3", "parent": "did:v2", "sender": "did:a", "local": False,
         "peers": ["did:peer:b", "did:peer:c"]}]
    assert out["latest"] == ["did:v3"] and out["complete"] is False
    assert out["mesh"] == {"asked": ["did:peer:b", "did:peer:c"], "answered": ["did:peer:b"]}


# -- two sessions back to back --------------------------------------------------------------------------


def relay(src, dst, now, mono=MONO) -> list:
    """Every frame `src` queued, fed to `dst`: the events."""
    events = []
    for data in src.data_to_send():
        events += feed(dst, data, now, mono)
    return events


def test_request_answer_round_trip_is_not_an_offer(alice, bob, now):
    asker, holder = make(alice, bob), make(bob, alice)
    request = asker.ask_index([{"class": "note"}], now, limit=10, nonce=next(NONCES))
    [event] = relay(asker, holder, now)
    assert isinstance(event, SE.IndexRequested) and event.request == request and event.refusal is None
    assert holder.index_limit(event.query) == 10
    entries = {made(bob, now, str(i))["head"]["container_did"]: IX.entry_of(made(bob, now, str(i)))
               for i in range(3)}
    holder.answer_index(event.request, IX.Page(entries, 17, False), now)
    got = relay(holder, asker, now)
    assert [type(e) for e in got] == [SE.IndexEntries, SE.IndexDone]  # no Offered: nothing is fetched
    assert got[0].entries == entries and got[0].request == request
    assert (got[1].status, got[1].cursor, got[1].complete) == ("processed", "17", False)
    assert asker.index_asks == {}
    assert asker.counters["index_entries_received"] == 3 and holder.counters["index_entries_sent"] == 3


def test_an_answer_takes_no_more_entries_than_asked(alice, bob, now):
    asker = make(alice, bob)
    request = asker.ask_index([], now, limit=2, nonce=next(NONCES))
    asker.data_to_send()
    good = {c["head"]["container_did"]: IX.entry_of(c) for c in (made(bob, now, str(i)) for i in range(3))}
    data = M.frame("mce", container=M.build_mce(bob, "container_index", good, peer_did=alice.did, now=now,
                                                in_reply_to=request))
    [event] = feed(asker, data, now)
    assert list(event.entries) == list(good)[:2] and asker.counters["index_entries_dropped"] == 1


def test_an_index_naming_no_request_of_ours_is_ignored_and_a_plain_one_still_offers(alice, bob, now):
    asker = make(alice, bob)
    c = made(bob, now)
    entries = {c["head"]["container_did"]: IX.entry_of(c)}
    stray = M.frame("mce", container=M.build_mce(bob, "container_index", entries, peer_did=alice.did, now=now,
                                                 in_reply_to="did:hmp:container:never"))
    assert feed(asker, stray, now) == [] and asker.counters["index_unsolicited"] == 1
    [offer] = feed(asker, mce(bob, alice, "container_index", entries, now), now)  # 5.4 publication, as before
    assert isinstance(offer, SE.Offered) and offer.dids == list(entries)


def test_index_requests_over_the_budget_are_declined_not_struck(alice, bob, now):
    asker, holder = make(alice, bob), make(bob, alice, index_requests_per_minute=2.0)
    outcomes = []
    for _ in range(3):
        asker.ask_index([], now, nonce=next(NONCES))
        outcomes += relay(asker, holder, now)
    assert [e.refusal for e in outcomes] == [None, None, "rate_limited"]
    [done] = relay(holder, asker, now)  # only the decline was answered here (the others wait for the store)
    assert (done.status, done.reason, done.complete) == ("declined", "rate_limited", False)
    assert not any(k.startswith("strike_") for k in holder.counters)
    asker.ask_index([], now, nonce=next(NONCES))
    [later] = relay(asker, holder, now, MONO + 30.0)  # refilled: 2 a minute
    assert later.refusal is None


def test_an_unreadable_selection_is_declined_and_named(alice, bob, now):
    holder = make(bob, alice)
    selection = {"request_container_selection": [{"related_to": "v1"}]}  # ours: not a DID
    [event] = feed(holder, mce(alice, bob, "container_request", selection, now), now)
    assert event.refusal == "bad_selection"
    [answer] = sent(holder)
    assert answer["class"] == "container_response"
    assert answer["payload"]["selection_status"] == "declined" and "related_to" in answer["payload"]["detail"]
    assert not any(k.startswith("strike_") for k in holder.counters)


def test_empty_request_and_union_with_listed_containers(alice, bob, now):
    holder = make(bob, alice)
    [event] = feed(holder, mce(alice, bob, "container_request", {}, now), now)  # spec 12.9.1
    assert isinstance(event, SE.IndexRequested) and event.query.selections == ()
    both = {"request_container": ["did:hmp:container:x"], "request_container_selection": [{"class": "goal"}]}
    kinds = [type(e) for e in feed(holder, mce(alice, bob, "container_request", both, now), now)]
    assert kinds == [SE.IndexRequested, SE.Requested]  # 12.9.2: the union


def test_asks_waiting_are_bounded(alice, bob, now):
    asker = make(alice, bob)
    first = asker.ask_index([], now, nonce=next(NONCES))
    for _ in range(SE.MAX_INDEX_ASKS):
        asker.ask_index([], now, nonce=next(NONCES))
    assert len(asker.index_asks) == SE.MAX_INDEX_ASKS and first not in asker.index_asks


def test_equal_requests_in_one_second_are_two_messages(alice, bob, now):
    """MCE messages are content-addressed: without the nonce the second would be refused as replayed."""
    asker, holder = make(alice, bob), make(bob, alice)
    first, second = asker.ask_index([], now, nonce="a"), asker.ask_index([], now, nonce="b")
    assert first != second
    assert [e.request for e in relay(asker, holder, now)] == [first, second]


def test_answers_pass_the_peers_class_schema_whatever_the_container_holds(alice, bob, now):
    """An entry that broke the container_index schema would make the peer refuse the whole
    answer (bad_mce, a strike against us): odd meta is trimmed, a head without public_key left out."""
    meta = {"created_by": "x" * 5000, "agents_class": "KG", "abstraction": {"path": {"L1": "did:" + "x" * 2000}},
            "axes": {"did:hmp:container:ax": True, "did:hmp:container:ay": 1.5}}
    odd = build_container(bob, "note", {"text": "t"}, now=now, meta=meta, tags=["t" * 256])["hmp_container"]
    keyless = build_container(bob, "note", {"text": "k"}, now=now, include_public_key=False)["hmp_container"]
    assert IX.entry_of(keyless) is None
    rows = rows_of(odd, keyless)
    p = IX.page(rows, query(), eligible=lambda r: True, entry=lambda r: IX.entry_of(r.hmp_container),
                limit=10, max_bytes=1 << 20, more=lambda: False)
    assert list(p.entries) == [rows[0].did] and p.cursor == 2
    assert p.entries[rows[0].did]["meta"] == {"agents_class": "KG", "axes": {"did:hmp:container:ay": 1.5}}
    asker, holder = make(alice, bob), make(bob, alice)
    request = asker.ask_index([], now, nonce="s")
    relay(asker, holder, now)
    holder.answer_index(request, p, now)
    entries, done = relay(holder, asker, now)  # check_mce runs the class schemas: no bad_mce
    assert list(entries.entries) == [rows[0].did] and done.complete


def test_a_stray_index_response_leaves_outstanding_requests_alone(alice, bob, now):
    """A `container_response` naming a request we are not waiting for (late, forgotten) is
    ignored: read as a plain response, its empty `available` would cancel every container
    we asked this peer for."""
    asker = make(alice, bob)
    wanted = [made(bob, now, str(i))["head"]["container_did"] for i in range(3)]
    ask(asker, wanted, set(), now)
    asker.data_to_send()
    stray = M.frame("mce", container=M.build_mce(bob, "container_response", {
        "available": [], "selection_status": "processed", "index_cursor": "9", "complete": True},
        peer_did=alice.did, now=now, in_reply_to="did:hmp:container:late"))
    assert feed(asker, stray, now) == [] and asker.counters["index_unsolicited"] == 1
    assert all(d in asker.requested for d in wanted) and len(asker.requested) == 3


_POOL: list[dict] = []


def _pool(alice, carol, now) -> list[dict]:
    """40 containers (built once: signing is the slow part): classes, tags, audiences mixed."""
    if not _POOL:
        for i in range(40):
            kw = {"broadcast": True} if i % 5 else {"recipients": [carol.did]}
            _POOL.append(build_container(alice, "goal" if i % 3 == 0 else "note",
                                         {"title": str(i)} if i % 3 == 0 else {"text": str(i)}, now=now,
                                         tags=["even"] if i % 2 == 0 else ["odd"], **kw)["hmp_container"])
    return _POOL


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 39), unique=True, max_size=40),
       selections=st.lists(st.fixed_dictionaries({}, optional={"class": st.sampled_from(["goal", "note"]),
                                                                  "tags": st.just(["even"])}), max_size=3),
       limit=st.integers(1, 7), chunk=st.integers(1, 9))
def test_pages_cover_exactly_what_matches_and_may_be_sent(alice, bob, carol, now, picks, selections, limit, chunk):
    """Whatever the rows, selections, page size and the size of each read: following the
    cursor lists every matching row the peer may be sent once, and nothing else."""
    session = make(alice, bob)
    rows = rows_of(*[_pool(alice, carol, now)[i] for i in picks])
    eligible = lambda r: session.may_receive(r.hmp_container["head"], now)  # noqa: E731
    q0 = query(*selections)
    expected = [r.did for r in rows if q0.matches(r.hmp_container) and eligible(r)]
    got, after = [], 0
    for _ in range(len(rows) + 2):
        q = query(*selections, after=str(after) if after else None)
        rest = [r for r in rows if r.seq > q.after]
        read = rest[:chunk]  # a read bounded like index_scan: more may follow it
        p = IX.page(read, q, eligible=eligible, entry=lambda r: IX.entry_of(r.hmp_container), limit=limit,
                    max_bytes=1 << 20, more=lambda read=read, rest=rest: len(read) < len(rest))
        assert len(p.entries) <= limit
        got += list(p.entries)
        after = p.cursor
        if p.complete:
            break
    else:
        raise AssertionError("the pages never completed")
    assert got == expected
