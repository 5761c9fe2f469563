"""The sans-IO peer session (hmpnode.net.session): frames in, events and frames out.

No sockets, no store, no event loop: every test feeds frames to `PeerSession`
objects with a fixed clock and reads what they emit and queue. The pair tests
wire two sessions back to back through a small in-memory adapter (a dict as the
store) and run whole exchanges: push/ack, announce/request, reconciliation to
convergence (edge cases, 1 M items, random sets).
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from datetime import timedelta
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmpnode.container.build import build_container
from hmpnode.container.encoding import format_time
from hmpnode.net import mce as M
from hmpnode.net import session as SE
from hmpnode.net import syncset as SY
from hmpnode.net.ledger import Ledger
from hmpnode.net.reconcile import SortedItems
from hmpnode.net.scope import Channel
from hmpnode.net.session import PeerSession, SessionLimits
from hmpnode.net.transport import TransportError

MONO = 1000.0
HASH = "sha256:" + "ab" * 32


def make(me, peer, *, roles=(), initiator=False, check=None, sign=None, **limits) -> PeerSession:
    return PeerSession(me, peer.did, "127.0.0.1", Channel.LOOPBACK, peer_roles=tuple(roles), initiator=initiator,
                       limits=SessionLimits(**limits), book=Ledger().open(), counters=Counter(), check=check,
                       sign=sign)


def sent(session: PeerSession) -> list[dict]:
    """The frames a session queued, parsed; MCE frames as (class, payload)."""
    out = []
    for data in session.data_to_send():
        message = orjson.loads(data) if data else {"type": "admitted"}
        if message["type"] == "mce":
            head = message["container"]["hmp_container"]["head"]
            message = {"type": "mce", "class": head["class"], "payload": message["container"]["hmp_container"]["payload"]}
        out.append(message)
    return out


def drive(session: PeerSession, events: list, now, mono: float = MONO) -> list:
    """A driver's part, inline: each Work is run here (no verify thread, no wait) and fed
    back; the other events, in order (the MCE skew samples, which go to the node, left out)."""
    out = []
    for event in events:
        if isinstance(event, SE.Work):
            out += drive(session, session.work_done(event, event.run(), mono, now), now, mono)
        elif not isinstance(event, SE.ClockSample):
            out.append(event)
    return out


def feed(session: PeerSession, data: bytes, now, mono: float = MONO) -> list:
    """One frame in (`frame_received`), its work run inline: the events."""
    return drive(session, session.frame_received(data, mono, now), now, mono)


def ask(session: PeerSession, dids: list[str], settled: set[str], now, mono: float = MONO) -> list[str]:
    """What the adapter does with an `Offered` event, inline: take the offer in one slice,
    run the signing of its requests. The DIDs asked for."""
    missing = session.take_offered(dids, settled, mono)
    work = session.ask(missing, sorted(d for d in dids if d in settled), now)
    if work is not None:
        assert drive(session, [work], now, mono) == []
    return missing


def mce(sender, receiver, class_, payload, now) -> bytes:
    return M.frame("mce", container=M.build_mce(sender, class_, payload, peer_did=receiver.did, now=now))


def note(identity, now, text="x", **kw) -> dict:
    return build_container(identity, "note", {"text": text}, now=now, **kw)


def entry(identity, now) -> dict:
    return M.index_entry(note(identity, now)["hmp_container"])


def did_of(container) -> str:
    return container["hmp_container"]["head"]["container_did"]


def refused(fn, *args, **kw) -> SE.Refused:
    """The refusal that ends the events of `fn(*args, **kw)` (a `feed`, say)."""
    events = fn(*args, **kw)
    assert events and isinstance(events[-1], SE.Refused), events
    return events[-1]


# -- containers frames -----------------------------------------------------------------------


def test_containers_frame_is_an_event_with_per_item_dids(alice, bob, now):
    s = make(alice, bob)
    c = note(bob, now, broadcast=True)
    [event] = feed(s, M.frame("containers", items=[c, "junk", {"hmp_container": {"head": {"container_did": 5}}}]), now)
    assert isinstance(event, SE.ContainersReceived)
    assert event.dids == [did_of(c), None, None]
    assert s.received == 3
    assert sent(s) == []  # nothing answered before the node's verdicts


def test_containers_budget_is_rate_limited(alice, bob, now):
    s = make(alice, bob, containers_per_second=1.0, container_burst=3.0)
    items = [note(bob, now, str(i)) for i in range(2)]
    feed(s, M.frame("containers", items=items), now)
    err = refused(feed, s, M.frame("containers", items=items), now)
    assert err.reason == "rate_limited"
    feed(s, M.frame("containers", items=items), now, MONO + 1.0)  # refilled


def test_frames_budget(alice, bob, now):
    s = make(alice, bob, frames_per_second=1.0, frame_burst=2.0)
    frame = M.error_frame("rate_limited", "x")
    assert [type(e) for _ in range(3) for e in feed(s, frame, now)] == [SE.PeerError, SE.PeerError, SE.Refused]
    assert sent(s) == [{"type": "error", "reason": "rate_limited", "detail": "too many frames"}]
    assert [type(e) for e in feed(s, frame, now, MONO + 1.0)] == [SE.PeerError]


def _result(status, did=None, seq=None, reason=None):
    return SimpleNamespace(status=status, did=did, seq=seq, reason=reason, detail="why")


def test_ingested_answers_with_ack_reject_and_duplicate(alice, bob, now):
    s = make(alice, bob)
    new, dup, bad = note(bob, now, "a", broadcast=True), note(bob, now, "b", broadcast=True), note(bob, now, "c")
    [event] = feed(s, M.frame("containers", items=[new, dup, bad, "junk"]), now)
    done = s.ingested(event, {0: _result("stored", did_of(new), 7), 1: _result("duplicate", did_of(dup)),
                              2: _result("rejected", reason="bad_signature")},
                      [{"container_did": "", "reason": "malformed", "detail": "x"}], MONO, now)
    assert done.acknowledged == [did_of(new), did_of(dup)] and done.stored == [(0, 7)] and done.refused is None
    assert done.for_us == []  # broadcasts: no relay holds them for us
    [ack] = sent(s)
    assert ack["class"] == "container_ack"
    assert ack["payload"]["acknowledged"] == [did_of(new), did_of(dup)]
    assert ack["payload"]["duplicate"] == [did_of(dup)]  # pushed to us although we held it
    assert [r["container_did"] for r in ack["payload"]["rejected"]] == [did_of(bad)]  # not the DID-less one
    assert s.useful == 1 and did_of(bad) in s.known and did_of(bad) in s.got
    assert s.strikes.by_reason == {"rejected_container": 2}  # bad_signature and malformed are offences


def test_asked_duplicate_is_not_reported_as_a_push(alice, bob, now):
    s = make(alice, bob)
    c = note(bob, now, broadcast=True)
    s.requested.claim([did_of(c)], MONO, MONO + 10)
    [event] = feed(s, M.frame("containers", items=[c]), now)
    s.ingested(event, {0: _result("duplicate", did_of(c))}, [], MONO, now)
    assert "duplicate" not in sent(s)[0]["payload"]
    assert did_of(c) not in s.requested


def test_invalid_containers_strike_out(alice, bob, now):
    s = make(alice, bob, strike_threshold=3)
    items = [note(bob, now, str(i)) for i in range(3)]
    [event] = feed(s, M.frame("containers", items=items), now)
    done = s.ingested(event, {i: _result("rejected", reason="bad_signature") for i in range(3)}, [], MONO, now)
    assert done.refused == SE.Refused("rejected_container", "too many invalid containers", True)
    assert sent(s)[-1] == {"type": "error", "reason": "banned", "detail": "too many invalid containers"}
    assert s.closed and s.close_reason == "banned"
    assert feed(s, M.frame("containers", items=items), now) == [] and sent(s) == []  # closed: input ignored


def test_refusals_that_are_not_offences_earn_no_strike(alice, bob, now):
    s = make(alice, bob, strike_threshold=1)
    c = note(bob, now)
    [event] = feed(s, M.frame("containers", items=[c]), now)
    done = s.ingested(event, {}, [{"container_did": did_of(c), "reason": "expired", "detail": ""}], MONO, now)
    assert done.refused is None and not s.strikes.by_reason


# -- sending containers ----------------------------------------------------------------------------


def test_select_push_each_container_once_per_connection(alice, bob):
    s = make(alice, bob)
    assert s.select_push(["did:a", "did:b", "did:a"]) == ["did:a", "did:b"]
    assert s.select_push(["did:a", "did:c"]) == ["did:c"]  # it has a and b now
    assert s.select_push(["did:a"], asked=True) == []  # asked, but carried already: on its way
    s.known.add("did:d")
    assert s.select_push(["did:d"]) == [] and s.select_push(["did:d"], asked=True) == ["did:d"]


def test_send_containers_batches_within_items_and_bytes(alice, bob, now):
    items = [note(bob, now, "t" * 200 + str(i)) for i in range(10)]
    size = len(orjson.dumps(items[0]))
    s = make(alice, bob, max_items_per_frame=4)
    assert s.send_containers(items, MONO) == 10
    assert [len(f["items"]) for f in sent(s)] == [4, 4, 2]
    s = make(alice, bob, max_frame_bytes=2 * (3 * size + 10))  # half a frame: three items
    s.send_containers(items, MONO)
    frames = sent(s)
    assert [len(f["items"]) for f in frames] == [3, 3, 3, 1] and s.sent == 10
    assert [i for f in frames for i in f["items"]] == items
    assert s.send_containers([], MONO) == 0 and sent(s) == []


def test_send_containers_respects_the_decompressed_budget(alice, bob, now):
    from hmpnode.container.inflight import decompressed_cost

    items = [build_container(bob, "note", {"text": "a" * 100_000 + str(i)}, now=now, compression="zstd")
             for i in range(3)]
    cost = decompressed_cost(items[0], 1 << 30)
    assert cost > 100_000 and len(orjson.dumps(items[0])) < 10_000  # small on the wire, big once opened
    s = make(alice, bob, max_frame_decompressed_bytes=2 * cost + 10)
    s.send_containers(items, MONO)
    assert [len(f["items"]) for f in sent(s)] == [2, 1]


# -- MCE ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("class_,payload,kind", [
    ("container_request", {"request_container": ["did:hmp:container:a"]}, SE.Requested),
    ("container_delta", {"since": "2026-11-29T10:00:00Z", "added": {"did:hmp:container:a": "ENTRY"}}, SE.Offered),
    ("container_index", {"did:hmp:container:a": "ENTRY"}, SE.Offered),
    ("referenced-by_exchange", {"did:hmp:container:a": {"links": []}}, SE.BlocksReceived),
    ("evaluations_exchange", {"did:hmp:container:a": {"evaluations_hash": HASH, "items": []}}, SE.BlocksReceived),
])
def test_mce_classes_become_events(alice, bob, now, class_, payload, kind):
    s = make(alice, bob)
    payload = orjson.loads(orjson.dumps(payload).replace(b'"ENTRY"', orjson.dumps(entry(bob, now))))
    [event] = feed(s, mce(bob, alice, class_, payload, now), now)
    assert isinstance(event, kind)


def test_container_response_stops_waiting_for_what_is_not_coming(alice, bob, now):
    s = make(alice, bob)
    s.requested.claim(["did:hmp:container:a", "did:hmp:container:b"], MONO, MONO + 10)
    assert feed(s, mce(bob, alice, "container_response", {"available": [
        {"container_did": "did:hmp:container:a", "signature": "c2ln"}]}, now), now) == []
    assert "did:hmp:container:a" in s.requested and "did:hmp:container:b" not in s.requested
    assert s.counters["requests_omitted"] == 1
    # not coming from it: another peer's offer of it is taken up at once (its mark went with it)
    assert s.book.ledger.inflight.get("did:hmp:container:b") == 0


def test_replayed_mce_is_refused(alice, bob, now):
    s = make(alice, bob)
    frame = mce(bob, alice, "container_index", {}, now)
    assert feed(s, frame, now) == []
    assert refused(feed, s, frame, now).reason == "bad_mce"


def test_mce_of_a_class_that_is_not_mce_is_refused(alice, bob, now):
    s = make(alice, bob)
    frame = M.frame("mce", container=build_container(bob, "note", {"text": "x"}, now=now, recipients=[alice.did]))
    err = refused(feed, s, frame, now)
    assert err.reason == "bad_mce" and "not an MCE class" in err.detail


def test_mce_for_another_node_or_from_another_sender_is_refused(alice, bob, carol, now):
    s = make(alice, bob)
    assert refused(feed, s, mce(bob, carol, "container_index", {}, now), now).reason == "bad_mce"
    assert refused(feed, s, mce(carol, alice, "container_index", {}, now), now).reason == "bad_mce"


def test_old_mce_is_clock_skew_and_ends_the_session(alice, bob, now):
    s = make(alice, bob, mce_max_age_seconds=60)
    [skew] = feed(s, mce(bob, alice, "container_index", {}, now - timedelta(seconds=120)), now)
    assert skew == SE.ClockSkew(-120.0)
    [error] = sent(s)
    assert error["reason"] == "clock_skew" and not s.strikes.by_reason  # not an offence (25.4)
    assert s.closed and s.close_reason == "clock_skew"
    assert s.frame_received(mce(bob, alice, "container_index", {}, now), MONO, now) == [] and sent(s) == []


def test_each_verified_mce_gives_a_clock_sample(alice, bob, now):
    s = make(alice, bob)
    [check] = s.frame_received(mce(bob, alice, "container_index", {}, now - timedelta(seconds=3)), MONO, now)
    assert isinstance(check, SE.MceCheck)
    assert s.work_done(check, check.run(), MONO, now) == [SE.ClockSample(-3.0)]


def test_request_after_page_and_lazy_graft(alice, bob, now):
    s = make(alice, bob, delta_page=400)
    [event] = feed(s, mce(bob, alice, "container_request", {"after": "17"}, now), now)
    assert event.after == 17 and event.dids == [] and not event.answer
    assert s.asks.tokens == s.asks.burst - 100  # a page costs a quarter of its containers
    [event] = feed(s, mce(bob, alice, "container_request", {"after": "-1x"}, now), now)
    assert event.after == 0  # not a cursor we gave out: from the beginning
    s.lazy = True
    s.announced.add("did:hmp:container:a")
    [event] = feed(s, mce(bob, alice, "container_request", {"request_container": ["did:hmp:container:a"],
                                                            "request_evaluations": ["did:hmp:container:a"]}, now), now)
    assert event.dids == ["did:hmp:container:a"] and event.answer and event.evaluations == ["did:hmp:container:a"]
    assert not s.lazy and s.counters["grafted"] == 1


def test_requests_beyond_the_ask_budget_are_rate_limited(alice, bob, now):
    s = make(alice, bob, containers_per_second=1.0, container_burst=3.0)
    def ask(k):  # two different messages (an identical one would be a replay)
        return mce(bob, alice, "container_request", {"request_container": [f"did:hmp:container:{k}{i}" for i in range(2)]},
                   now)

    feed(s, ask("a"), now)
    assert refused(feed, s, ask("b"), now).reason == "rate_limited"


def test_blocks_beyond_the_container_budget_are_rate_limited(alice, bob, now):
    s = make(alice, bob, containers_per_second=1.0, container_burst=2.0)
    def blocks(k):
        return mce(bob, alice, "evaluations_exchange",
                   {f"did:hmp:container:{k}{i}": {"evaluations_hash": HASH, "items": []} for i in range(2)}, now)

    feed(s, blocks("a"), now)
    err = refused(feed, s, blocks("b"), now)
    assert err.reason == "rate_limited"


def test_ack_of_what_was_never_given_is_ignored(alice, bob, now):
    s = make(alice, bob)
    assert feed(s, mce(bob, alice, "container_ack", {"acknowledged": ["did:hmp:container:made-up"]}, now), now) == []
    assert s.counters["acks_not_given"] == 1 and "did:hmp:container:made-up" not in s.known


def test_ack_settles_what_was_given_and_handed_over(alice, bob, carol, now):
    s = make(alice, bob, roles=("relay",))
    s.select_push(["did:hmp:container:a"], relay_for=carol.did)
    s.offered.add("did:hmp:container:b")
    [event] = feed(s, mce(bob, alice, "container_ack", {"acknowledged": ["did:hmp:container:a",
                                                                        "did:hmp:container:b"]}, now), now)
    assert event.dids == ["did:hmp:container:a", "did:hmp:container:b"]
    assert sorted(event.pairs) == sorted([("did:hmp:container:a", bob.did), ("did:hmp:container:a", carol.did),
                                          ("did:hmp:container:b", bob.did)])
    assert s.handoffs == {}


def test_ack_duplicate_makes_the_peer_lazy_and_rejection_releases(alice, bob, now):
    s = make(alice, bob)
    s.select_push(["did:hmp:container:a"])
    feed(s, mce(bob, alice, "container_ack", {"acknowledged": [], "duplicate": ["did:hmp:container:a"],
                                              "rejected": [{"container_did": "did:hmp:container:a",
                                                            "reason": "expired", "detail": ""}]}, now), now)
    assert s.lazy and s.counters["pruned"] == 1 and s.counters["peer_rejected_expired"] == 1
    assert s.select_push(["did:hmp:container:a"]) == ["did:hmp:container:a"]  # refused: may go again


def test_offers_over_max_requested_are_too_many_items(alice, bob, now):
    s = make(alice, bob, max_requested=3)
    index = {f"did:hmp:container:{i}": entry(bob, now) for i in range(5)}
    offered, refusal = feed(s, mce(bob, alice, "container_index", index, now), now)
    assert offered.dids == list(index)[:3]
    assert refusal.reason == "too_many_items" and not refusal.cut and s.counters["offers_refused"] == 2
    assert ask(s, offered.dids, {"did:hmp:container:0"}, now, MONO) == ["did:hmp:container:1", "did:hmp:container:2"]
    error, request = sent(s)  # the refusal is answered by the session at once
    assert error["reason"] == "too_many_items" and s.strikes.by_reason == {"too_many_items": 1}
    assert request["payload"]["request_container"] == ["did:hmp:container:1", "did:hmp:container:2"]
    more = {f"did:hmp:container:{i}": entry(bob, now) for i in range(5, 7)}
    offered, refusal = feed(s, mce(bob, alice, "container_index", more, now), now)  # 2 outstanding: room for 1
    assert offered.dids == ["did:hmp:container:5"] and refusal.reason == "too_many_items"
    assert sent(s)[-1]["reason"] == "too_many_items"


def test_ask_confirms_settled_containers_to_a_relay_and_asks_one_peer_at_a_time(alice, bob, carol, now):
    ledger = Ledger()
    s = PeerSession(alice, bob.did, "127.0.0.1", Channel.LOOPBACK, peer_roles=("relay",), limits=SessionLimits(),
                    book=ledger.open(), counters=Counter())
    other = PeerSession(alice, carol.did, "127.0.0.1", Channel.LOOPBACK, limits=SessionLimits(), book=ledger.open(),
                        counters=Counter())
    assert ask(other, ["did:hmp:container:c"], set(), now, MONO) == ["did:hmp:container:c"]
    asked = ask(s, ["did:hmp:container:a", "did:hmp:container:b", "did:hmp:container:c"], {"did:hmp:container:a"},
                  now, MONO)
    assert asked == ["did:hmp:container:b"]  # c is in flight to the other peer
    ack, request = sent(s)
    assert ack["class"] == "container_ack" and ack["payload"] == {"acknowledged": ["did:hmp:container:a"]}
    assert request["payload"]["request_container"] == ["did:hmp:container:b"]
    assert ask(s, ["did:hmp:container:b"], set(), now, MONO) == []  # outstanding already


def test_an_offer_read_after_the_connection_was_replaced_asks_for_nothing(alice, bob, now):
    """The old connection's session still reads what was under way when a new connection
    replaced it (and closed its book). Asking there would put the DIDs in flight with no open
    book to release them (the answer never comes), and the relay's offer on the new connection
    would not be asked for: the relay -> offline recipient stall, its second way."""
    ledger = Ledger()
    s = PeerSession(alice, bob.did, "127.0.0.1", Channel.LOOPBACK, peer_roles=("relay",), limits=SessionLimits(),
                    book=ledger.open(), counters=Counter())
    [offered] = feed(s, mce(bob, alice, "container_delta", {"since": format_time(now), "added": {
        "did:hmp:container:a": entry(bob, now)}}, now), now)
    ledger.close(s.book)
    assert ask(s, offered.dids, set(), now, MONO) == []
    assert sent(s) == [] and len(ledger.inflight) == 0


def test_error_frame_is_a_peer_error(alice, bob, now):
    s = make(alice, bob)
    [event] = feed(s, M.error_frame("rate_limited", "slow down"), now)
    assert event == SE.PeerError("rate_limited", "slow down")
    feed(s, M.frame("error", reason="made-up"), now)
    assert s.counters["peer_error_rate_limited"] == 1 and s.counters["peer_error_other"] == 1


@pytest.mark.parametrize("data,reason", [
    (b"not json", "malformed_frame"), (b"[]", "malformed_frame"), (b'{"type": "other"}', "malformed_frame"),
    (b'{"type": "containers", "items": []}', "malformed_frame"),
    (M.frame("containers", items=[{}] * 5), "too_many_items"),
    (b'{"type": "mce", "container": 1}', "malformed_frame"),
    (M.frame("reconcile", set="global", msg="AA==", want="AA=="), "malformed_frame"),
    (M.frame("nat", op=""), "malformed_frame"), (M.frame("nat", op="x" * 33), "malformed_frame"),
    (b'{"type": "nat"}', "malformed_frame"),
])
def test_malformed_frames(alice, bob, now, data, reason):
    s = make(alice, bob, max_items_per_frame=4)
    assert refused(feed, s, data, now).reason == reason


def test_nat_frames_go_only_between_peers_that_offered_hmp_nat(alice, bob, now):
    """A `nat` frame is an event only on a session whose peer listed hmp-nat/1; from any
    other peer it is malformed (and nothing is sent to it: send_nat refuses)."""
    s = make(alice, bob)
    assert refused(feed, s, M.frame("nat", op="observed", addr="tcp://192.0.2.1:7000"), now).reason == "malformed_frame"
    assert [f["type"] for f in sent(s)] == ["error"]  # the refusal
    assert s.send_nat("observed", addr="tcp://192.0.2.1:7000") is False and sent(s) == []
    s.nat = True
    [event] = feed(s, M.frame("nat", op="observed", addr="tcp://192.0.2.1:7000"), now)
    assert isinstance(event, SE.NatReceived) and event.op == "observed"
    assert event.message["addr"] == "tcp://192.0.2.1:7000"
    assert s.send_nat("observed", addr="tcp://192.0.2.2:1") is True
    assert sent(s) == [{"type": "nat", "op": "observed", "addr": "tcp://192.0.2.2:1"}]


def test_strikes_end_in_the_banned_verdict(alice, bob):
    s = make(alice, bob, strike_threshold=10)  # rate_limited costs 2 strikes
    verdicts = [v for _ in range(5) for v in s.refuse("rate_limited", "x", MONO)]
    assert [v.cut for v in verdicts] == [False] * 4 + [True]
    assert [f["reason"] for f in sent(s)] == ["rate_limited"] * 4 + ["banned"]
    assert s.closed and s.close_reason == "banned" and s.refuse("rate_limited", "x", MONO) == []
    s = make(alice, bob, strike_threshold=10)
    for _ in range(4):
        s.refuse("rate_limited", "x", MONO)
    [later] = s.refuse("malformed_frame", "x", MONO + 1000)
    assert not later.cut and not s.closed  # strikes decay


def test_shapes_the_checks_let_through_are_refused_malformed(alice, bob, now):
    """A message that passed its check but has a shape the session cannot take (here the
    injected checker lets an ack through whose list is a number) is the peer's fault:
    refused malformed_frame by the entry point, never an exception out of it."""
    def check(container, *, peer_did, own_did, now, max_age):
        return M.Mce("container_ack", {"acknowledged": 5}, "did:hmp:container:x", now, None)

    s = PeerSession(alice, bob.did, "127.0.0.1", Channel.LOOPBACK, book=Ledger().open(), counters=Counter(),
                    check=check)
    refusal = refused(feed, s, mce(bob, alice, "container_ack", {"acknowledged": []}, now), now)
    assert (refusal.reason, refusal.detail, refusal.cut) == ("malformed_frame", "cannot handle: TypeError", False)
    assert "iterable" in refusal.cause and sent(s)[-1]["reason"] == "malformed_frame"
    [refusal] = s.fault(KeyError("items"), MONO)  # what the driver's handling of an event raised
    assert refusal.detail == "cannot handle: KeyError" and s.strikes.by_reason == {"malformed_frame": 2}


def test_verification_cpu_debt_delays_frames(alice, bob, now):
    s = make(alice, bob, verify_seconds_per_second=0.5, verify_burst_seconds=1.0)
    assert s.cpu_delay(MONO) == 0
    s.charge_cpu(MONO, 3.0)  # two seconds into debt
    assert 3.9 < s.cpu_delay(MONO) < 4.1
    assert s.cpu_delay(MONO + 4.1) == 0
    s = make(alice, bob, verify_seconds_per_second=0.5, verify_burst_seconds=1.0)
    s.charge_cpu(MONO, 3.0)
    frame = M.error_frame("rate_limited", "x")
    [pause] = s.frame_received(frame, MONO, now)  # counted against the frame budget, then waits
    assert isinstance(pause, SE.Pause) and 3.9 < pause.seconds < 4.1 and s.counters["verify_throttled"] == 1
    [again] = s.work_done(pause, pause.run(), MONO + 1.0, now)  # woken early: still in debt
    assert isinstance(again, SE.Pause) and again.waits == 2
    assert s.work_done(again, None, MONO + 4.2, now) == [SE.PeerError("rate_limited", "x")]


def test_transfer_pace(alice, bob):
    s = make(alice, bob, containers_per_second=100.0, container_burst=400.0)  # pace: 50/s, burst 100
    assert s.pace_delay(MONO, 100) == 0
    assert s.pace_delay(MONO, 50) > 0.9
    assert s.pace_delay(MONO + 1.0, 50) == 0


def test_big_frames_are_parsed_off_the_loop(alice, bob, now):
    s = make(alice, bob, offload_frame_bytes=1000)
    small, big = M.frame("containers", items=[note(bob, now)]), M.frame("containers", items=[note(bob, now)] * 3)
    assert [type(e) for e in s.frame_received(small, MONO, now)] == [SE.ContainersReceived]
    [work] = s.frame_received(big, MONO, now)
    assert isinstance(work, SE.ParseFrame)
    [event] = s.work_done(work, work.run(), MONO, now)
    assert isinstance(event, SE.ContainersReceived) and len(event.items) == 3
    [work] = s.frame_received(b"x" * 2000, MONO, now)
    assert refused(s.work_done, work, work.run(), MONO, now).reason == "malformed_frame"


# -- reconciliation refusals ---------------------------------------------------------------------


class Snap:
    """A snapshot without seqs (the session needs `items` only)."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)


