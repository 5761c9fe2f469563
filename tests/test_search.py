"""Full-text search over the node's containers, with lifecycle states (issue 5, search)."""

from __future__ import annotations

import sqlite3
from datetime import timedelta

import nacl.utils
import pytest

from hmpnode.container.build import Recipient, build_container
from hmpnode.container.evaluations import build_evaluation
from hmpnode.identity import Identity
from hmpnode.memory.index import fts_query, payload_text, query_terms
from hmpnode.net.announce import build_peer_announce
from hmpnode.store.search import SearchQuery

from .conftest import NOW, running_node

ME, ALICE, BOB = (Identity(bytes([i]) * 32) for i in (50, 51, 52))



@pytest.fixture
async def node(tmp_path):
    async with running_node(ME, tmp_path) as n:
        yield n


def note(identity, text, **options):
    return build_container(identity, "note", {"text": text}, now=options.pop("now", NOW), **options)


def test_payload_text_and_queries_are_literal():
    assert payload_text({"b": ["one", {"c": "two"}], "a": 3, "k": "three"}) == "one\ntwo\nthree"
    assert query_terms('Kademlia "DHT" OR NOT* kademlia') == ["kademlia", "dht"]  # stop words dropped
    assert query_terms("or not") == ["or", "not"]  # unless nothing else is left
    assert query_terms("где живёт кот") == ["живёт", "кот"]
    # every term is a quoted literal: FTS syntax in the query is just text
    assert fts_query(["or", 'a"b']) == '"or" OR "a""b"'
    assert fts_query([]) is None


async def test_ranked_hits_with_filters(node):
    relevant = note(ALICE, "The kademlia DHT stores signed peer records; kademlia lookups are iterative",
                    tags=["dht"])
    weaker = note(ALICE, "a note that mentions kademlia once", now=NOW + timedelta(seconds=1))
    other = note(BOB, "nothing to see here about gardening", now=NOW + timedelta(seconds=2))
    await node.ingest([relevant, weaker, other])
    found = await node.search("Kademlia lookups")
    dids = [i["did"] for i in found["items"]]
    assert dids == [relevant["hmp_container"]["head"]["container_did"], weaker["hmp_container"]["head"]["container_did"]]
    top = found["items"][0]
    assert top["matched"] == ["kademlia", "lookups"] and top["state"] == "active" and top["score"] > 0
    assert "[kademlia]" in top["snippet"].lower()
    assert found["items"][1]["matched"] == ["kademlia"]
    # filters
    assert [i["did"] for i in (await node.search("kademlia", SearchQuery("", tag="dht")))["items"]] == dids[:1]
    assert (await node.search("kademlia", SearchQuery("", sender=BOB.did)))["items"] == []
    assert (await node.search("gardening", SearchQuery("", class_="goal")))["items"] == []
    since = node.now_us() + 500_000  # NOW + 0.5 s
    assert [i["did"] for i in (await node.search("kademlia", SearchQuery("", since_us=since)))["items"]] == dids[1:]
    assert (await node.search("   "))["items"] == []


async def test_matched_terms_agree_with_the_store_index(node):
    """matched_terms matches the rows' text in an in-memory copy with the index's tokenizer:
    the same terms per row, in query order, as the store's own index (stemmed forms, OR
    expressions and the tags column included)."""
    from hmpnode.store import search as search_db

    words = ["harbour", "tides", "gull", "beacon"]
    notes = [note(ALICE, " ".join(w for j, w in enumerate(words) if (i >> j) & 1) or "empty",
                  now=NOW + timedelta(seconds=i), tags=["lighthouse"] if i % 5 == 0 else None) for i in range(16)]
    await node.ingest(notes)
    await node.indexer.caught_up()  # indexed after the commit (hmpnode.store.indexer)
    seqs = await node.db.read(lambda conn: [s for (s,) in conn.execute("SELECT rowid FROM search ORDER BY rowid")])
    asked = seqs[3:11]
    terms = ["beacon", "tide", "harbour", "lighthouse", "gull"]
    exprs = ['"beacon"', '"tide"', '"harbour" OR "port"', '"lighthouse"', '"gulls"']

    def truth(conn):
        return {seq: [t for t, e in zip(terms, exprs)
                      if conn.execute("SELECT 1 FROM search WHERE search MATCH ? AND rowid = ?", (e, seq)).fetchone()]
                for seq in asked}

    expected = await node.db.read(truth)
    got = await node.db.read(lambda conn: search_db.matched_terms(conn, terms, asked, exprs))
    assert got == expected and any(len(v) >= 3 for v in expected.values())
    assert any("tide" in v for v in expected.values()) and any("lighthouse" in v for v in expected.values())


