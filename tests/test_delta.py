"""container_delta `modified` and `removed` (hmpnode.net.delta, docs/protocol.md 32), sans-IO.

The queue (coalescing, node-wide rate, bounds), the pure decisions (which blocks to
ask for, what a peer's removal means to us), the session's side of the wire (what it
sends, what it takes, what it refuses), and the store queries behind them. The real
nodes' side is tests/test_delta_mesh.py.
"""

from __future__ import annotations

import sqlite3
from datetime import timedelta

import orjson

from hmpnode.container.backlinks import build_referenced_by
from hmpnode.container.evaluations import build_evaluation, evaluations_block
from hmpnode.net import delta as DL
from hmpnode.net import index as IX
from hmpnode.net import session as SE
from hmpnode.net.session import MAX_BLOCKS
from hmpnode.store import mesh as ms
from hmpnode.store import records
from hmpnode.store.schema import MIGRATIONS, migrate
from tests.test_session import MONO, did_of, entry, feed, make, mce, note, refused, sent
from tests import test_store_mesh
from tests.test_store_mesh import store
from tests.test_store_mesh import make as make_stored

A, B, C = "did:hmp:container:a", "did:hmp:container:b", "did:hmp:container:c"
H1, H2 = "sha256:" + "11" * 32, "sha256:" + "22" * 32


# -- the queue -----------------------------------------------------------------------------------


def test_changes_of_one_did_coalesce_and_skip_only_the_peer_every_change_came_from():
    q = DL.DeltaQueue()
    assert q.changed(A, "did:peer:p") and q.changed(A, "did:peer:p")
    q.changed(B, "did:peer:p")
    q.changed(B, "did:peer:q")  # another peer's change: p lacks it, so p is told too
    q.changed(C, "did:peer:p")
    q.changed(C, None)  # the agent's own change: everyone is told
    modified, removed = q.take(MONO)
    assert modified == {A: frozenset({"did:peer:p"}), B: frozenset(), C: frozenset()} and removed == {}
    assert q.coalesced == 3 and len(q) == 0


def test_a_removal_replaces_a_pending_modification_and_goes_first():
    q = DL.DeltaQueue()
    q.changed(A)
    q.changed(B)
    assert q.gone(A, DL.Removal("expired"))
    assert not q.changed(A)  # removed: its blocks no longer matter
    modified, removed = q.take(MONO)
    assert list(removed) == [A] and list(modified) == [B]


def test_the_queue_is_bounded_and_counts_what_it_drops():
    q = DL.DeltaQueue(DL.DeltaLimits(max_pending=2))
    assert q.changed(A) and q.changed(B)
    assert not q.changed(C) and not q.gone(C, DL.Removal("revoked"))
    assert q.gone(A, DL.Removal("expired"))  # a removal of a pending DID takes its place
    assert q.dropped == 2 and len(q) == 2


def test_take_is_bounded_by_the_batch_and_the_node_wide_rate():
    q = DL.DeltaQueue(DL.DeltaLimits(entries_per_second=10, burst=25, max_batch=20))
    for i in range(100):
        q.changed(f"did:hmp:container:{i}")
    first, _ = q.take(MONO)
    assert len(first) == 20  # the batch
    second, _ = q.take(MONO)
    assert len(second) == 5  # what is left of the burst
    assert q.take(MONO) == ({}, {})  # nothing until the bucket refills
    third, _ = q.take(MONO + 1.0)
    assert len(third) == 10  # one second at 10 entries per second
    assert list(first)[0] == "did:hmp:container:0" and list(third)[0] == "did:hmp:container:25"  # oldest first


# -- pure decisions -------------------------------------------------------------------------------


def test_block_hashes_are_those_of_the_blocks_the_node_sends(alice, bob, now):
    target = did_of(note(alice, now))
    items = [build_evaluation(i, value=v, type="usefulness", target=target, now=now) for i, v in ((alice, 0.5), (bob, -1))]
    links = [("in_reply_to", "did:hmp:container:z"), ("depends_on", "did:hmp:container:y")]
    hashes = IX.block_hashes(items, links)
    assert hashes["evaluations_hash"] == evaluations_block(items)["evaluations_hash"]
    signed = build_referenced_by([{"type": t, "target": s} for t, s in links], alice)
    assert hashes["referenced-by_hash"] == signed["referenced-by_hash"]
    assert IX.block_hashes(list(reversed(items)), list(reversed(links))) == hashes  # order does not matter
    assert IX.block_hashes([], []) == {}