def snapshot(dids, ts_us=1_764_000_000_000_000) -> SY.Snapshot:
    return SY.Snapshot((*SY.item_of(d, ts_us), i + 1) for i, d in enumerate(dids))


def test_reconcile_starts_are_rate_limited(alice, bob, now):
    s = make(bob, alice, sync_per_minute=1.0)
    a = make(alice, bob, initiator=True)
    a.start_sync({"global": snapshot([])}, MONO)
    start = a.data_to_send()[0]
    [event] = feed(s, start, now)
    assert isinstance(event, SE.ReconcileStart)
    err = refused(feed, s, start, now)
    assert err.reason == "rate_limited" and err.sync == "rate_limited"


def test_reconcile_reply_or_msg_to_nothing_is_malformed(alice, bob, now):
    s = make(alice, bob)
    for member in ("reply", "msg"):
        err = refused(feed, s, M.frame("reconcile", set="global", **{member: "AQ=="}), now)
        assert err.reason == "malformed_frame" and "no reconciliation" in err.detail


def test_bad_reconcile_message_ends_that_reconciliation(alice, bob, now):
    s = make(bob, alice)
    [start] = feed(s, M.frame("reconcile", set="global", start=True, msg=SE.b64(b"\x63junk")), now)
    [work] = s.answer_start(start, snapshot(["did:a"]), MONO)
    err = refused(s.work_done, work, work.run(), MONO, now)
    assert err.reason == "bad_reconcile" and err.sync and "global" not in s.recon_in


