"""Mesh rows (hmpnode.store.mesh) against a real, migrated SQLite database holding
real, verified containers."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta

import orjson
import pytest

from hmpnode.container.build import build_container
from hmpnode.container.verify import Verifier
from hmpnode.store import mesh as ms
from hmpnode.store import records
from hmpnode.store.schema import MIGRATIONS, migrate
from tests.conftest import NOW

NOW_US = records.to_us(NOW)
SEC = 1_000_000
DAVE = "did:hmp:agent:dave"  # a recipient that needs no key: it is only addressed


@pytest.fixture
def conn(tmp_path):
    connection = sqlite3.connect(tmp_path / "db", isolation_level=None)
    assert migrate(connection) == len(MIGRATIONS)
    try:
        yield connection
    finally:
        connection.close()


def make(identity, text, *, recipients=None, broadcast=None, ttl=None, tags=None, related=None, now=NOW):
    container = build_container(identity, "note", {"text": text}, now=now, recipients=recipients,
                                broadcast=broadcast, ttl=ttl, tags=tags, related=related)
    assert Verifier().verify(container, now=now).ok
    return container


def store(conn, container, source="peer", received_us=NOW_US) -> tuple[int, str]:
    (result,) = records.insert_containers(
        conn, [records.NewContainer(container["hmp_container"], (), source)], received_us)
    assert result.status == "stored"
    return result.seq, result.did


def store_before_9(conn, container, received_us=NOW_US) -> tuple[int, str]:
    """A container row as versions before schema 9 wrote it (no did_key): (seq, did)."""
    hmp = container["hmp_container"]
    head, body = hmp["head"], orjson.dumps(hmp)
    ts_us = records.to_us(datetime.fromisoformat(head["timestamp"]))
    ttl_us = records.to_us(datetime.fromisoformat(head["ttl"])) if head.get("ttl") else None
    seq = conn.execute(
        "INSERT INTO containers (did, signature, payload_hash, class, sender, timestamp, ts_us, ttl_us, size,"
        " received_us, source, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'peer', ?)",
        (head["container_did"], head["signature"], head["payload_hash"], head["class"], head["sender_did"],
         head["timestamp"], ts_us, ttl_us, len(body), received_us, body)).lastrowid
    return seq, head["container_did"]


def count(conn, table, where="1", args=()) -> int:
    return conn.execute(f"SELECT COUNT(*) FROM {table} WHERE {where}", args).fetchone()[0]


def held(conn, did) -> bool:
    return records.get_by_did(conn, did) is not None


# -- peers ------------------------------------------------------------------------------------


def peer(did, **changes) -> ms.PeerRow:
    row = ms.PeerRow(did=did, announce=b'{"signed":"announce"}',
                     addresses=["ws://192.0.2.1:7400", "ws://[2001:db8::1]:7400"], roles=["relay", "mailman"],
                     mailman=["did:hmp:agent:m1"], announced_us=NOW_US, source="lan", last_seen_us=NOW_US)
    for name, value in changes.items():
        setattr(row, name, value)
    return row


def only_peer(conn) -> ms.PeerRow:
    (row,) = ms.load_peers(conn)
    return row


def test_peer_round_trip(conn, alice, bob):
    a = peer(alice.did, last_contact_us=NOW_US - SEC)
    b = peer(bob.did, announce=None, addresses=[], roles=[], mailman=[], announced_us=0, source="dht")
    ms.upsert_peer(conn, a)
    ms.upsert_peer(conn, b)
    loaded = {row.did: row for row in ms.load_peers(conn)}
    assert loaded == {alice.did: a, bob.did: b}
    assert isinstance(loaded[alice.did].announce, bytes)
    assert loaded[alice.did].addresses == ["ws://192.0.2.1:7400", "ws://[2001:db8::1]:7400"]
    assert loaded[bob.did].announce is None and loaded[bob.did].last_contact_us is None


def test_load_peers_empty(conn):
    assert ms.load_peers(conn) == []


def test_newer_announce_replaces(conn, alice):
    ms.upsert_peer(conn, peer(alice.did))
    newer = peer(alice.did, announce=b"v2", addresses=["ws://198.51.100.7:7400"], roles=["relay"], mailman=[],
                 announced_us=NOW_US + SEC, last_seen_us=NOW_US + SEC)
    ms.upsert_peer(conn, newer)
    assert only_peer(conn) == newer


def test_equal_announce_time_replaces(conn, alice):
    ms.upsert_peer(conn, peer(alice.did))
    ms.upsert_peer(conn, peer(alice.did, addresses=["ws://203.0.113.9:1"]))
    assert only_peer(conn).addresses == ["ws://203.0.113.9:1"]


def test_older_announce_never_replaces_a_newer_one(conn, alice):
    newer = peer(alice.did, announce=b"v2", addresses=["ws://new:1"], roles=["relay"], mailman=["did:x:new"],
                 announced_us=NOW_US + 10 * SEC, last_seen_us=NOW_US)
    ms.upsert_peer(conn, newer)
    ms.upsert_peer(conn, peer(alice.did, announce=b"v1", addresses=["ws://old:1"], roles=[], mailman=[],
                              announced_us=NOW_US, last_seen_us=NOW_US + 20 * SEC))
    row = only_peer(conn)
    assert row.announce == b"v2"
    assert row.addresses == ["ws://new:1"]
    assert row.roles == ["relay"]
    assert row.mailman == ["did:x:new"]
    assert row.announced_us == NOW_US + 10 * SEC
    # seeing the peer is news even when its announce is stale
    assert row.last_seen_us == NOW_US + 20 * SEC


def test_last_seen_never_goes_back(conn, alice):
    ms.upsert_peer(conn, peer(alice.did, last_seen_us=NOW_US + 5 * SEC))
    ms.upsert_peer(conn, peer(alice.did, last_seen_us=NOW_US))
    assert only_peer(conn).last_seen_us == NOW_US + 5 * SEC


def test_contact_time_survives_a_refresh(conn, alice):
    ms.upsert_peer(conn, peer(alice.did, last_contact_us=NOW_US - 60 * SEC))
    # a refresh from discovery does not know the contact time
    ms.upsert_peer(conn, peer(alice.did, announce=b"v2", announced_us=NOW_US + SEC, last_contact_us=None))
    row = only_peer(conn)
    assert row.announce == b"v2"
    assert row.last_contact_us == NOW_US - 60 * SEC


def test_refresh_with_a_contact_time_sets_it(conn, alice):
    ms.upsert_peer(conn, peer(alice.did, last_contact_us=NOW_US - 60 * SEC))
    ms.upsert_peer(conn, peer(alice.did, last_contact_us=NOW_US))
    assert only_peer(conn).last_contact_us == NOW_US


def test_touch_peer(conn, alice, bob):
    ms.upsert_peer(conn, peer(alice.did, last_seen_us=NOW_US))
    ms.upsert_peer(conn, peer(bob.did, last_seen_us=NOW_US))
    ms.touch_peer(conn, alice.did, NOW_US + 30 * SEC)
    rows = {r.did: r for r in ms.load_peers(conn)}
    assert rows[alice.did].last_contact_us == NOW_US + 30 * SEC
    assert rows[alice.did].last_seen_us == NOW_US + 30 * SEC
    assert rows[bob.did].last_contact_us is None and rows[bob.did].last_seen_us == NOW_US
    # an earlier touch sets the contact time but does not move last_seen back
    ms.touch_peer(conn, alice.did, NOW_US + 10 * SEC)
    row = {r.did: r for r in ms.load_peers(conn)}[alice.did]
    assert (row.last_contact_us, row.last_seen_us) == (NOW_US + 10 * SEC, NOW_US + 30 * SEC)


def test_touch_of_unknown_peer_creates_nothing(conn, alice):
    ms.touch_peer(conn, alice.did, NOW_US)
    assert ms.load_peers(conn) == []


def test_migration_drops_the_sync_cursor_column_and_keeps_the_peers(tmp_path, alice):
    """Version 7 removes the v1 catch-up cursor column; rows written before survive."""
    import sqlite3

    from hmpnode.store import schema

    db = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    assert schema.migrate(db, upto=6) == 6
    db.execute("INSERT INTO peers (did, source, last_seen_us, sync_cursor) VALUES (?, 'lan', ?, '42')",
               (alice.did, NOW_US))
    schema.migrate(db)
    columns = [r[1] for r in db.execute("PRAGMA table_info(peers)")]
    assert "sync_cursor" not in columns
    (row,) = ms.load_peers(db)
    assert (row.did, row.source, row.last_seen_us) == (alice.did, "lan", NOW_US)


# -- containers_after ------------------------------------------------------------------------


def test_containers_after_pages_in_ingest_order(conn, alice, bob):
    made = [make(alice, f"n{i}", recipients=[bob.did]) for i in range(5)]
    seqs = [store(conn, c)[0] for c in made]
    assert seqs == sorted(seqs)
    pages, after = [], 0
    while True:
        page = ms.containers_after(conn, after, 2)
        if not page:
            break
        assert len(page) <= 2
        pages.append([s.seq for s in page])
        after = page[-1].seq
    assert pages == [seqs[0:2], seqs[2:4], seqs[4:5]]
    got = ms.containers_after(conn, 0, 100)
    assert [s.hmp_container for s in got] == [c["hmp_container"] for c in made]
    assert [s.did for s in got] == [c["hmp_container"]["head"]["container_did"] for c in made]
    assert ms.containers_after(conn, seqs[-1], 10) == []
    assert [s.seq for s in ms.containers_after(conn, seqs[1], 1)] == [seqs[2]]


def test_containers_after_skips_conflicts(conn, alice):
    seqs = [store(conn, make(alice, f"n{i}"))[0] for i in range(3)]
    conn.execute("UPDATE containers SET conflict = 1 WHERE seq = ?", (seqs[1],))
    assert [s.seq for s in ms.containers_after(conn, 0, 10)] == [seqs[0], seqs[2]]


# -- relay holdings ---------------------------------------------------------------------------


def test_relay_hold_usage_and_counts(conn, alice, carol):
    assert ms.relay_usage(conn) == (0, 0)
    assert ms.relay_counts(conn) == {"held": 0, "bytes": 0, "recipients": 0, "senders": 0,
                                    "unknown_recipients_held": 0, "unknown_recipients_bytes": 0}
    s1, d1 = store(conn, make(alice, "one", recipients=[carol.did, DAVE]))
    s2, d2 = store(conn, make(alice, "two", recipients=[carol.did]))
    ms.relay_hold(conn, [(carol.did, s1, d1, 100), (carol.did, s2, d2, 50), (DAVE, s1, d1, 100)])
    ms.relay_hold(conn, [(carol.did, s1, d1, 999)])  # already held: ignored
    assert ms.relay_usage(conn, carol.did) == (2, 150)
    assert ms.relay_usage(conn, DAVE) == (1, 100)
    assert ms.relay_usage(conn, "did:hmp:agent:nobody") == (0, 0)
    assert ms.relay_usage(conn) == (3, 250)
    assert ms.relay_counts(conn) == {"held": 3, "bytes": 250, "recipients": 2, "senders": 0,
                                    "unknown_recipients_held": 0, "unknown_recipients_bytes": 0}


def test_relay_list_newest_first_with_sender_and_end(conn, alice, carol):
    """What the dashboard shows of the relay queue (GET /v1/mesh/queues)."""
    (s1, d1), (s2, d2) = (store(conn, make(alice, t, recipients=[carol.did])) for t in ("one", "two"))
    ms.relay_hold(conn, [(carol.did, s1, d1, 100, alice.did, "127.0.0.1", 1, NOW_US + SEC),
                         (carol.did, s2, d2, 50), (DAVE, s1, d1, 100)])
    assert ms.relay_list(conn, 10) == [(carol.did, d2, s2, 50, "", ms.NEVER_US), (carol.did, d1, s1, 100, alice.did,
                                       NOW_US + SEC), (DAVE, d1, s1, 100, "", ms.NEVER_US)]
    assert len(ms.relay_list(conn, 2)) == 2


def test_relay_held_for_pages(conn, alice, carol):
    stored = [store(conn, make(alice, f"n{i}", recipients=[carol.did])) for i in range(3)]
    ms.relay_hold(conn, [(carol.did, s, d, 10) for s, d in stored])
    first = ms.relay_held_for(conn, carol.did, 0, 2)
    assert [s.did for s in first] == [stored[0][1], stored[1][1]]
    assert [s.did for s in ms.relay_held_for(conn, carol.did, first[-1].seq, 2)] == [stored[2][1]]
    assert ms.relay_held_for(conn, DAVE, 0, 10) == []


def test_relay_release_deletes_only_when_nobody_waits(conn, alice, bob, carol):
    seq, did = store(conn, make(bob, "for two", recipients=[carol.did, DAVE]))
    ms.relay_hold(conn, [(carol.did, seq, did, 10), (DAVE, seq, did, 10)])
    assert ms.relay_release(conn, carol.did, [did], alice.did) == 1
    assert held(conn, did)  # dave still waits
    assert ms.relay_usage(conn) == (1, 10)
    assert ms.relay_release(conn, carol.did, [did], alice.did) == 0  # again: nothing left for carol
    assert held(conn, did)
    assert ms.relay_release(conn, DAVE, [did], alice.did) == 1
    assert not held(conn, did)
    assert count(conn, "containers") == 0
    assert count(conn, "recipients") == 0
    assert ms.relay_usage(conn) == (0, 0)


def test_relay_release_of_what_was_never_held_for_that_recipient(conn, alice, bob, carol):
    seq, did = store(conn, make(bob, "x", recipients=[carol.did]))
    ms.relay_hold(conn, [(carol.did, seq, did, 10)])
    assert ms.relay_release(conn, DAVE, [did], alice.did) == 0
    assert ms.relay_release(conn, carol.did, ["did:hmp:container:unknown"], alice.did) == 0
    assert held(conn, did) and ms.relay_usage(conn) == (1, 10)


def test_relay_release_counts_several(conn, alice, bob, carol):
    stored = [store(conn, make(bob, f"n{i}", recipients=[carol.did])) for i in range(3)]
    ms.relay_hold(conn, [(carol.did, s, d, 10) for s, d in stored])
    dids = [d for _, d in stored]
    assert ms.relay_release(conn, carol.did, [dids[0], dids[2], "did:hmp:container:other"], alice.did) == 2
    assert [held(conn, d) for d in dids] == [False, True, False]


def test_relay_release_keeps_the_agents_own(conn, alice, carol):
    seq, did = store(conn, make(alice, "mine", recipients=[carol.did]), source="agent")
    ms.relay_hold(conn, [(carol.did, seq, did, 10)])
    assert ms.relay_release(conn, carol.did, [did], alice.did) == 1
    assert held(conn, did)
    assert ms.relay_usage(conn) == (0, 0)


def test_relay_release_keeps_a_broadcast(conn, alice, bob, carol):
    seq, did = store(conn, make(bob, "all", recipients=[carol.did], broadcast=True))
    ms.relay_hold(conn, [(carol.did, seq, did, 10)])
    assert ms.relay_release(conn, carol.did, [did], alice.did) == 1
    assert held(conn, did)


def test_relay_release_keeps_one_addressed_to_us(conn, alice, bob, carol):
    seq, did = store(conn, make(bob, "us too", recipients=[carol.did, alice.did]))
    ms.relay_hold(conn, [(carol.did, seq, did, 10)])
    assert ms.relay_release(conn, carol.did, [did], alice.did) == 1
    assert held(conn, did)
    assert count(conn, "recipients", "seq = ?", (seq,)) == 2
    # the same container on a node that is not a recipient is only relayed: it goes
    seq2, did2 = store(conn, make(bob, "not us", recipients=[carol.did]))
    ms.relay_hold(conn, [(carol.did, seq2, did2, 10)])
    assert ms.relay_release(conn, carol.did, [did2], alice.did) == 1
    assert not held(conn, did2)


def test_relay_expired(conn, alice, bob, carol):
    soon = make(bob, "soon", recipients=[carol.did, DAVE], ttl=NOW + timedelta(hours=1))
    later = make(bob, "later", recipients=[carol.did], ttl=NOW + timedelta(days=1))
    never = make(bob, "never", recipients=[carol.did])
    (s1, d1), (s2, d2), (s3, d3) = (store(conn, c) for c in (soon, later, never))
    ms.relay_hold(conn, [(carol.did, s1, d1, 10), (DAVE, s1, d1, 10), (carol.did, s2, d2, 20),
                         (carol.did, s3, d3, 30)])
    # what ends by a time, per recipient (the mesh warns of connected ones)
    hour_us, day_us = records.to_us(NOW + timedelta(hours=1)), records.to_us(NOW + timedelta(days=1))
    assert ms.relay_ending(conn, NOW_US) == {}
    assert ms.relay_ending(conn, hour_us) == {carol.did: 1, DAVE: 1}
    assert ms.relay_ending(conn, day_us) == {carol.did: 2, DAVE: 1}
    # nothing expired yet
    assert ms.relay_expired(conn, NOW_US + 30 * 60 * SEC, alice.did) == 0
    assert ms.relay_usage(conn) == (4, 70)
    # exactly at the ttl the container has expired
    assert ms.relay_expired(conn, records.to_us(NOW + timedelta(hours=1)), alice.did) == 2
    assert not held(conn, d1)
    assert held(conn, d2) and held(conn, d3)
    assert ms.relay_usage(conn, carol.did) == (2, 50)
    assert ms.relay_usage(conn, DAVE) == (0, 0)
    # much later: the one with a ttl goes, the one without stays
    assert ms.relay_expired(conn, records.to_us(NOW + timedelta(days=30)), alice.did) == 1
    assert not held(conn, d2) and held(conn, d3)
    assert ms.relay_usage(conn) == (1, 30)


def test_relay_expired_keeps_containers_that_are_ours_or_for_us(conn, alice, bob, carol):
    ttl = NOW + timedelta(minutes=5)
    (s1, d1) = store(conn, make(bob, "for us", recipients=[carol.did, alice.did], ttl=ttl))
    (s2, d2) = store(conn, make(alice, "ours", recipients=[carol.did], ttl=ttl), source="agent")
    (s3, d3) = store(conn, make(bob, "all", recipients=[carol.did], ttl=ttl, broadcast=True))
    ms.relay_hold(conn, [(carol.did, s, d, 1) for s, d in ((s1, d1), (s2, d2), (s3, d3))])
    assert ms.relay_expired(conn, records.to_us(NOW + timedelta(hours=1)), alice.did) == 3
    assert ms.relay_usage(conn) == (0, 0)
    assert held(conn, d1) and held(conn, d2) and held(conn, d3)


def test_relay_expired_ignores_expired_containers_nobody_holds(conn, alice, bob):
    seq, did = store(conn, make(bob, "gone", recipients=[DAVE], ttl=NOW + timedelta(minutes=1)))
    assert ms.relay_expired(conn, records.to_us(NOW + timedelta(hours=1)), alice.did) == 0
    assert held(conn, did)  # not a relay holding: not the relay's to drop


# -- delete_containers ------------------------------------------------------------------------


def test_delete_containers_removes_derived_rows(conn, alice, bob, carol):
    target = make(alice, "target")
    t_seq, t_did = store(conn, target)
    reply = make(bob, "reply", recipients=[carol.did, DAVE], tags=["a", "b"], related={"in_reply_to": t_did})
    r_seq, r_did = store(conn, reply)
    other = make(bob, "other", recipients=[carol.did], tags=["a"], related={"in_reply_to": t_did})
    o_seq, o_did = store(conn, other)
    ms.save_relay_chain(conn, r_seq, [{"node": "x"}])
    ms.save_relay_chain(conn, o_seq, [{"node": "y"}])
    assert count(conn, "tags", "seq = ?", (r_seq,)) == 2
    assert count(conn, "recipients", "seq = ?", (r_seq,)) == 2
    assert records.backlinks_of(conn, t_did) == sorted([("in_reply_to", r_did), ("in_reply_to", o_did)])

    assert ms.delete_containers(conn, [r_did]) == 1
    assert not held(conn, r_did)
    assert count(conn, "tags", "seq = ?", (r_seq,)) == 0
    assert count(conn, "recipients", "seq = ?", (r_seq,)) == 0
    assert count(conn, "links", "source = ?", (r_did,)) == 0
    assert ms.relay_chain_of(conn, r_seq) == []
    # everything of the others is untouched
    assert held(conn, t_did) and held(conn, o_did)
    assert count(conn, "tags", "seq = ?", (o_seq,)) == 1
    assert count(conn, "recipients", "seq = ?", (o_seq,)) == 1
    assert records.backlinks_of(conn, t_did) == [("in_reply_to", o_did)]
    assert ms.relay_chain_of(conn, o_seq) == [{"node": "y"}]


def test_delete_containers_counts(conn, alice):
    dids = [store(conn, make(alice, f"n{i}"))[1] for i in range(3)]
    assert ms.delete_containers(conn, []) == 0
    assert ms.delete_containers(conn, ["did:hmp:container:unknown"]) == 0
    assert ms.delete_containers(conn, dids[:2]) == 2
    assert [held(conn, d) for d in dids] == [False, False, True]
    assert ms.delete_containers(conn, dids[:2]) == 0


# -- relay chains -----------------------------------------------------------------------------


def test_relay_chain_round_trip(conn, alice):
    seq, _ = store(conn, make(alice, "x"))
    assert ms.relay_chain_of(conn, seq) == []
    chain = [{"relay_did": "did:hmp:agent:r1", "timestamp": "2026-11-29T10:15:00Z", "n": 1.5}, ["any", None]]
    ms.save_relay_chain(conn, seq, chain)
    assert ms.relay_chain_of(conn, seq) == chain
    ms.save_relay_chain(conn, seq, [{"relay_did": "did:hmp:agent:r2"}])  # replaced, not appended
    assert ms.relay_chain_of(conn, seq) == [{"relay_did": "did:hmp:agent:r2"}]
    assert ms.relay_chain_of(conn, seq + 1) == []


# -- outbox ------------------------------------------------------------------------------------


def test_outbox_due_order_and_limit(conn, alice, bob, carol):
    (s1, d1), (s2, d2) = (store(conn, make(alice, t, recipients=[bob.did, carol.did]), source="agent")
                          for t in ("one", "two"))
    ms.outbox_add(conn, [(d1, bob.did, s1, NOW_US + 3), (d1, carol.did, s1, NOW_US + 1),
                         (d2, bob.did, s2, NOW_US + 2), (d2, carol.did, s2, NOW_US + 100)])
    assert ms.outbox_count(conn) == 4
    assert ms.outbox_due(conn, NOW_US, 10) == []
    assert ms.outbox_due(conn, NOW_US + 3, 10) == [(d1, carol.did, s1, 0, 0), (d2, bob.did, s2, 0, 0),
                                                   (d1, bob.did, s1, 0, 0)]
    assert ms.outbox_due(conn, NOW_US + 3, 2) == [(d1, carol.did, s1, 0, 0), (d2, bob.did, s2, 0, 0)]
    assert len(ms.outbox_due(conn, NOW_US + 100, 10)) == 4


def test_outbox_wake_makes_what_waits_for_some_recipients_or_all_due_now(conn, alice, bob, carol):
    """A path to a recipient came back (23.3): what waits for it is due at once, whatever
    its retry time; sent entries keep their tries and when they were handed over."""
    (s1, d1), (s2, d2) = (store(conn, make(alice, t, recipients=[bob.did, carol.did]), source="agent")
                          for t in ("one", "two"))
    ms.outbox_add(conn, [(d1, bob.did, s1, NOW_US + 300 * SEC), (d1, carol.did, s1, NOW_US),
                         (d2, bob.did, s2, NOW_US + 5 * SEC), (d2, carol.did, s2, NOW_US + 9 * SEC)])
    ms.outbox_sent(conn, [(NOW_US + 30 * SEC, NOW_US - SEC, d2, bob.did)])
    assert ms.outbox_due(conn, NOW_US, 10) == [(d1, carol.did, s1, 0, 0)]
    assert ms.outbox_wake(conn, NOW_US, [bob.did, DAVE]) == 2
    assert sorted(ms.outbox_due(conn, NOW_US, 10)) == sorted([(d1, carol.did, s1, 0, 0), (d1, bob.did, s1, 0, 0),
                                                              (d2, bob.did, s2, 1, NOW_US - SEC)])
    assert ms.outbox_wake(conn, NOW_US, [bob.did]) == 0  # due already
    plan = " ".join(r[-1] for r in conn.execute(
        "EXPLAIN QUERY PLAN UPDATE outbox SET next_us = ? WHERE next_us > ? AND recipient IN (?)",
        (NOW_US, NOW_US, bob.did)))
    assert "outbox_by_recipient" in plan and "SCAN" not in plan, plan  # one index range per recipient
    assert ms.outbox_wake(conn, NOW_US, None) == 1  # anyone's: carol's second
    assert len(ms.outbox_due(conn, NOW_US, 10)) == 4
    ms.outbox_wait(conn, [(NOW_US + 29 * SEC, d2, bob.did)])  # carried, its ack awaited: tries stay
    assert (d2, bob.did, s2, 1, NOW_US - SEC) not in ms.outbox_due(conn, NOW_US, 10)
    assert (d2, bob.did, s2, 1, NOW_US - SEC) in ms.outbox_due(conn, NOW_US + 29 * SEC, 10)


def test_outbox_list_next_due_first_with_tries(conn, alice, bob, carol):
    """What the dashboard shows of the outbox (GET /v1/mesh/queues)."""
    seq, did = store(conn, make(alice, "x", recipients=[bob.did, carol.did]), source="agent")
    ms.outbox_add(conn, [(did, bob.did, seq, NOW_US + 5), (did, carol.did, seq, NOW_US + 1)])
    ms.outbox_retry(conn, [(NOW_US + 9, did, carol.did)])
    assert ms.outbox_list(conn, 10) == [(did, bob.did, seq, 0, NOW_US + 5), (did, carol.did, seq, 1, NOW_US + 9)]
    assert ms.outbox_list(conn, 1) == [(did, bob.did, seq, 0, NOW_US + 5)]


def test_outbox_add_twice_keeps_the_first(conn, alice, bob):
    seq, did = store(conn, make(alice, "x", recipients=[bob.did]), source="agent")
    ms.outbox_add(conn, [(did, bob.did, seq, NOW_US)])
    ms.outbox_retry(conn, [(NOW_US + 5, did, bob.did)])
    ms.outbox_add(conn, [(did, bob.did, seq, NOW_US)])  # ignored: tries and next_us stay
    assert ms.outbox_count(conn) == 1
    assert ms.outbox_due(conn, NOW_US, 10) == []
    assert ms.outbox_due(conn, NOW_US + 5, 10) == [(did, bob.did, seq, 1, 0)]


def test_outbox_retry_and_done(conn, alice, bob, carol):
    seq, did = store(conn, make(alice, "x", recipients=[bob.did, carol.did]), source="agent")
    ms.outbox_add(conn, [(did, bob.did, seq, NOW_US), (did, carol.did, seq, NOW_US)])
    ms.outbox_retry(conn, [(NOW_US + 10 * SEC, did, bob.did)])
    assert ms.outbox_due(conn, NOW_US, 10) == [(did, carol.did, seq, 0, 0)]
    ms.outbox_retry(conn, [(NOW_US + 30 * SEC, did, bob.did)])
    assert ms.outbox_due(conn, NOW_US + 10 * SEC, 10) == [(did, carol.did, seq, 0, 0)]
    assert ms.outbox_due(conn, NOW_US + 30 * SEC, 10) == [(did, carol.did, seq, 0, 0), (did, bob.did, seq, 2, 0)]
    # retry of an unknown pair changes nothing
    ms.outbox_retry(conn, [(NOW_US, did, DAVE)])
    assert ms.outbox_count(conn) == 2
    ms.outbox_done(conn, [(did, carol.did)])
    assert ms.outbox_count(conn) == 1
    assert ms.outbox_due(conn, NOW_US + 30 * SEC, 10) == [(did, bob.did, seq, 2, 0)]
    ms.outbox_done(conn, [(did, carol.did), (did, bob.did)])
    assert ms.outbox_count(conn) == 0
    assert held(conn, did)  # the outbox is about delivery; the container stays


# -- bans -------------------------------------------------------------------------------------


def test_bans_are_kept_until_they_end_and_bounded(conn):
    ms.save_bans(conn, [("did:hmp:agent:a", 2_000), ("198.51.100.7", 5_000)], 1_000, 10)
    ms.save_bans(conn, [("did:hmp:agent:a", 3_000)], 1_000, 10)  # banned again: the later end stands
    assert ms.load_bans(conn, 1_000) == [("did:hmp:agent:a", 3_000), ("198.51.100.7", 5_000)]
    assert ms.load_bans(conn, 3_000) == [("198.51.100.7", 5_000)]  # an ended ban is deleted
    assert conn.execute("SELECT count(*) FROM bans").fetchone()[0] == 1
    ms.save_bans(conn, [(f"did:hmp:agent:{i}", 10_000 + i) for i in range(5)], 3_000, 3)
    assert [k for k, _ in ms.load_bans(conn, 3_000)] == ["did:hmp:agent:2", "did:hmp:agent:3", "did:hmp:agent:4"]


def test_relay_usage_by_sender_address_and_unknown_recipients(conn, alice, bob, carol):
    s1, d1 = store(conn, make(bob, "one", recipients=[carol.did, DAVE]))
    s2, d2 = store(conn, make(bob, "two", recipients=[carol.did]))
    far = NOW_US + 3600 * SEC
    ms.relay_hold(conn, [(carol.did, s1, d1, 100, bob.did, "192.0.2.1", 1, far),
                         (DAVE, s1, d1, 100, bob.did, "192.0.2.1", 0, far),
                         (carol.did, s2, d2, 50, "did:hmp:agent:other", "", 1, far)])
    usage = ms.relay_usage_of(conn, [carol.did, "did:hmp:agent:nobody"], bob.did, "192.0.2.1")
    assert usage.total == [3, 250] and usage.unknown == [1, 100]
    assert usage.recipients == {carol.did: [2, 150], "did:hmp:agent:nobody": [0, 0]}
    assert usage.senders == {bob.did: [2, 200]} and usage.addresses == {"192.0.2.1": [2, 200]}
    assert ms.relay_usage_of(conn, [], "did:hmp:agent:other", None).addresses == {}
    counts = ms.relay_counts(conn)
    assert (counts["senders"], counts["unknown_recipients_held"], counts["unknown_recipients_bytes"]) == (2, 1, 100)


def test_relay_holdings_end_at_their_hold_limit_and_a_lowered_limit_shortens_them(conn, alice, bob, carol):
    (s1, d1), (s2, d2) = (store(conn, make(bob, t, recipients=[carol.did])) for t in ("a", "b"))
    ms.relay_hold(conn, [(carol.did, s1, d1, 10, bob.did, "", 1, NOW_US + 10 * SEC),
                         (carol.did, s2, d2, 10, bob.did, "", 1, NOW_US + 100 * SEC)])
    assert ms.relay_expired(conn, NOW_US + 9 * SEC, alice.did) == 0
    assert ms.relay_expired(conn, NOW_US + 10 * SEC, alice.did) == 1 and not held(conn, d1)
    assert ms.relay_clamp(conn, NOW_US + 50 * SEC) == 1  # the limit was lowered
    assert ms.relay_clamp(conn, NOW_US + 60 * SEC) == 0  # never lengthened
    assert ms.relay_expired(conn, NOW_US + 50 * SEC, alice.did) == 1 and not held(conn, d2)
    assert ms.relay_usage(conn) == (0, 0)


def test_migration_5_gives_older_holdings_an_end(tmp_path, bob, carol):
    """Holdings made by a version before migration 5 end at their ttl, else 7 days after receipt."""
    from hmpnode.store.schema import current_version

    connection = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    try:
        for number in range(4):
            connection.executescript("BEGIN;" + MIGRATIONS[number] + f"PRAGMA user_version = {number + 1};COMMIT;")
        with_ttl = store_before_9(connection, make(bob, "a", recipients=[carol.did], ttl=NOW + timedelta(hours=1)))
        without = store_before_9(connection, make(bob, "b", recipients=[carol.did]))
        connection.executemany("INSERT INTO relay_queue (recipient, seq, did, size) VALUES (?, ?, ?, 10)",
                               [(carol.did, *with_ttl), (carol.did, *without)])
        assert migrate(connection) == len(MIGRATIONS) and current_version(connection) >= 5
        ends = dict(connection.execute("SELECT did, until_us FROM relay_queue"))
        assert ends == {with_ttl[1]: records.to_us(NOW + timedelta(hours=1)), without[1]: NOW_US + 7 * 86_400 * SEC}
        assert ms.relay_usage_of(connection, [], "", None).senders == {"": [2, 20]}  # no sender recorded
    finally:
        connection.close()


# -- DHT provider records ---------------------------------------------------------------------


def test_provide_keeps_the_newest_on_disk_and_schedules_them(conn, alice):
    """Issue 11: the containers with a provider record are a bounded list on disk,
    the newest by seq; never published ones come first (newest first), then the
    longest due; what is deleted gets no record."""
    rows = [store(conn, make(alice, f"b{n}", broadcast=True), source="agent") for n in range(8)]
    assert ms.provide_add(conn, rows[:3], keep=5) == []
    assert ms.provide_add(conn, rows[:3], keep=5) == []  # again: nothing new
    assert ms.provide_count(conn) == 3 and ms.provide_next_us(conn) == 0
    # five more: the three oldest lose their record
    assert ms.provide_add(conn, rows[3:], keep=5) == [did for _, did in rows[:3]]
    assert ms.provide_count(conn) == 5
    due, gone = ms.provide_due(conn, NOW_US, 3)
    assert due == [rows[7], rows[6], rows[5]] and gone == []
    ms.provide_done(conn, [seq for seq, _ in due], NOW_US + 30 * SEC)
    due, gone = ms.provide_due(conn, NOW_US, 10)
    assert due == [rows[4], rows[3]]
    ms.provide_done(conn, [rows[4][0]], NOW_US + 10 * SEC)
    ms.provide_done(conn, [rows[3][0]], NOW_US + 20 * SEC)
    assert ms.provide_due(conn, NOW_US + 9 * SEC, 10) == ([], [])
    assert ms.provide_next_us(conn) == NOW_US + 10 * SEC
    assert ms.provide_due(conn, NOW_US + 30 * SEC, 10)[0] == [rows[4], rows[3], rows[7], rows[6], rows[5]]
    # a record published while its row went: reported, so that its copy can be dropped
    assert ms.provide_done(conn, [rows[0][0], rows[4][0]], NOW_US + 40 * SEC) == [rows[0][0]]
    # a burst larger than the list: only its newest are listed, the others at once gone
    more = [store(conn, make(alice, f"c{n}", broadcast=True), source="agent") for n in range(7)]
    gone = ms.provide_add(conn, more, keep=5)
    assert sorted(gone) == sorted(did for _, did in rows[3:])
    assert ms.provide_count(conn) == 5
    # a deleted container: its row goes, it is reported, it is not due
    assert ms.delete_containers(conn, [more[6][1]]) == 1
    due, gone = ms.provide_due(conn, NOW_US, 10)
    assert gone == [more[6][1]] and due == [more[5], more[4], more[3], more[2]]
    assert ms.provide_count(conn) == 4
    with pytest.raises(ValueError):
        ms.provide_add(conn, more, keep=0)
