"""The journal through the node (issue 5, journal): append, verify, selective load, anchor."""

from __future__ import annotations

from datetime import date, timedelta

import pytest

from hmpnode.identity import Identity
from hmpnode.memory import journal
from hmpnode.node import NodeError
from hmpnode.store.mesh import delete_containers
from hmpnode.store.records import ListQuery, list_containers

from .conftest import NOW, running_node

ME = Identity(bytes([70]) * 32)



@pytest.fixture
async def node(tmp_path):
    async with running_node(ME, tmp_path) as n:
        yield n


async def test_append_verify_load_and_anchor(node):
    texts = ["woke up and checked the queue", "checked the queue again", "checked the queue again",
             "a strange packet from an unknown relay appeared in the queue",
             "the relay turned out to be a misconfigured test node"]
    added = []
    for i, text in enumerate(texts):
        node.clock.now = NOW + timedelta(minutes=i)
        added.append(await node.journal_add(text))
    assert [a["journal_seq"] for a in added] == [1, 2, 3, 4, 5]
    assert added[2]["novelty"] == journal.ROUTINE and added[3]["novelty"] != journal.ROUTINE
    report = await node.journal_verify()
    assert report.ok and report.count == 5 and report.head_did == added[-1]["did"]
    loaded = await node.journal_load(10_000)
    assert [e["journal_seq"] for e in loaded] == [i + 1 for i, a in enumerate(added) if a["novelty"] != "routine"]
    assert await node.journal_load(1) == []
    # the anchor of a finished day commits to its entries; anyone holding them can check it
    node.clock.now = NOW + timedelta(days=1)
    anchor = await node.journal_anchor(NOW.date())
    assert anchor["status"] == "stored" and anchor["anchor"]["count"] == 5
    stored = (await node.get(anchor["did"]))["container"]
    entries = await node._journal_containers()
    assert journal.check_anchor(stored, entries)[0]
    with pytest.raises(NodeError) as err:
        await node.journal_anchor(date(2030, 1, 1))  # not over yet
    assert err.value.status == 422


async def test_a_broken_chain_is_named_and_blocks_appending(node):
    for i in range(3):
        node.clock.now = NOW + timedelta(minutes=i)
        await node.journal_add(f"entry number {i} about lighthouses")
    # an entry of the journal disappears from the store (as a corrupted copy would lose it)
    rows = await node.db.read(lambda conn: [r.did for r in list_containers(conn, ListQuery(tag="journal"),
                                                                           node.now_us())])
    second = rows[1]
    await node.db.write(lambda conn: delete_containers(conn, [second]))
    report = await node.journal_verify()
    assert not report.ok and report.first_problem.kind == journal.MISSING
    with pytest.raises(NodeError) as err:
        await node.journal_add("one more")
    assert err.value.reason == "journal_broken" and err.value.status == 409


async def test_appends_reuse_the_checked_chain_until_its_rows_change(node, monkeypatch):
    """Each append verifies the new entry only, not the whole chain again (O(n) per
    append would make a long journal quadratic); the check runs off the event loop;
    an explicit verify always checks every entry; rows changed behind the node's
    back (an entry deleted, or one appended elsewhere) make the next append check all."""
    import threading

    calls: list[tuple[int, str]] = []
    real = journal.verify_chain

    def counting(entries, **kw):
        calls.append((len(entries), threading.current_thread().name))
        return real(entries, **kw)

    monkeypatch.setattr(journal, "verify_chain", counting)
    for i in range(12):
        node.clock.now = NOW + timedelta(minutes=i)
        await node.journal_add(f"entry {i} on tide tables and harbour {i}")
        await node.journal_load(10_000)
    assert [n for n, _ in calls] == [0]  # the empty journal, checked once
    assert calls[0][1] != threading.current_thread().name
    report = await node.journal_verify()
    assert report.ok and report.count == 12 and len(calls) == 2 and calls[-1][0] == 12

    # an entry appended elsewhere (same agent, a stale copy of the chain: a fork)
    stale = journal.Journal(ME, report.chain[:11])
    node.clock.now = NOW + timedelta(minutes=30)
    fork = stale.append("a second device wrote this", now=node.clock.now)
    (stored,) = await node.ingest([fork], source="agent")
    assert stored.status == "stored"
    with pytest.raises(NodeError) as err:
        await node.journal_add("after the fork")
    assert err.value.reason == "journal_broken" and "forked" in err.value.detail
    assert calls[-1][0] == 13


async def test_a_deleted_entry_is_noticed_by_the_next_append(node):
    for i in range(3):
        node.clock.now = NOW + timedelta(minutes=i)
        await node.journal_add(f"entry number {i} about lighthouses")
    entries = await node._journal_containers()
    first = entries[0]["hmp_container"]["head"]["container_did"]
    await node.db.write(lambda conn: delete_containers(conn, [first]))
    with pytest.raises(NodeError) as err:
        await node.journal_add("one more")
    assert err.value.reason == "journal_broken"