async def test_lifecycle_states(node):
    clock = node.clock
    old = note(ALICE, "budget recall plan version one")
    old_did = old["hmp_container"]["head"]["container_did"]
    newer = note(ALICE, "budget recall plan version two", now=NOW + timedelta(seconds=1),
                 related={"previous_version": old_did})
    foreign = note(BOB, "budget recall plan fork by bob", now=NOW + timedelta(seconds=2),
                   related={"previous_version": newer["hmp_container"]["head"]["container_did"]})
    expiring = note(ALICE, "budget recall plan that expires", ttl=NOW + timedelta(minutes=5))
    disputed = note(ALICE, "budget recall plan that is disputed", now=NOW + timedelta(seconds=3))
    disputed_did = disputed["hmp_container"]["head"]["container_did"]
    counter = note(BOB, "no it is wrong", now=NOW + timedelta(seconds=4), related={"contradicts": disputed_did})
    disliked = note(ALICE, "budget recall plan nobody likes", now=NOW + timedelta(seconds=5))
    await node.ingest([old, newer, foreign, expiring, disputed, counter, disliked])
    disliked_did = disliked["hmp_container"]["head"]["container_did"]
    await node.add_evaluation(disliked_did, build_evaluation(BOB, value=-0.5, type="usefulness",
                                                             target=disliked_did, now=NOW))
    clock.now = NOW + timedelta(minutes=10)

    def did(c):
        return c["hmp_container"]["head"]["container_did"]

    found = await node.search("budget recall plan")
    assert {i["did"]: i["state"] for i in found["items"]} == {
        did(old): "superseded",        # the same author wrote version two
        did(newer): "active",          # bob's descendant is a fork, not a supersession
        did(foreign): "active",
        did(expiring): "expired",
        did(disputed): "contested",    # a held container contradicts it
        did(disliked): "contested",    # its evaluations are net negative
    }, found
    only = await node.search("budget recall plan", SearchQuery("", states=("active",)))
    assert {i["state"] for i in only["items"]} == {"active"} and len(only["items"]) == 2
    # a revocation of the sender's key turns all its containers revoked
    revocation = build_peer_announce(ALICE, addresses=[], now=clock.now, key_is_falsified=True)
    (result,) = await node.ingest([revocation])
    assert result.status == "stored"
    after = await node.search("budget recall plan", SearchQuery("", sender=ALICE.did))
    assert {i["state"] for i in after["items"]} == {"revoked"}


async def test_encrypted_text_indexed_only_for_its_recipient(node):
    for_me = build_container(ALICE, "note", {"text": "the secret rendezvous is at dawn"}, now=NOW,
                             encrypt_to=[Recipient(ME.did, ME.public_key)], rng=nacl.utils.random)
    for_bob = build_container(ALICE, "note", {"text": "another secret rendezvous at dusk"}, now=NOW,
                              encrypt_to=[Recipient(BOB.did, BOB.public_key)], rng=nacl.utils.random)
    await node.ingest([for_me, for_bob])
    found = await node.search("rendezvous")
    assert [i["did"] for i in found["items"]] == [for_me["hmp_container"]["head"]["container_did"]]


