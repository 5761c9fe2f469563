"""The writer's store layout (issue 15): containers looked up by an integer key of their
DID (schema 9, `records.did_key`), with the DID text compared after the key."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta

import orjson

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from hmpnode.store import forget as forget_db
from hmpnode.store import mesh as ms
from hmpnode.store import records, schema
from hmpnode.store import search as search_db
from hmpnode.store.schema import MIGRATIONS
from tests.conftest import NOW, running_node
from tests import test_store_mesh
from tests.test_store_mesh import DAVE, NOW_US, make, store, store_before_9

conn = test_store_mesh.conn  # the fixture: a migrated store on a real SQLite file


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



def test_migration_12_has_the_index_merge_8_segments_at_a_time_and_search_still_works(tmp_path, alice):
    """Fewer merge passes over small indexer segments (issue 15); FTS5 keeps the setting."""
    connection = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    try:
        assert schema.migrate(connection, upto=11) == 11
        automerge = "SELECT v FROM search_config WHERE k = 'automerge'"
        assert connection.execute(automerge).fetchone() is None  # FTS5's default (4) until then
        seq, _ = store(connection, make(alice, "fulmar"))
        search_db.index_rows(connection, [(seq, "fulmar gliding", "", "note")])
        assert schema.migrate(connection) == len(MIGRATIONS) >= 12
        assert connection.execute(automerge).fetchone() == (8,)
        search_db.index_rows(connection, [(seq + 1, "fulmar nesting", "", "note")])
        assert [r for (r,) in connection.execute("SELECT rowid FROM search WHERE search MATCH 'fulmar'"
                                                 " ORDER BY rowid")] == [seq, seq + 1]
    finally:
        connection.close()



def test_index_rows_replaces_a_row_indexed_already(conn, alice):
    """The insert is a plain one (cheaper); a row with an index row already makes the
    batch replace instead, as OR REPLACE did, and the index stays consistent."""
    first, second = store(conn, make(alice, "razorbill")), store(conn, make(alice, "puffin"))
    search_db.index_rows(conn, [(first[0], "razorbill diving", "", "note")])
    search_db.index_rows(conn, [(second[0], "puffin burrow", "", "note"), (first[0], "razorbill resting", "", "note")])
    match = "SELECT rowid FROM search WHERE search MATCH ? ORDER BY rowid"
    assert [r for (r,) in conn.execute(match, ("diving",))] == []
    assert [r for (r,) in conn.execute(match, ("resting OR burrow",))] == [first[0], second[0]]
    conn.execute("INSERT INTO search (search) VALUES ('integrity-check')")


# -- full-text indexing after the commit (hmpnode.store.indexer) ------------------------------

ME, ALICE = (Identity(bytes([i]) * 32) for i in (60, 61))
#: an indexer that would wait this long to gather rows: only a search cuts it short
SLOW_INDEX = {"index_delay_ms": 600_000}


def note(text, i=0):
    return build_container(ALICE, "note", {"text": text}, now=NOW + timedelta(seconds=i))


async def _indexed(node) -> list[int]:
    return await node.db.read(lambda conn: [s for (s,) in conn.execute("SELECT rowid FROM search ORDER BY rowid")])


async def test_ingest_commits_without_the_index_and_search_still_finds_it(tmp_path):
    async with running_node(ME, tmp_path, **SLOW_INDEX) as node:
        results = await node.ingest([note("albatross migration", 1), note("petrel colonies", 2)])
        assert await _indexed(node) == [] and node.indexer.lag == results[-1].seq  # not in the commit
        found = await asyncio.wait_for(node.search("albatross"), 30)  # does not wait out the window
        assert [i["did"] for i in found["items"]] == [results[0].did]
        assert await _indexed(node) == [r.seq for r in results] and node.indexer.lag == 0
        outcome = await asyncio.wait_for(node.recall("petrel", max_tokens=10_000, max_bytes=100_000), 30)
        assert [c.did for c in outcome.selected] == [results[1].did]


async def test_the_indexer_indexes_on_its_own_after_its_window(tmp_path):
    async with running_node(ME, tmp_path, index_delay_ms=1) as node:
        results = await node.ingest([note(f"gannet {i}", i) for i in range(5)])
        for _ in range(500):  # bounded: the window is 1 ms
            if await _indexed(node) == [r.seq for r in results]:
                break
            await asyncio.sleep(0.01)
        assert await _indexed(node) == [r.seq for r in results] and node.indexer.lag == 0


async def test_rows_committed_but_not_indexed_are_indexed_at_start(tmp_path):
    """A stop (or a crash) between the commit and the indexer leaves rows without an
    index row; the next start indexes them before it serves."""
    async with running_node(ME, tmp_path, **SLOW_INDEX) as node:
        results = await node.ingest([note("cormorant diving", 1), note("shearwater flight", 2)])
        assert await _indexed(node) == []
    async with running_node(ME, tmp_path, **SLOW_INDEX) as node:
        assert await _indexed(node) == [r.seq for r in results] and node.indexer.lag == 0
        assert [i["did"] for i in (await node.search("shearwater"))["items"]] == [results[1].did]


async def test_a_row_forgotten_before_the_indexer_reached_it_is_never_indexed(tmp_path):
    async with running_node(ME, tmp_path, **SLOW_INDEX) as node:
        kept, gone = await node.ingest([note("kittiwake cliffs", 1), note("kittiwake secret", 2)])
        await node.forget(did=gone.did)
        assert [i["did"] for i in (await node.search("kittiwake"))["items"]] == [kept.did]
        assert await _indexed(node) == [kept.seq]


async def test_a_seq_is_never_given_twice_after_the_newest_row_is_forgotten(tmp_path):
    """Before: the next seq was MAX(seq) + 1, so the row after a forgotten newest one took
    its seq again (list cursors and the index watermark then skipped it)."""
    async with running_node(ME, tmp_path) as node:
        (first, newest) = await node.ingest([note("puffin", 1), note("puffin burrow", 2)])
        await node.forget(did=newest.did)
        (after,) = await node.ingest([note("puffin again", 3)])
        assert after.status == "stored" and after.seq > newest.seq
        assert {i["did"] for i in (await node.search("puffin"))["items"]} == {first.did, after.did}


async def test_the_indexer_takes_the_ingested_containers_without_reading_them_back(tmp_path, monkeypatch):
    from hmpnode.store import indexer as indexer_mod

    read_back: list[int] = []
    real = indexer_mod.get_by_seq
    monkeypatch.setattr(indexer_mod, "get_by_seq", lambda conn, seqs: read_back.extend(seqs) or real(conn, seqs))
    async with running_node(ME, tmp_path, **SLOW_INDEX) as node:
        results = await node.ingest([note(f"skua {i}", i) for i in range(3)])
        await node.indexer.caught_up()
        assert await _indexed(node) == [r.seq for r in results] and read_back == []


async def test_the_indexer_does_not_look_into_the_index_for_rows_handed_over(tmp_path, monkeypatch):
    """Rows above the watermark that ingest handed over are not indexed yet: the step takes
    them without the per-row look into the index (`unindexed`); rows it was not handed (at
    start: the repair) are still found that way."""
    looked: list[int] = []
    real = search_db.unindexed
    monkeypatch.setattr(search_db, "unindexed", lambda conn, after, limit: looked.append(after) or real(conn, after, limit))
    async with running_node(ME, tmp_path, **SLOW_INDEX) as node:
        looked.clear()  # the start's repair scan (nothing to repair)
        results = await node.ingest([note(f"storm petrel {i}", i) for i in range(4)])
        await node.indexer.caught_up()
        assert await _indexed(node) == [r.seq for r in results] and looked == []
        more = await node.ingest([note("storm petrel again", 9)])
        node.indexer._fresh.clear()  # as if not handed over (e.g. over the cap)
        assert [i["did"] for i in (await node.search("again"))["items"]] == [more[0].did]
        assert looked == [results[-1].seq]


def test_a_body_handed_over_by_the_verifier_is_stored_as_given(conn, alice):
    """NewContainer.body (VerifyResult.body): the verifier's JSON text is stored, not
    serialised again; it reads back to the same container."""
    container = make(alice, "the verifier's own text")
    hmp = container["hmp_container"]
    text = b'{ "head" : ' + orjson.dumps(hmp["head"]) + b', "payload": ' + orjson.dumps(hmp["payload"]) + b"}"
    (result,) = records.insert_containers(conn, [records.NewContainer(hmp, (), "peer", text)], NOW_US)
    assert result.status == "stored"
    assert conn.execute("SELECT body, size FROM containers WHERE seq = ?", (result.seq,)).fetchone() == (text, len(text))
    assert records.get_by_did(conn, result.did).hmp_container == hmp


def test_provided_after_reads_only_what_gets_a_provider_record(conn, alice):
    """The forward loop of a node without peers: the agent's unscoped broadcasts only, and
    the seq up to which every row was looked at."""
    store(conn, make(alice, "a peer's broadcast", broadcast=True), source="peer:x")
    own = store(conn, make(alice, "the agent's broadcast", broadcast=True), source="agent")
    store(conn, make(alice, "the agent's directed one", recipients=[DAVE]), source="agent")
    newest = store(conn, make(alice, "another of the agent's", broadcast=True), source="agent")
    assert ms.provided_after(conn, 0, 10) == (newest[0], [ms.Stored(*own, "agent", "", True),
                                                          ms.Stored(*newest, "agent", "", True)])
    assert ms.provided_after(conn, 0, 1) == (own[0], [ms.Stored(*own, "agent", "", True)])  # the limit
    assert ms.provided_after(conn, newest[0], 10) == (newest[0], [])


# -- the page size of a new store (store.page_size) ----------------------------------------


def test_store_page_size_is_a_power_of_two_from_4096_to_65536(tmp_path):
    from tests.test_config import error, load

    assert load(tmp_path).store.page_size == 16384
    assert load(tmp_path, env={"HMPNODE_STORE_PAGE_SIZE": "8192"}).store.page_size == 8192
    for bad in ("12288", "2048", "131072"):
        message = error(r"page_size", data_dir=tmp_path, env={"HMPNODE_STORE_PAGE_SIZE": bad})
        assert "power of two 4096..65536" in message


async def test_a_new_store_gets_the_page_size_an_existing_one_keeps_its_own(tmp_path):
    async def page_size(node) -> int:
        return await node.db.read(lambda conn: conn.execute("PRAGMA page_size").fetchone()[0])

    async with running_node(ME, tmp_path / "new") as node:
        assert await page_size(node) == 16384
        (stored,) = await node.ingest([note("guillemot ledge")])
    async with running_node(ME, tmp_path / "old", page_size=4096) as node:
        assert await page_size(node) == 4096
    async with running_node(ME, tmp_path / "old", page_size=16384) as node:
        assert await page_size(node) == 4096  # fixed when the store was created
    async with running_node(ME, tmp_path / "new", page_size=4096) as node:
        assert await page_size(node) == 16384
        assert [i["did"] for i in (await node.search("guillemot"))["items"]] == [stored.did]


# -- the writer connection's page cache (store.writer_cache_mib) ----------------------------


def test_store_writer_cache_mib_is_a_bounded_setting(tmp_path):
    from tests.test_config import error, load

    assert load(tmp_path).store.writer_cache_mib == 64
    assert load(tmp_path, env={"HMPNODE_STORE_WRITER_CACHE_MIB": "16"}).store.writer_cache_mib == 16
    for bad in ("1", "4097", "lots"):
        assert "writer_cache_mib" in error(r"writer_cache_mib", data_dir=tmp_path,
                                           env={"HMPNODE_STORE_WRITER_CACHE_MIB": bad})


async def test_the_writer_connection_gets_its_page_cache_the_readers_keep_the_default(tmp_path):
    """At 100 000 stored SQLite's default 2 MiB made the writer read ~30 KB and write ~24 KB
    per container (issue 15); the cache is the writer's, not each reader's."""
    def cache_size(conn) -> int:
        return conn.execute("PRAGMA cache_size").fetchone()[0]

    async with running_node(ME, tmp_path / "default") as node:
        assert await node.db.write(cache_size) == -64 * 1024
        assert await node.db.read(cache_size) == -2000  # SQLite's default
    async with running_node(ME, tmp_path / "small", writer_cache_mib=8) as node:
        assert await node.db.write(cache_size) == -8 * 1024
        (stored,) = await node.ingest([note("kittiwake cliff")])
        assert stored.status == "stored"