@pytest.mark.parametrize("blob", [b"", b"\0" * 31, b"\0" * 33, b"\0" * 32 * (SY.MAX_WANT + 1)])
def test_want_out_of_range_is_malformed(alice, bob, now, blob):
    s = make(alice, bob)
    err = refused(feed, s, M.frame("reconcile", set="global", want=SE.b64(blob)), now)
    assert err.reason == "malformed_frame"


def test_want_not_base64_is_malformed_and_in_range_is_an_event(alice, bob, now):
    s = make(alice, bob)
    assert refused(feed, s, M.frame("reconcile", set="global", want="!!"), now).reason == "malformed_frame"
    [event] = feed(s, M.frame("reconcile", set="scoped", want=SE.b64(b"\1" * 64)), now)
    assert event == SE.WantReceived("scoped", [b"\1" * 32, b"\1" * 32], None)


def test_wants_beyond_the_ask_budget_are_rate_limited(alice, bob, now):
    s = make(alice, bob, containers_per_second=1.0, container_burst=3.0)
    feed(s, M.frame("reconcile", set="global", want=SE.b64(b"\1" * 64)), now)
    assert refused(feed, s, M.frame("reconcile", set="global", want=SE.b64(b"\1" * 64)), now).reason == "rate_limited"


def test_idle_answered_reconciliations_expire(alice, bob, now):
    s = make(bob, alice)
    s.recon_in["global"] = (None, None, MONO)
    s.expire_reconciliations(MONO - 1)
    assert "global" in s.recon_in
    s.expire_reconciliations(MONO + 1)
    assert s.recon_in == {}