async def test_compressed_text_is_indexed_off_the_writer_thread(node, monkeypatch):
    """The writer's transaction never decompresses a payload for the index, and neither
    does the indexer: it indexes the text verification took out (issue 15). Before, it
    decompressed the payload a second time on a reader thread."""
    import threading

    from hmpnode.memory import index

    real, threads = index.open_payload, []

    def watched(*a, **k):
        threads.append(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(index, "open_payload", watched)
    packed = build_container(ALICE, "note", {"text": "compressed notes on albatross migration"}, now=NOW,
                             compression="zstd")
    await node.ingest([packed])
    found = await node.search("albatross")
    assert [i["did"] for i in found["items"]] == [packed["hmp_container"]["head"]["container_did"]]
    assert threads == []  # opened once, by verification, never again for the index


async def test_index_backfills_rows_stored_before_it(tmp_path):
    async with running_node(ME, tmp_path) as n:
        await n.ingest([note(ALICE, "an old memory about lighthouses")])
    with sqlite3.connect(tmp_path / "hmpnode.sqlite3") as conn:  # as a store of an older version would be
        conn.execute("DELETE FROM search")
    async with running_node(ME, tmp_path) as again:
        assert len((await again.search("lighthouses"))["items"]) == 1


async def test_a_scope_holding_every_row_scores_as_the_whole_index(node):
    """A scope's BM25 (search.scope_bm25) is FTS5's bm25() over the scope's statistics: with
    every row in the scope, search and recall's index queries (AND, OR, a phrase repeated,
    a two-word phrase, tags) score exactly as FTS5 does over the whole index."""
    import random

    from hmpnode.node import Keep
    from hmpnode.store import search as search_db

    rng = random.Random(5)
    words = "harbour harbours tide gull beacon lantern kelp reef dune".split()
    notes = [note(ALICE, " ".join(rng.choice(words) for _ in range(rng.randint(1, 40 if i % 7 else 200))),
                  now=NOW + timedelta(seconds=i), tags=["reef"] if i % 4 == 0 else None) for i in range(80)]
    await node.ingest(notes, keep=Keep(scope="all"))
    for text in ("harbour", "tide gull", "beacon lantern kelp reef", "dune dunes harbours"):
        plain = await node.search(text, SearchQuery("", limit=100))
        scoped = await node.search(text, SearchQuery("", limit=100, scope="all"))
        assert len(plain["items"]) > 5 and scoped == plain, (text, [(i["seq"], i["score"]) for i in plain["items"]][:6], [(i["seq"], i["score"]) for i in scoped["items"]][:6])
    for match in ('("harbour" OR "harbours") AND (("tide") AND ("gull") OR ("reef") AND ("tide"))',
                  '"kelp" OR "tide gull" OR "kelp"', '("dune") AND ("beacon" OR "lantern")'):
        def both(conn, match=match):
            whole = search_db.ranked(conn, SearchQuery(match, limit=100), 100)
            return whole, search_db.ranked(conn, SearchQuery(match, limit=100, scope="all"), 100)

        whole, scoped = await node.db.read(both)
        assert len(whole) > 3 and scoped == whole, match


async def test_a_scoped_search_ranks_by_the_scopes_statistics(node):
    """Which of two rows ranks first in a scope depends on the scope alone: "kelp" is rare in
    the scope and "tide" common, so the row holding kelp wins there; outside, where kelp is
    everywhere, the row holding tide twice wins."""
    from hmpnode.node import Keep

    kelp, tide = note(ALICE, "kelp and a harbour"), note(ALICE, "tide tide and a harbour", now=NOW + timedelta(seconds=1))
    await node.ingest([kelp, tide], keep=Keep(scope="bay"))
    await node.ingest([note(ALICE, f"tide pool {i}", now=NOW + timedelta(seconds=2 + i)) for i in range(3)],
                      keep=Keep(scope="bay"))
    await node.ingest([note(BOB, f"kelp forest {i}", now=NOW + timedelta(seconds=10 + i)) for i in range(30)])

    def first(found):
        return found["items"][0]["did"]

    assert first(await node.search("kelp tide", SearchQuery("", scope="bay"))) == kelp["hmp_container"]["head"]["container_did"]
    assert first(await node.search("kelp tide harbour")) == tide["hmp_container"]["head"]["container_did"]