def test_plan_modified_asks_for_the_blocks_that_differ_and_offers_what_we_lack():
    local = {A: {"evaluations_hash": H1}, B: {"evaluations_hash": H1, "referenced-by_hash": H1}, C: None}
    entries = {
        A: {"evaluations_hash": H2, "referenced-by_hash": H1},  # both differ from ours (we have no links)
        B: {"evaluations_hash": H1, "referenced-by_hash": H1},  # what we have: nothing to ask
        C: {"evaluations_hash": H2},  # not held: an offer of the container
        "did:hmp:container:d": "junk",  # not held either: an offer, as `added` would be
    }
    local["did:hmp:container:d"] = None
    offered, rb, ev = DL.plan_modified(entries, local)
    assert offered == [C, "did:hmp:container:d"] and rb == [A] and ev == [A]
    assert DL.plan_modified({A: "junk", B: {"evaluations_hash": 5}}, local) == ([], [], [])


def test_pointed_at_names_the_targets_and_the_one_peer_they_came_from(alice, now):
    def row(text, source, related, ttl=None):
        c = note(alice, now, text, related=related, ttl=ttl)
        return records.StoredContainer(1, did_of(c), c["hmp_container"], 0, records.to_us(ttl) if ttl else None, 0,
                                       source, [], False, 0)

    rows = [row("r1", "peer:did:p", {"in_reply_to": [A, B]}), row("r2", "peer:did:p", {"depends_on": A}),
            row("r3", "peer:did:q", {"in_reply_to": B}), row("r4", "agent", {"in_reply_to": C}),
            row("gone", "peer:did:p", {"in_reply_to": "did:hmp:container:x"}, ttl=now),
            row("plain", "peer:did:p", None)]
    assert DL.pointed_at(rows, records.to_us(now)) == {A: "did:p", B: None, C: None}


def test_judge_removal_applies_only_what_we_can_check(now):
    ts_us = records.to_us(now)
    held = ms.Facts("did:hmp:agent:x", ts_us, ts_us + 10)
    assert DL.judge_removal(None, ts_us, None) == "not_held"
    assert DL.judge_removal(held, ts_us + 10, None) == "expired"
    assert DL.judge_removal(held, ts_us, now - timedelta(seconds=1)) == "revoked"
    assert DL.judge_removal(held, ts_us, now) == "unverified"  # signed at the revocation instant: kept (4.6)
    assert DL.judge_removal(held, ts_us, None) == "unverified"
    assert DL.judge_removal(held._replace(ttl_us=None), ts_us, None) == "unverified"


def test_read_removals_takes_dids_and_readable_reasons_only():
    payload = {"removed": [A, 5, "not-a-did", B, C], "removed_reasons": {
        A: {"reason": "revoked", "revocation": "did:hmp:container:proof"},
        B: {"reason": "deleted"},  # not a reason we know: none
        C: {"reason": "revoked", "revocation": "x" * 600}}}  # no usable proof
    dids, reasons = DL.read_removals(payload, 10)
    assert dids == [A, B, C]
    assert reasons == {A: DL.Removal("revoked", "did:hmp:container:proof"), C: DL.Removal("revoked", None)}
    assert DL.read_removals(payload, 2)[0] == [A, B]
    assert DL.read_removals({"removed": "x", "removed_reasons": []}, 10) == ([], {})


# -- the session ------------------------------------------------------------------------------------


def test_a_delta_with_modified_and_removed_becomes_events(alice, bob, now):
    s = make(alice, bob)
    added = entry(bob, now)
    [offered, modified, removed] = feed(s, mce(bob, alice, "container_delta", {
        "since": "2026-11-29T10:00:00Z", "added": {A: added}, "modified": {B: {"evaluations_hash": H1}},
        "removed": [C], "removed_reasons": {C: {"reason": "expired"}}}, now), now)
    assert isinstance(offered, SE.Offered) and offered.dids == [A]
    assert isinstance(modified, SE.Modified) and modified.entries == {B: {"evaluations_hash": H1}}
    assert isinstance(removed, SE.Removed) and removed.dids == [C] and removed.reasons == {C: DL.Removal("expired")}
    assert B not in s.known  # a modified entry is not an offer until the adapter finds we lack it