# -- two sessions back to back ------------------------------------------------------------------------


class Side:
    """A node in memory: its store (DID -> container), the acks it got, and the
    adapter's answers to its session's events."""

    def __init__(self, me, peer, now, *, initiator=False, containers=(), check=None, sign=None, **limits):
        self.session = make(me, peer, initiator=initiator, check=check, sign=sign, **limits)
        self.now = now
        self.store = {did_of(c): c for c in containers}
        self.acked: list[tuple[str, str]] = []
        self.steps = 0

    def snap(self) -> SY.Snapshot:
        self.order = list(self.store)
        return snapshot(self.order)

    def rows(self, snap, ids) -> list[str]:
        seqs = [snap.seq_of(i) for i in ids]
        return [self.order[q - 1] for q in seqs if q is not None]

    def push(self, dids, *, asked=False) -> None:
        chosen = self.session.select_push([d for d in dids if d in self.store], asked=asked)
        self.session.send_containers([self.store[d] for d in chosen], MONO)

    def handle(self, event) -> None:
        s, now = self.session, self.now
        if isinstance(event, SE.ContainersReceived):
            outcomes = {}
            for i, d in enumerate(event.dids):
                outcomes[i] = _result("duplicate" if d in self.store else "stored", d, len(self.store) + 1)
                self.store.setdefault(d, event.items[i])
            s.ingested(event, outcomes, [], MONO, now)
        elif isinstance(event, SE.Offered):
            ask(s, event.dids, {d for d in event.dids if d in self.store}, now, MONO)
        elif isinstance(event, SE.Requested):
            rows = [d for d in event.dids if d in self.store]
            s.answer_request([(d, self.store[d]["hmp_container"]["head"]["signature"]) for d in rows], now)
            self.push(rows, asked=True)
        elif isinstance(event, SE.Acknowledged):
            self.acked += event.pairs
        elif isinstance(event, SE.ReconcileStart):
            for inner in drive(s, s.answer_start(event, self.snap(), MONO), now):
                self.handle(inner)
        elif isinstance(event, SE.ReconcileStep):
            self.steps += 1
            for kind, chunk in event.batches():
                if kind == "want":
                    s.send_want(event.name, chunk)
                else:
                    self.push(self.rows(event.snap, chunk), asked=True)
        elif isinstance(event, SE.WantReceived):
            self.push(self.rows(event.snap, event.ids), asked=True)
        else:
            raise AssertionError(f"unexpected event {event!r}")


