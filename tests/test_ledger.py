"""The node-wide who-has-what ledger (hmpnode.net.ledger), without sockets: the
views the mesh code uses, the per-connection and node-wide caps, what falls off
first, isolation between connections, and the memory one full connection costs."""

from __future__ import annotations

import tracemalloc

import pytest

from hmpnode.net.ledger import ANNOUNCED, GAVE, GOT, KNOWN, OFFERED, SEEN_MCE, Ledger


def dids(n: int, tag: str = "a") -> list[str]:
    return [f"did:hmp:container:{tag}{i:063x}" for i in range(n)]


def test_views_answer_in_add_update_discard_per_kind():
    book = Ledger().open()
    known, gave = book.view(KNOWN), book.view(GAVE)
    d = dids(3)
    known.add(d[0])
    gave.update(d[:2])
    assert d[0] in known and d[1] not in known and d[0] in gave and d[1] in gave
    gave.discard(d[0])
    assert d[0] not in gave and d[0] in known  # the other kind of the same DID stays
    gave.discard(d[2])  # absent: nothing happens
    known.update([None, 5, b"x"])  # not DIDs: ignored, and never "in"
    assert None not in known and 5 not in known
    assert book.ledger.entries == 2


def test_one_did_in_several_kinds_is_one_entry():
    ledger = Ledger()
    book = ledger.open()
    for kind in (KNOWN, GOT, GAVE, ANNOUNCED, OFFERED, SEEN_MCE):
        book.view(kind).update(dids(10))
    assert ledger.entries == 10 and all(d in book.view(OFFERED) for d in dids(10))


def test_an_idle_connection_holds_nothing():
    ledger = Ledger()
    book = ledger.open()
    assert "did:hmp:container:x" not in book.view(KNOWN) and not book.requested_view()
    assert book._bits is None and book._requested is None
    assert ledger.stats()["books"] == 0 and ledger.entries == 0


def test_connections_are_isolated():
    ledger = Ledger()
    a, b = ledger.open(), ledger.open()
    a.view(KNOWN).update(dids(5))
    assert not any(d in b.view(KNOWN) for d in dids(5))
    b.view(KNOWN).update(dids(5))
    a.view(KNOWN).discard(dids(5)[0])
    assert dids(5)[0] in b.view(KNOWN) and dids(5)[0] not in a.view(KNOWN)
    assert ledger.entries == 9


def test_a_connection_holds_at_most_its_cap_and_the_oldest_fall_off():
    ledger = Ledger(max_entries=10_000, session_entries=80)
    book = ledger.open()
    known = book.view(KNOWN)
    many = dids(1000)
    for d in many:
        known.add(d)
        assert book.size() <= 80
    assert all(d in known for d in many[-70:])  # the newest stay
    assert not any(d in known for d in many[:900])  # the oldest went
    assert ledger.entries == book.size() and ledger.evicted_session == 1000 - book.size()
    known.update(dids(5000, "b"))  # one long update keeps the cap too
    assert book.size() <= 80 + 256


def test_requested_entries_never_fall_off_and_count():
    ledger = Ledger(session_entries=100)
    book = ledger.open()
    requested, known = book.requested_view(), book.view(KNOWN)
    asked = dids(60, "r")
    requested.update(asked)
    known.update(dids(1000))
    assert len(requested) == 60 and all(d in requested for d in asked)
    assert book.size() <= 100 and ledger.entries == book.size()
    requested.difference_update(asked[:10] + [None])
    requested.intersection_update(asked[20:] + [None, 7])
    assert len(requested) == 40 and asked[25] in requested and asked[15] not in requested
    requested.discard(asked[25])
    assert len(requested) == 39 and ledger.entries == book.size()
    requested.intersection_update([])
    assert not requested and len(requested) == 0 and book._requested is None
    assert ledger.entries == book.size()


def test_over_the_node_wide_cap_the_largest_connection_gives_way():
    ledger = Ledger(max_entries=300, session_entries=1000)
    small, big = ledger.open(), ledger.open()
    small.view(KNOWN).update(dids(50, "s"))
    for d in dids(2000, "h"):
        big.view(KNOWN).add(d)
        assert ledger.entries <= 300
    assert all(d in small.view(KNOWN) for d in dids(50, "s"))  # the small one kept everything
    assert ledger.evicted_node > 0 and big.size() == ledger.entries - 50


