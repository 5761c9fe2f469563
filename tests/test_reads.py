"""The read path of GET /v1/containers/{did} and of lists (issue 15, reads while
ingesting): a container's view in one statement, the stored body spliced into the
answer, and small reads on the event loop with long ones moved to a reader thread."""

from __future__ import annotations

import asyncio
import sqlite3

import orjson
import pytest

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from hmpnode.node import Node
from hmpnode.store import db as store_db
from hmpnode.store import mesh as mesh_db
from hmpnode.store import records as db
from hmpnode.store.records import ListQuery

from .conftest import NOW, Clock

ME, ALICE, BOB, CAROL = (Identity(bytes([i]) * 32) for i in (50, 51, 52, 53))


def note(identity, text, **options):
    return build_container(identity, "note", {"text": text}, now=NOW, **options)


def did_of(container) -> str:
    return container["hmp_container"]["head"]["container_did"]


async def start(tmp_path, **options) -> Node:
    node = Node(ME, tmp_path, clock=Clock(), batch_wait_ms=0.5, **options)
    await node.start()
    return node


async def test_view_carries_every_block_as_the_separate_reads_do(tmp_path):
    """Backlinks (two, in SQL order), an evaluation item and a relay chain,
    read by the one statement, equal what backlinks_of / evaluations_of /
    relay_chain_of read; the spliced answer serialises to the same bytes as the parsed one."""
    node = await start(tmp_path)
    try:
        target = note(ALICE, "target")
        tdid = did_of(target)
        replies = [note(BOB, "reply", related={"in_reply_to": tdid}),
                   note(CAROL, "see", related={"see_also": tdid})]
        assert [r.status for r in await node.ingest([target, *replies])] == ["stored"] * 3
        await node.evaluate(tdid, type_="support", value=0.5)
        seq = (await node.get(tdid))["seq"]
        chain = [{"relay_did": BOB.did, "note": "ünïcode"}]
        await node.db.write(lambda conn: mesh_db.save_relay_chain(conn, seq, chain))

        def separate(conn):
            return (db.backlinks_of(conn, tdid), db.evaluations_of(conn, tdid), mesh_db.relay_chain_of(conn, seq),
                    db.get_by_did(conn, tdid).hmp_container)

        links, items, stored_chain, hmp = await node.db.read(separate)
        assert len(links) == 2 and len(items) == 1 and stored_chain == chain
        view = await node.db.read(lambda conn: db.view_by_did(conn, tdid))
        assert (view.links, view.evaluations, view.relay_chain) == (links, items, chain)
        assert orjson.loads(view.body) == hmp

        parsed = await node.get(tdid)
        spliced = await node.get(tdid, spliced=True)
        assert isinstance(spliced["container"]["hmp_container"], orjson.Fragment)
        assert orjson.dumps(spliced) == orjson.dumps(parsed)
        assert parsed["container"]["hmp_container"] == hmp
        assert [b["type"] for b in parsed["container"]["referenced-by"]["links"]] == ["in_reply_to", "see_also"]
        assert parsed["container"]["relay_chain"] == chain
        assert len(parsed["container"]["evaluations"]["items"]) == 1

        for query in (ListQuery(), ListQuery(sender=ALICE.did, limit=1)):
            (plain, cursor), (fast, cursor2) = await node.list(query), await node.list(query, spliced=True)
            assert orjson.dumps(plain) == orjson.dumps(fast) and cursor == cursor2
        # the payload of a spliced view can still be opened (it is parsed for that)
        assert "payload" in await node.get(tdid, decrypt=True, spliced=True)
    finally:
        await node.stop()


async def test_small_reads_on_the_loop_long_ones_moved_to_a_reader(tmp_path, monkeypatch):
    node = await start(tmp_path, loop_read_rows=5)
    try:
        notes = [note(ALICE, f"n{i}") for i in range(300)]
        await node.ingest(notes)
        assert (node.db.loop_reads, node.db.loop_reads_moved) == (0, 0)
        await node.get(did_of(notes[7]))
        page, _ = await node.list(ListQuery(sender=ALICE.did, limit=5))
        assert len(page) == 5
        assert (node.db.loop_reads, node.db.loop_reads_moved) == (2, 0)
        # a read that takes more SQLite steps than its rows may (here: 2 per row) is
        # interrupted on the loop and answered in a reader thread, the same
        monkeypatch.setattr(store_db, "LOOP_READ_STEPS_PER_ROW", 2)
        moved, cursor = await node.list(ListQuery(sender=ALICE.did, limit=5))
        assert [p["seq"] for p in moved] == [p["seq"] for p in page] and cursor == page[-1]["seq"]
        assert (node.db.loop_reads, node.db.loop_reads_moved) == (2, 1)
        monkeypatch.undo()
        # a page larger than loop_read_rows goes to a reader thread straight away
        page, _ = await node.list(ListQuery(limit=node.db.loop_read_rows + 1))
        assert len(page) == node.db.loop_read_rows + 1
        assert (node.db.loop_reads, node.db.loop_reads_moved) == (2, 1)
        status = (await node.status())["store"]
        assert (status["loop_reads"], status["loop_reads_moved"]) == (2, 1)
    finally:
        await node.stop()