def pump(a: Side, b: Side, limit: int = 1000) -> int:
    """Deliver queued frames both ways until both are quiet; the frames moved."""
    moved = 0
    for _ in range(limit):
        out_a, out_b = a.session.data_to_send(), b.session.data_to_send()
        if not out_a and not out_b:
            return moved
        for src, dst, frames in ((a, b, out_a), (b, a, out_b)):
            for data in frames:
                moved += 1
                for event in feed(dst.session, data, dst.now):
                    dst.handle(event)
    raise AssertionError("the sessions did not settle")


def pair(alice, bob, now, a_items=(), b_items=(), **limits) -> tuple[Side, Side]:
    return (Side(alice, bob, now, initiator=True, containers=a_items, **limits),
            Side(bob, alice, now, containers=b_items, **limits))


def test_pair_push_and_ack(alice, bob, now):
    items = [note(alice, now, str(i), broadcast=True) for i in range(5)]
    a, b = pair(alice, bob, now, a_items=items)
    a.push([did_of(c) for c in items])
    pump(a, b)
    assert set(b.store) == set(a.store)
    assert sorted(a.acked) == sorted((did_of(c), bob.did) for c in items)
    a.push([did_of(c) for c in items])  # the connection carried them: never twice
    assert a.session.data_to_send() == []