def test_what_send_changes_queues_is_what_the_peer_reads(alice, bob, now):
    a, b = make(alice, bob), make(bob, alice)
    hmp = note(alice, now)["hmp_container"]
    entry_ = DL.modified_entry(hmp, {"evaluations_hash": H1})
    removed, reasons = DL.removal_wire({B: DL.Removal("revoked", "did:hmp:container:proof"), C: DL.Removal("expired")})
    assert a.send_changes({A: entry_}, removed, reasons, now) == 3
    [frame] = a.data_to_send()
    [modified, gone] = feed(b, frame, now)  # verified by the receiver: the schema admits it
    assert modified.entries[A]["head"]["signature"] == hmp["head"]["signature"]
    assert modified.entries[A]["evaluations_hash"] == H1
    assert gone.dids == [B, C] and gone.reasons[B] == DL.Removal("revoked", "did:hmp:container:proof")


def test_modified_and_removed_entries_cost_the_peer_container_budget(alice, bob, now):
    s = make(alice, bob, containers_per_second=1.0, container_burst=3.0)

    def delta(k):
        return mce(bob, alice, "container_delta", {"since": "2026-11-29T10:00:00Z",
                                                   "modified": {f"did:hmp:container:{k}": {}},
                                                   "removed": [f"did:hmp:container:{k}1"]}, now)

    assert len(feed(s, delta("a"), now)) == 2  # two entries: two of the three tokens
    assert refused(feed, s, delta("b"), now).reason == "rate_limited"
    assert len(feed(s, delta("c"), now, mono=MONO + 1.0)) == 2  # refilled


def test_entries_beyond_max_blocks_are_ignored_and_counted(alice, bob, now):
    s = make(alice, bob)
    many = [f"did:hmp:container:{i}" for i in range(MAX_BLOCKS + 5)]
    [modified, removed] = feed(s, mce(bob, alice, "container_delta", {
        "since": "2026-11-29T10:00:00Z", "modified": {d: {} for d in many}, "removed": many}, now), now)
    assert len(modified.entries) == MAX_BLOCKS and len(removed.dids) == MAX_BLOCKS
    assert s.counters["delta_entries_ignored"] == 10


def test_ask_blocks_is_a_request_the_peer_answers_with_blocks(alice, bob, now):
    a, b = make(alice, bob), make(bob, alice)
    a.ask_blocks([A], [A, B], now)
    [frame] = a.data_to_send()
    [requested] = feed(b, frame, now)
    assert isinstance(requested, SE.Requested)
    assert requested.referenced_by == [A] and requested.evaluations == [A, B] and not requested.answer
    assert a.counters["delta_blocks_asked"] == 3


def test_peer_removed_stops_waiting_stops_offering_and_asks_for_the_proof(alice, bob, now):
    s = make(alice, bob)
    s.requested.claim([A], MONO, MONO + 10)
    events = s.peer_removed([A, B, C], {A: "not_held", B: "unverified", C: "revoked"}, ["did:hmp:container:proof"], MONO)
    assert A not in s.requested  # not waited for any more
    assert B in s.known  # it dropped it: not offered to it again
    [offer] = events
    assert isinstance(offer, SE.Offered) and offer.dids == ["did:hmp:container:proof"]


def test_modified_received_from_the_old_code_path_was_an_offer_only(alice, bob, now):
    """Before issue 14 a `modified` entry was taken as an offer, whatever we held: the
    session now hands it to the adapter, which asks for the blocks of a held container."""
    s = make(alice, bob)
    events = feed(s, mce(bob, alice, "container_delta", {"since": "2026-11-29T10:00:00Z",
                                                         "modified": {A: {"evaluations_hash": H1}}}, now), now)
    assert [type(e) for e in events] == [SE.Modified]