@pytest.mark.parametrize("rows", [0, 1, 100])
async def test_same_answers_on_the_loop_and_in_the_readers(tmp_path, rows):
    """loop_read_rows = 0 keeps every read in the reader threads, 1 (the default) reads
    GETs on the loop, 100 lists too; the answers are the same."""
    node = await start(tmp_path, loop_read_rows=rows)
    try:
        notes = [note(ALICE if i % 2 else BOB, f"n{i}") for i in range(40)]
        await node.ingest(notes)
        got = [await node.get(did_of(n), spliced=True) for n in notes[:5]]
        assert [g["did"] for g in got] == [did_of(n) for n in notes[:5]]
        page, cursor = await node.list(ListQuery(sender=BOB.did, limit=7), spliced=True)
        assert [orjson.loads(orjson.dumps(p["container"]["hmp_container"])) for p in page] == [
            n["hmp_container"] for n in notes[0:14:2]]
        assert cursor == page[-1]["seq"]
        assert node.db.loop_reads == {0: 0, 1: 5, 100: 6}[rows]
    finally:
        await node.stop()


async def test_event_stream_from_loop_pages_lets_other_tasks_run(tmp_path):
    """With pages read on the loop (loop_read_rows >= the stream's page) a read does not
    suspend; a catching-up event stream must still let the loop's other tasks run."""
    node = await start(tmp_path, loop_read_rows=1000)
    try:
        await node.ingest([note(ALICE, f"n{i}") for i in range(40)])
        ran = []

        async def other():
            ran.append(True)

        task = asyncio.ensure_future(other())
        seen = []
        async for item in node.events(ListQuery(), batch=4, spliced=True):
            seen.append(item["seq"])
            if len(seen) == 40:
                break
        assert ran == [True] and node.db.loop_reads >= 10
        await task
    finally:
        await node.stop()


async def test_loop_read_finding_the_database_busy_is_answered_by_a_reader(tmp_path, monkeypatch):
    """The loop's connection does not wait for a lock (busy_timeout 0): a GET whose read
    fails there (SQLITE_BUSY, here made to) is read again in a reader thread, which waits
    for the lock as every read did, and answered."""
    import threading

    node = await start(tmp_path)
    try:
        target = note(ALICE, "locked out")
        await node.ingest([target])
        loop_thread, real = threading.get_ident(), db.view_by_did

        def busy_on_the_loop(conn, did):
            if threading.get_ident() == loop_thread:
                raise sqlite3.OperationalError("database is locked")
            return real(conn, did)

        monkeypatch.setattr(db, "view_by_did", busy_on_the_loop)
        assert (await node.get(did_of(target)))["did"] == did_of(target)
        assert (node.db.loop_reads, node.db.loop_reads_moved) == (0, 1)
        assert await node.db.read_small(lambda conn: conn.execute("PRAGMA busy_timeout").fetchone()[0], 1) == 0
    finally:
        await node.stop()


async def test_an_import_lets_other_tasks_run_between_slices_of_its_items(tmp_path, monkeypatch):
    """The event loop's per-item pass over a large import (head_view of each item
    before verification) yields every LOOP_SLICE items, so a read that arrives
    meanwhile is answered between slices, not after the whole batch."""
    import hmpnode.node as node_mod

    node = await start(tmp_path)
    try:
        n = node_mod.LOOP_SLICE * 2 + 50
        raws = [orjson.dumps(note(ALICE, f"n{i}")) for i in range(n)]
        calls = 0
        real = node_mod.head_view

        def counting(raw):
            nonlocal calls
            calls += 1
            return real(raw)

        monkeypatch.setattr(node_mod, "head_view", counting)
        seen: list[int] = []
        done = asyncio.Event()

        async def reader():
            for _ in range(100_000):  # bounded; ends once every item went through head_view
                if done.is_set() or calls >= n:
                    return
                seen.append(calls)
                await asyncio.sleep(0)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader has started
        results = await node.ingest(raws)
        done.set()
        await task
        assert [r.status for r in results] == ["stored"] * n
        assert calls == n
        # the reader ran while the pass was part-way, at each slice boundary
        assert {c for c in seen if 0 < c < n} == {node_mod.LOOP_SLICE, 2 * node_mod.LOOP_SLICE}
    finally:
        await node.stop()