def test_pair_announce_request_and_duplicate_push_makes_lazy(alice, bob, now):
    items = [note(alice, now, str(i), broadcast=True) for i in range(3)]
    a, b = pair(alice, bob, now, a_items=items, b_items=items[:1])
    assert a.session.announce({did_of(c): M.index_entry(c["hmp_container"]) for c in items[1:]}, now) == 2
    pump(a, b)
    assert set(b.store) == set(a.store) and b.session.requested.__len__() == 0
    assert sorted(d for d, _ in a.acked) == sorted(did_of(c) for c in items[1:])
    a.session.known.discard(did_of(items[0]))
    a.push([did_of(items[0])])  # b held it: its ack says "duplicate", a announces from now on
    pump(a, b)
    assert a.session.lazy


def test_pair_duplicate_push_prunes_both_ends(alice, bob, now):
    """Plumtree prunes a link at both ends: the receiver of a broadcast pushed twice
    announces to that pusher from then on as well (a one-sided prune leaves the eager
    links directed, and under broadcasts from random origins they never form a tree)."""
    item = note(alice, now, "d", broadcast=True)
    a, b = pair(alice, bob, now, a_items=[item], b_items=[item])
    a.push([did_of(item)])
    pump(a, b)
    assert a.session.lazy and b.session.lazy
    assert b.session.counters["pruned_pusher"] == 1


def test_pair_asking_a_lazy_peer_grafts_both_ends(alice, bob, now):
    """What a lazy peer announced reached us by no push: asking for it makes the link
    eager again at our end too (the pusher's end grafts on the request)."""
    items = notes(alice, now, 2, "g")
    a, b = pair(alice, bob, now, a_items=items)
    a.session.lazy = b.session.lazy = True
    a.session.announce({did_of(c): M.index_entry(c["hmp_container"]) for c in items[:1]}, now)
    pump(a, b)
    assert not a.session.lazy and not b.session.lazy
    assert b.session.counters["grafted_asking"] == 1 and a.session.counters["grafted"] == 1
    b.session.lazy = True  # an offer of nothing it lacks grafts nothing
    assert ask(b.session, [did_of(items[0])], {did_of(items[0])}, now) == [] and b.session.lazy


def sync_pair(alice, bob, now, a_items, b_items, **limits):
    a, b = pair(alice, bob, now, a_items, b_items, **limits)
    a.session.start_sync({"global": a.snap()}, MONO)
    frames = pump(a, b)
    return a, b, frames


def notes(identity, now, n, prefix):
    return [note(identity, now, f"{prefix}{i}", broadcast=True) for i in range(n)]


def test_reconciliation_empty_sets(alice, bob, now):
    a, b, frames = sync_pair(alice, bob, now, [], [])
    assert a.store == b.store == {} and a.steps == 0 and frames == 2  # start, reply
    assert a.session.counters["sync_done"] == 1 and a.session.recon_out == {}


def test_reconciliation_identical_sets(alice, bob, now):
    items = notes(alice, now, 50, "s")
    a, b, frames = sync_pair(alice, bob, now, items, items)
    assert a.steps == 0 and frames == 2 and set(a.store) == set(b.store)


@pytest.mark.parametrize("empty", ["initiator", "responder"])
def test_reconciliation_one_side_empty(alice, bob, now, empty):
    items = notes(alice, now, 40, "e")
    a, b, _ = sync_pair(alice, bob, now, [] if empty == "initiator" else items,
                        items if empty == "initiator" else [])
    assert set(a.store) == set(b.store) == {did_of(c) for c in items}


def test_reconciliation_converges_both_ways(alice, bob, now):
    shared, only_a, only_b = notes(alice, now, 200, "s"), notes(alice, now, 7, "a"), notes(bob, now, 9, "b")
    a, b, _ = sync_pair(alice, bob, now, shared + only_a, shared + only_b)
    assert set(a.store) == set(b.store) == {did_of(c) for c in shared + only_a + only_b}
    assert b.session.counters["sync_answered"] >= 1 and a.session.counters["sync_wanted"] == 9


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sets(st.integers(0, 300), max_size=120), st.sets(st.integers(0, 300), max_size=120))
def test_reconciliation_random_sets_converge(alice, bob, now, xs, ys):
    made = {i: f"did:hmp:container:{i:04d}" for i in xs | ys}
    fake = {i: {"hmp_container": {"head": {"container_did": made[i], "signature": "c2ln"}}} for i in made}
    a, b, _ = sync_pair(alice, bob, now, [fake[i] for i in xs], [fake[i] for i in ys])
    assert set(a.store) == set(b.store) == set(made.values())


