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
    ledger = Ledger(session_entries=400)
    book = ledger.open()
    requested, known = book.requested_view(), book.view(KNOWN)
    asked = dids(60, "r")
    assert requested.claim(asked + [None], 1.0, 11.0) == asked
    known.update(dids(1000))
    assert len(requested) == 60 and all(d in requested for d in asked)
    assert book.size() <= 400 and ledger.entries == book.size()
    assert requested.answered(asked[:10] + [None]) == 10
    assert requested.keep_only(asked[20:] + [None, 7]) == 10
    assert len(requested) == 40 and asked[25] in requested and asked[15] not in requested
    requested.discard(asked[25])
    assert len(requested) == 39 and ledger.entries == book.size()
    assert requested.claim(asked[30:35], 2.0, 12.0) == []  # asked of it already
    requested.keep_only([])
    assert not requested and len(requested) == 0 and book._requested is None
    assert ledger.entries == book.size() and len(ledger.inflight) == 0  # every mark went with its request


def test_requests_expire_at_their_deadline_and_release_their_marks():
    """A request the peer never answers on a live connection is forgotten at its deadline,
    so that the next offer of the container (from it or another peer) is asked for."""
    ledger = Ledger()
    book, other = ledger.open(), ledger.open()
    requested = book.requested_view()
    first, second = dids(3, "f"), dids(2, "s")
    requested.claim(first, 0.0, 10.0)
    requested.claim(second, 5.0, 15.0)
    assert requested.next_deadline() == 10.0
    assert other.requested_view().claim(first, 9.0, 19.0) == []  # in flight to the first book
    assert requested.expire(9.99) == 0
    assert requested.expire(10.0) == 3 and requested.next_deadline() == 15.0
    assert all(d not in requested for d in first) and all(d in requested for d in second)
    assert other.requested_view().claim(first, 10.0, 20.0) == first  # taken up at once
    assert requested.claim(first, 10.0, 20.0) == []  # now the other book's
    assert requested.expire(100.0) == 2 and requested.next_deadline() is None
    assert len(ledger.inflight) == 3


def test_an_inflight_mark_is_released_only_by_the_book_that_asked():
    """An answer (or an omission) on one connection does not release the request another
    connection made of the same container; a container that is held now settles any."""
    ledger = Ledger()
    a, b = ledger.open(), ledger.open()
    d = dids(2)
    a.requested_view().claim([d[0]], 0.0, 10.0)
    b.requested_view().answered([d[0]])  # b never asked: a's request stays in flight
    b.requested_view().keep_only([])
    assert ledger.inflight.get(d[0]) == 10.0
    assert b.requested_view().claim([d[0]], 5.0, 15.0) == []
    ledger.close(b)
    assert ledger.inflight.get(d[0]) == 10.0
    a.requested_view().claim([d[1]], 0.0, 10.0)
    ledger.inflight.settle([d[1]])  # it arrived on some connection and is held
    assert ledger.inflight.get(d[1]) == 0.0


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
    a.requested_view().claim(dids(10, "r"), 0.0, 10.0)
    b.view(GOT).update(dids(3))
    ledger.close(a)
    assert ledger.entries == 3 and ledger.stats()["books"] == 1
    a.view(KNOWN).update(dids(10))  # a task still running after the connection ended
    assert a.requested_view().claim(dids(10), 0.0, 10.0) == []
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
            requested.claim(offered[i:i + 1000], float(i), float(i) + 10.0)
        full_requested, _ = tracemalloc.get_traced_memory()
        requested.keep_only([])
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
        assert inflight.take(ledger.digest(d), 0.0, 10.0 + i, 1)
        assert len(inflight) <= 20  # a quarter of what one connection may hold
    assert inflight.get(asked[-1], 0) == 1009.0 and inflight.get(asked[0], 0) == 0
    inflight.settle([asked[-1], None])
    assert inflight.get(asked[-1], 0) == 0 and inflight.get(None, 0) == 0
    assert ledger.stats()["inflight"] == len(inflight) and inflight.evicted == 1000 - (len(inflight) + 1)  # one settled
    assert Ledger(session_entries=10_000_000).inflight.cap < 100_000  # never the mesh's old prune threshold


def test_a_connection_that_ends_releases_what_it_was_asked_and_did_not_deliver():
    """A request in flight keeps another peer's offer of the same container from being taken
    up (for a while); its connection ending means the answer never comes. Before, the entry
    stayed: a relay's offer on the connection that replaced it was not asked for, and the
    relay offers once per connection, so its recipient got nothing until it reconnected."""
    ledger = Ledger()
    old, other = ledger.open(), ledger.open()
    asked, delivered, elsewhere = dids(3, "r"), dids(1, "d")[0], dids(1, "e")[0]
    old.requested_view().claim([*asked, delivered], 0.0, 1e9)
    other.requested_view().claim([elsewhere], 0.0, 1e9)
    old.requested_view().discard(delivered)  # it came: its mark went with it
    assert ledger.inflight.get(delivered, 0) == 0
    ledger.close(old)
    assert all(ledger.inflight.get(d, 0) == 0 for d in asked)
    assert ledger.inflight.get(elsewhere, 0) == 1e9  # another connection's request stays in flight
    ledger.close(other)
    assert len(ledger.inflight) == 0


def test_a_peer_that_failed_a_request_is_asked_again_without_blocking_the_others():
    """A peer that offers a container first and never delivers it must not keep the node from
    taking up another peer's offer: once its request expired, asking it again leaves the
    container free for another peer's request (both may deliver; the second is a duplicate)."""
    ledger = Ledger()
    squatter, honest = ledger.open(), ledger.open()
    d = dids(1)
    assert squatter.requested_view().claim(d, 0.0, 10.0) == d
    assert honest.requested_view().claim(d, 5.0, 15.0) == []  # one request at a time
    assert squatter.requested_view().expire(10.0) == 1
    assert squatter.requested_view().claim(d, 10.0, 20.0) == d  # it offered again first: asked again
    assert honest.requested_view().claim(d, 11.0, 21.0) == d  # but the honest peer is asked too
    assert squatter.requested_view().claim(dids(1, "o"), 11.0, 21.0)  # other containers: as before
    assert honest.requested_view().claim(dids(1, "o"), 11.0, 21.0) == []
