"""The writer's store layout (issue 15): containers looked up by an integer key of their
DID (schema 9, `records.did_key`), with the DID text compared after the key."""

from __future__ import annotations

import sqlite3

import pytest

from hmpnode.store import forget as forget_db
from hmpnode.store import records, schema
from hmpnode.store import search as search_db
from hmpnode.store.schema import MIGRATIONS, migrate
from tests.test_store_mesh import NOW_US, make, store, store_before_9


@pytest.fixture
def conn(tmp_path):
    connection = sqlite3.connect(tmp_path / "db", isolation_level=None)
    assert migrate(connection) == len(MIGRATIONS)
    try:
        yield connection
    finally:
        connection.close()


def _indexes(conn) -> set[str]:
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                             " AND tbl_name = 'containers'")}


def test_did_key_is_a_signed_64_bit_integer_and_stable():
    key = records.did_key("did:hmp:container:abc")
    assert key == records.did_key("did:hmp:container:abc") and -(2 ** 63) <= key < 2 ** 63
    assert key != records.did_key("did:hmp:container:abd")


def test_migration_9_fills_the_key_of_rows_stored_before_it(tmp_path, alice, bob):
    connection = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    try:
        assert schema.migrate(connection, upto=8) == 8
        assert "containers_by_did" in _indexes(connection)
        old = [store_before_9(connection, make(who, f"before {who.did[-4:]}")) for who in (alice, bob)]
        assert schema.migrate(connection) == len(MIGRATIONS) >= 9
        keys = dict(connection.execute("SELECT did, did_key FROM containers"))
        assert keys == {did: records.did_key(did) for _, did in old}
        assert "containers_by_did_key" in _indexes(connection) and "containers_by_did" not in _indexes(connection)
        for seq, did in old:
            assert records.get_by_did(connection, did).seq == seq
        assert {d: h.seq for d, h in records.held_of(connection, [d for _, d in old]).items()} == {d: s for s, d in old}
        # a DID lookup uses the new index, not a scan
        plan = " ".join(r[-1] for r in connection.execute(
            "EXPLAIN QUERY PLAN SELECT seq FROM containers WHERE did_key = ? AND did = ?", (1, "x")))
        assert "containers_by_did_key" in plan
    finally:
        connection.close()


def test_two_dids_with_one_key_both_work(conn, alice, bob, monkeypatch):
    """Every DID hashes to one key: each lookup still finds its own container only."""
    monkeypatch.setattr(records, "did_key", lambda did: 42)
    first = make(alice, "the first")
    second = make(bob, "the second", related={"previous_version": first["hmp_container"]["head"]["container_did"]})
    third = make(alice, "the third")
    rows = [store(conn, c) for c in (first, second, third)]
    assert {k for (k,) in conn.execute("SELECT DISTINCT did_key FROM containers")} == {42}
    for seq, did in rows:
        assert records.get_by_did(conn, did).seq == seq and records.is_held(conn, did)
        assert records.seqs_of(conn, did) == [seq]
    assert records.get_by_did(conn, "did:hmp:container:not-held") is None
    held = records.held_of(conn, [rows[0][1], rows[2][1], "did:hmp:container:not-held"])
    assert {d: h.seq for d, h in held.items()} == {rows[0][1]: rows[0][0], rows[2][1]: rows[2][0]}
    # dedupe compares the DID: the same container again is a duplicate, a new one is stored
    again = records.insert_containers(conn, [records.NewContainer(c["hmp_container"], (), "peer")
                                             for c in (first, make(bob, "a fourth"))], NOW_US)
    assert [i.status for i in again] == ["duplicate", "stored"] and again[0].seq == rows[0][0]
    # joins through links: related_to, the version chain
    related = records.list_containers(conn, records.ListQuery(related_to=rows[0][1]), NOW_US)
    assert [r.seq for r in related] == [rows[1][0]]
    assert [child for child, _, _ in records.descendants_of(conn, rows[0][1])] == [rows[1][1]]
    # bob's previous_version does not supersede alice's container; alice's third one, with
    # the same key as bob's, must not be taken for the link's source
    (state,) = conn.execute(f"SELECT {search_db.LIFECYCLE_SQL} FROM containers c WHERE c.seq = :seq",
                            {"now": NOW_US, "seq": rows[0][0]}).fetchone()
    assert state == "active"
    # forgetting one leaves the others that share its key
    assert forget_db.forget(conn, NOW_US, did=rows[2][1]).erased == 1
    assert records.get_by_did(conn, rows[2][1]) is None
    assert records.get_by_did(conn, rows[0][1]).seq == rows[0][0]
    assert records.get_by_did(conn, rows[1][1]).seq == rows[1][0]