def test_reconciliation_one_million_items_a_handful_of_differences(alice, bob, now):
    """1 M items each side, 5 only on A and 3 only on B, through the sessions' frames."""
    rng = random.Random(11)
    n = 1_000_000
    ts = array("Q", (1_764_000_000 + k // 4 for k in range(n)))
    ids = [rng.randbytes(32) for _ in range(n)]
    for g in range(0, n, 4):
        ids[g:g + 4] = sorted(ids[g:g + 4])
    only_a, only_b = set(rng.sample(range(n), 5)), set(rng.sample(range(n), 3))
    only_b -= only_a

    def side(skip):
        keep = [k for k in range(n) if k not in skip]
        return Snap(SortedItems.from_sorted(array("Q", (ts[k] for k in keep)), b"".join(ids[k] for k in keep)))

    snap_a, snap_b = side(only_b), side(only_a)
    a, b = make(alice, bob, initiator=True), make(bob, alice)
    a.start_sync({"global": snap_a}, MONO)
    found: list[SE.ReconcileStep] = []
    for _ in range(20):  # rounds
        frames = a.data_to_send()
        if not frames:
            break
        for data in frames:
            for event in feed(b, data, now):
                assert drive(b, b.answer_start(event, snap_b, MONO), now) == []
        for data in b.data_to_send():
            found += feed(a, data, now)
    assert {i for s in found for i in s.have} == {ids[k] for k in only_a}
    assert {i for s in found for i in s.need} == {ids[k] for k in only_b}
    assert a.counters["sync_done"] == 1 and a.counters["sync_round_trips_global"] <= 5
    assert a.counters["sync_bytes_sent"] + b.counters["sync_bytes_sent"] < 16 * 1024


def test_choose_push_eager_and_lazy():
    peers = [SimpleNamespace(lazy=i % 2 == 0, n=i) for i in range(10)]
    eager, lazy = SE.choose_push(peers, 3, random.Random(1))
    assert len(eager) == 3 and not any(p.lazy for p in eager)
    assert sorted(p.n for p in eager + lazy) == list(range(10))


def test_admitted_is_an_empty_frame(alice, bob):
    s = make(bob, alice)
    s.admitted()
    assert s.data_to_send() == [b""]


def test_responder_verdict_after_the_handshake():
    assert SE.refusal_of(b"") is None  # admitted
    assert SE.refusal_of(M.error_frame("banned", "go away")) == "banned"
    for junk in (b"{}", b"not json", M.frame("containers", items=[{}])):
        with pytest.raises(TransportError) as excinfo:
            SE.refusal_of(junk)
        assert excinfo.value.reason == "malformed"


def _keeps(own, peer, new_is_ours, old_is_ours, new_hash=b"\x01", old_hash=b"\x02"):
    return SE.keeps_new_connection(own, peer, new_is_ours=new_is_ours, old_is_ours=old_is_ours, new_hash=new_hash,
                                   old_hash=old_hash)


def test_second_connection_between_the_same_nodes_both_ends_keep_the_same_one():
    """Both ends judge the same two connections, in whatever order each saw them complete,
    and must keep the same one (else both close and redial). Crossing dials: the one the
    smaller DID opened ("a" < "b"). One side dialled twice: the smaller handshake hash."""
    low, high = b"\x01" * 32, b"\x02" * 32
    for hashes in ((low, high), (high, low)):
        # crossing: a opened c1 (hash hashes[0]), b opened c2 (hashes[1]); each end meets them in either order
        for a_first in (True, False):
            a_keeps_c1 = (not _keeps("did:a", "did:b", False, True, hashes[1], hashes[0]) if a_first
                          else _keeps("did:a", "did:b", True, False, hashes[0], hashes[1]))
            for b_first in (True, False):
                b_keeps_c1 = (not _keeps("did:b", "did:a", True, False, hashes[1], hashes[0]) if b_first
                              else _keeps("did:b", "did:a", False, True, hashes[0], hashes[1]))
                assert a_keeps_c1 and b_keeps_c1  # the one "did:a" opened
        # same side: a opened both c1 and c2; each end meets them in either order
        for opener, other in (("did:a", "did:b"), ("did:b", "did:a")):
            verdicts = set()
            for first, second in ((0, 1), (1, 0)):
                kept_new = _keeps(opener, other, True, True, hashes[second], hashes[first])
                verdicts.add(second if kept_new else first)
                kept_new = _keeps(other, opener, False, False, hashes[second], hashes[first])
                verdicts.add(second if kept_new else first)
            assert verdicts == {hashes.index(min(hashes))}  # the smaller hash, on both ends, either order


def test_screen_of_received_containers(alice, bob, now):
    s = make(alice, bob)
    assert s.screen("junk", now, ()) == "malformed"
    assert s.screen(note(bob, now, broadcast=True)["hmp_container"]["head"], now, ()) is None
    expired = note(bob, now - timedelta(days=2), ttl=now - timedelta(days=1), broadcast=True)
    assert s.screen(expired["hmp_container"]["head"], now, ()) == "expired"
    for_carol = build_container(bob, "note", {"text": "x"}, now=now, recipients=["did:hmp:carol"])
    assert s.screen(for_carol["hmp_container"]["head"], now, ()) == "not_addressed"
    assert s.screen(for_carol["hmp_container"]["head"], now, ("relay",)) is None  # a relay holds it


def test_catch_up_page_cursor_and_complete(alice, bob, now):
    s = make(alice, bob, delta_page=3)
    e = {"did:hmp:container:a": entry(bob, now)}
    s.answer_page(e, now, after=10, read=[11, 12, 13])  # a full page: more may follow
    s.answer_page({}, now, after=13, read=[14])
    s.answer_page({}, now, after=14, read=[])
    pages = [f["payload"] for f in sent(s)]
    assert [(p["cursor"], p["complete"]) for p in pages] == [("13", False), ("14", True), ("14", True)]
    assert pages[0]["added"] == e and "did:hmp:container:a" in s.offered  # it may acknowledge it


def test_relay_offers_held_pages(alice, bob, now):
    s = make(alice, bob, delta_page=2)
    s.offer_held({"did:hmp:container:a": entry(bob, now)}, now, MONO, read=[5, 9])
    assert s.held_after == 9 and s.counters["relay_offered"] == 1
    [offer] = sent(s)
    assert offer["class"] == "container_delta" and list(offer["payload"]["added"]) == ["did:hmp:container:a"]
    s.offer_held({}, now, MONO, read=[12])  # the last page; nothing the peer may receive: nothing sent
    assert s.held_after is None and sent(s) == []


def test_plan_forward(alice, bob, carol, now):
    from hmpnode.identity import Identity

    dave, erin = Identity(bytes([4]) * 32), Identity(bytes([5]) * 32)
    peers = {p.did: make(alice, p) for p in (bob, carol, dave, erin)}
    sessions = list(peers.values())
    c = note(bob, now, broadcast=True)
    head, did = c["hmp_container"]["head"], did_of(c)
    peers[carol.did].known.add(did)
    peers[dave.did].lazy = True
    eager, lazy = SE.plan_forward(head, did, sessions, origin=bob.did, now=now, fanout=1, rng=random.Random(3))
    # not back to bob (it came from bob), not to carol (it has it); dave asked to be announced to
    assert [s.did for s in eager] == [erin.did] and [s.did for s in lazy] == [dave.did]
    eager, lazy = SE.plan_forward(head, did, sessions, origin=None, now=now, fanout=0, rng=random.Random(3))
    assert eager == [] and {s.did for s in lazy} == {bob.did, dave.did, erin.did}
    directed = build_container(bob, "note", {"text": "x"}, now=now, recipients=[erin.did])
    eager, lazy = SE.plan_forward(directed["hmp_container"]["head"], did_of(directed), sessions, origin=None,
                                  now=now, fanout=1, rng=random.Random(3))
    assert [s.did for s in eager] == [erin.did] and lazy == []  # only the peer that serves a recipient
    expired = note(bob, now - timedelta(days=2), ttl=now - timedelta(days=1), broadcast=True)
    assert SE.plan_forward(expired["hmp_container"]["head"], did_of(expired), sessions, origin=None, now=now,
                           fanout=4, rng=random.Random(3)) == ([], [])


def test_transfer_batches_wants_first_within_limits():
    ids = [bytes([i % 256]) * 32 for i in range(SY.MAX_WANT + 300)]
    step = SE.ReconcileStep("global", None, have=ids[:SE.PUSH_CHUNK + 1], need=ids)
    plan = [(kind, len(chunk)) for kind, chunk in step.batches()]
    assert plan == [("want", SY.MAX_WANT), ("want", 300), ("push", SE.PUSH_CHUNK), ("push", 1)]
    assert list(SE.ReconcileStep("scoped", None, [], []).batches()) == []


def test_ingested_names_what_was_for_us(alice, bob, carol, now):
    s = make(alice, bob, roles=("relay",))
    mine = build_container(carol, "note", {"text": "x"}, now=now, recipients=[alice.did])
    other = build_container(carol, "note", {"text": "y"}, now=now, recipients=[bob.did])
    refused_one = build_container(carol, "note", {"text": "z"}, now=now, recipients=[alice.did])
    [event] = feed(s, M.frame("containers", items=[mine, other, refused_one]), now)
    done = s.ingested(event, {0: _result("stored", did_of(mine), 1), 1: _result("stored", did_of(other), 2),
                              2: _result("rejected", reason="bad_signature")}, [], MONO, now)
    assert done.for_us == [did_of(mine)]


def test_broken_records_end_the_session_and_strike_only_for_a_frame_too_large(alice, bob):
    for reason in ("bad_record", "bad_flags", "truncated", "record_too_short"):
        s = make(alice, bob, strike_threshold=1)
        assert s.record_failed(reason, MONO) == [] and not s.strikes.by_reason
        assert s.close_reason == reason and s.data_to_send() == []  # nothing said: the channel is not trusted
    s = make(alice, bob, strike_threshold=1)
    [cut] = s.record_failed("frame_too_large", MONO)
    assert cut.cut and s.strikes.by_reason == {"frame_too_large": 1} and s.closed


def test_equal_messages_in_one_millisecond_are_not_replays(alice, bob, now):
    """A relay's re-offer or a repeated ack can be the same payload within one millisecond:
    the same signed container, refused by the peer as a replay (an offence). Each message
    of a connection is dated at least a millisecond after the one before."""
    a, b = make(alice, bob), make(bob, alice)
    ack = {"acknowledged": ["did:hmp:container:a"]}
    first, second = a.send_mce("container_ack", ack, now), a.send_mce("container_ack", ack, now)
    assert first != second
    for data in a.data_to_send():
        feed(b, data, now)  # neither is refused
    assert b.strikes.count == 0


def test_containers_on_a_replaced_connection_leave_the_new_ones_requests_in_flight(alice, bob, now):
    """The replaced connection still delivers a frame that was under way. What of it is held
    now needs no request of anyone; what it brought and was refused must not release the
    request the new connection made (before, every DID of the frame was popped from the
    node-wide in-flight marks: a third peer's offer was then asked for too)."""
    ledger = Ledger()
    old = PeerSession(alice, bob.did, "127.0.0.1", Channel.LOOPBACK, limits=SessionLimits(), book=ledger.open(),
                      counters=Counter())
    new = PeerSession(alice, bob.did, "127.0.0.1", Channel.LOOPBACK, limits=SessionLimits(), book=ledger.open(),
                      counters=Counter())
    good, bad = note(bob, now, "good", broadcast=True), note(bob, now, "bad", broadcast=True)
    [event] = feed(old, M.frame("containers", items=[good, bad]), now)
    ledger.close(old.book)
    assert ask(new, [did_of(good), did_of(bad)], set(), now) == [did_of(good), did_of(bad)]
    old.ingested(event, {0: _result("stored", did_of(good), 1), 1: _result("rejected", reason="bad_signature")},
                 [], MONO, now)
    assert ledger.inflight.get(did_of(good)) == 0  # held now: settled
    assert ledger.inflight.get(did_of(bad)) == MONO + 10  # still asked of the new connection


class PlainMce:
    """A cheap stand-in for MCE crypto (what a simulator may inject): messages are not
    signed, their DID counts up; the check reads class, payload and date back."""

    def __init__(self):
        self.signed = self.checked = 0

    def sign(self, class_, payload, *, peer_did, now, in_reply_to=None):
        self.signed += 1
        head = {"class": class_, "container_did": f"did:hmp:container:plain{self.signed}", "recipient": [peer_did],
                "timestamp": format_time(now)}
        return {"hmp_container": {"head": head, "payload": payload}}

    def check(self, container, *, peer_did, own_did, now, max_age):
        self.checked += 1
        hmp = container["hmp_container"]
        assert hmp["head"]["recipient"] == [own_did]
        return M.Mce(hmp["head"]["class"], hmp["payload"], hmp["head"]["container_did"] + peer_did, now, None)


def test_a_pair_runs_on_injected_stand_ins_for_mce_crypto(alice, bob, now):
    """Announce, request, push, ack: every MCE message is made and checked by what the
    sessions were given, not by Ed25519 (an unsigned message fails the real check)."""
    crypto = PlainMce()
    items = [note(alice, now, str(i), broadcast=True) for i in range(3)]
    a = Side(alice, bob, now, initiator=True, containers=items, check=crypto.check, sign=crypto.sign)
    b = Side(bob, alice, now, check=crypto.check, sign=crypto.sign)
    assert a.session.announce({did_of(c): M.index_entry(c["hmp_container"]) for c in items}, now) == 3
    pump(a, b)
    assert set(b.store) == set(a.store) and sorted(d for d, _ in a.acked) == sorted(b.store)
    assert crypto.signed == crypto.checked >= 4  # announce, request, response, ack
    plain = PlainMce().sign("container_index", {}, peer_did=bob.did, now=now)
    assert refused(feed, make(bob, alice), M.frame("mce", container=plain), now).reason == "bad_mce"