def test_closing_drops_the_entries_and_a_closed_book_takes_none():
    ledger = Ledger()
    a, b = ledger.open(), ledger.open()
    a.view(KNOWN).update(dids(100))
    a.requested_view().update(dids(10, "r"))
    b.view(GOT).update(dids(3))
    ledger.close(a)
    assert ledger.entries == 3 and ledger.stats()["books"] == 1
    a.view(KNOWN).update(dids(10))  # a task still running after the connection ended
    a.requested_view().update(dids(10))
    assert dids(1)[0] not in a.view(KNOWN) and not a.requested_view() and ledger.entries == 3
    ledger.close(a)  # twice: nothing more
    ledger.close(b)
    assert ledger.entries == 0 and ledger.stats()["books"] == 0


def test_digests_are_keyed_per_node():
    one, two = Ledger(key=b"k" * 16), Ledger(key=b"j" * 16)
    d = dids(1)[0]
    assert one.digest(d) == Ledger(key=b"k" * 16).digest(d) != two.digest(d)
    assert 0 <= one.digest(d) < 2 ** 60 and one.digest(None) is None


def test_one_full_connection_costs_under_two_megabytes():
    """The worst a peer can make the node hold at the default caps (peer.ledger_session_entries
    20 000, peer.max_requested 20 000): its book, and the node-wide requests in flight it can
    fill with made-up offers; measured."""
    offered = dids(60_000)
    tracemalloc.start()
    try:
        ledger = Ledger()
        book = ledger.open()
        requested, known, seen = book.requested_view(), book.view(KNOWN), book.view(SEEN_MCE)
        for i in range(0, 20_000, 1000):
            requested.update(offered[i:i + 1000])
            for d in offered[i:i + 1000]:
                ledger.inflight[d] = float(i)
        full_requested, _ = tracemalloc.get_traced_memory()
        requested.intersection_update([])
        for i in range(20_000, 60_000, 500):
            known.update(offered[i:i + 500])
            seen.add(f"did:hmp:container:m{i}")
        full_known, _ = tracemalloc.get_traced_memory()
        assert book.size() <= ledger.session_entries
    finally:
        tracemalloc.stop()
    assert full_requested < 2 * 1024 * 1024 and full_known < 2 * 1024 * 1024, (full_requested, full_known)


@pytest.mark.parametrize("bad", [(0, 100), (100, 7)])
def test_caps_too_small_are_refused(bad):
    with pytest.raises(ValueError):
        Ledger(*bad)


def test_requests_in_flight_are_bounded_node_wide_and_the_oldest_fall_off():
    ledger = Ledger(session_entries=80)
    inflight = ledger.inflight
    assert inflight.cap == 20
    asked = dids(1000)
    for i, d in enumerate(asked):
        inflight[d] = 10.0 + i
        assert len(inflight) <= 20  # a quarter of what one connection may hold
    assert inflight.get(asked[-1], 0) == 1009.0 and inflight.get(asked[0], 0) == 0
    assert inflight.pop(asked[-1], None) == 1009.0 and inflight.get(asked[-1], 0) == 0
    assert inflight.pop(None, None) is None and inflight.get(None, 0) == 0
    inflight[None] = 1.0  # not a DID: ignored
    assert ledger.stats()["inflight"] == len(inflight) and inflight.evicted == 1000 - (len(inflight) + 1)  # one was popped
    assert Ledger(session_entries=10_000_000).inflight.cap < 100_000  # never the mesh's old prune threshold


def test_a_connection_that_ends_releases_what_it_was_asked_and_did_not_deliver():
    """A request in flight keeps another peer's offer of the same container from being taken
    up (for a while); its connection ending means the answer never comes. Before, the entry
    stayed: a relay's offer on the connection that replaced it was not asked for, and the
    relay offers once per connection, so its recipient got nothing until it reconnected."""
    ledger = Ledger()
    old, other = ledger.open(), ledger.open()
    asked, delivered, elsewhere = dids(3, "r"), dids(1, "d")[0], dids(1, "e")[0]
    old.requested_view().update([*asked, delivered])
    other.requested_view().add(elsewhere)
    for did in [*asked, delivered, elsewhere]:
        ledger.inflight[did] = 1e9
    old.requested_view().discard(delivered)  # it came: mesh.py pops it from inflight itself
    ledger.close(old)
    assert all(ledger.inflight.get(d, 0) == 0 for d in asked)
    assert ledger.inflight.get(delivered, 0) == 1e9  # not asked of it any more: not its to release
    assert ledger.inflight.get(elsewhere, 0) == 1e9  # another connection's request stays in flight
    ledger.close(other)
    assert len(ledger.inflight) == 1