def test_send_changes_payload_shape(alice, bob, now):
    s = make(alice, bob)
    s.send_changes({}, [A], {A: {"reason": "expired"}}, now)
    [message] = sent(s)
    assert message["class"] == "container_delta"
    assert message["payload"]["removed"] == [A] and "modified" not in message["payload"]
    assert message["payload"]["removed_reasons"] == {A: {"reason": "expired"}}


# -- the store -----------------------------------------------------------------------------------

#: a migrated store (the fixture of tests/test_store_mesh.py)
conn = test_store_mesh.conn


def test_migration_adds_the_ttl_index(tmp_path):
    db = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    assert migrate(db, upto=9) == 9
    assert not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'containers_by_ttl'").fetchone()
    assert migrate(db) == len(MIGRATIONS)
    assert db.execute("SELECT 1 FROM sqlite_master WHERE name = 'containers_by_ttl'").fetchone()


def test_expiring_is_an_index_range_in_ttl_order(conn, alice, now):
    made = [make_stored(alice, f"t{i}", ttl=now + timedelta(seconds=10 - i), broadcast=True) for i in range(5)]
    dids = [store(conn, c)[1] for c in made]
    store(conn, make_stored(alice, "forever", broadcast=True))
    base = records.to_us(now)
    got = ms.expiring(conn, base + 6_000_000, base + 9_000_000, 10)
    assert [d for d, _ in got] == [dids[3], dids[2], dids[1]]  # ttl 7, 8, 9 s: in (6, 9]
    assert [d for d, _ in ms.expiring(conn, base, base + 100_000_000, 2)] == [dids[4], dids[3]]
    plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN SELECT did, ttl_us FROM containers WHERE ttl_us > 1 "
                                               "AND ttl_us <= 2 AND conflict = 0 ORDER BY ttl_us LIMIT 5"))
    assert "containers_by_ttl" in plan


def test_revoked_held_finds_what_was_signed_after_the_revocation_and_its_proof(conn, alice, bob, now):
    from hmpnode.container.build import build_container

    before = store(conn, make_stored(alice, "before", broadcast=True, now=now - timedelta(seconds=5)))[1]
    after = store(conn, make_stored(alice, "after", broadcast=True, now=now + timedelta(seconds=5)))[1]
    store(conn, make_stored(bob, "someone else", broadcast=True, now=now + timedelta(seconds=5)))
    revoke = build_container(alice, "peer_announce", {"addresses": [], "key_is_falsified": True}, now=now)
    proof = store(conn, revoke)[1]
    dids, found = ms.revoked_held(conn, alice.did, records.to_us(now), 100)
    assert dids == [after] and found == proof and before not in dids


def test_relay_drop_deletes_only_what_is_held_for_others(conn, alice, bob, carol):
    own = alice.did
    for_others = store(conn, make_stored(bob, "for carol", recipients=[carol.did]))
    for_us = store(conn, make_stored(bob, "for us and carol", recipients=[own, carol.did]))
    ms.relay_hold(conn, [(carol.did, for_others[0], for_others[1], 10), (carol.did, for_us[0], for_us[1], 10)])
    assert ms.relay_drop(conn, [for_others[1], for_us[1]], own) == 2
    assert not records.is_held(conn, for_others[1])  # only a relay's copy: gone with the holding
    assert records.is_held(conn, for_us[1])  # ours: kept
    assert ms.relay_counts(conn)["held"] == 0


def test_facts_of(conn, alice, now):
    _, did = store(conn, make_stored(alice, "x", ttl=now + timedelta(seconds=3), broadcast=True))
    facts = ms.facts_of(conn, [did, "did:hmp:container:none"])
    assert facts == {did: ms.Facts(alice.did, records.to_us(now), records.to_us(now) + 3_000_000)}


def test_removal_wire_round_trip():
    removed, reasons = DL.removal_wire({A: DL.Removal("revoked", "did:hmp:container:p"), B: DL.Removal("expired")})
    payload = orjson.loads(orjson.dumps({"removed": removed, "removed_reasons": reasons}))
    assert DL.read_removals(payload, 10) == ([A, B], {A: DL.Removal("revoked", "did:hmp:container:p"),
                                                      B: DL.Removal("expired")})
