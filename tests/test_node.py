"""The node's ingest path and upkeep, on a real database, without HTTP."""

from __future__ import annotations

import asyncio
import copy
import sqlite3
from datetime import timedelta

import pytest

from hmpnode.container import reasons as R
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.did import container_did_for
from hmpnode.container.encoding import b64url_encode
from hmpnode.container.evaluations import build_evaluation
from hmpnode.container.verify import encode_wire
from hmpnode.identity import Identity
from hmpnode import vectors
from hmpnode.node import Node, NodeError
from hmpnode.store.records import ListQuery

from .conftest import NOW, Clock

ME, ALICE, BOB = (Identity(bytes([i]) * 32) for i in (40, 41, 42))
GOAL = {"title": "t", "description": "d", "priority": 0.5, "expected_outcome": "x"}



@pytest.fixture
async def node(tmp_path):
    clock = Clock()
    n = Node(ME, tmp_path, clock=clock, batch_wait_ms=0.5)
    n.test_clock = clock
    await n.start()
    yield n
    await n.stop()


def note(identity, text="hi", **options):
    return build_container(identity, "note", {"text": text}, now=options.pop("now", NOW), **options)


def resign(hmp, identity):
    return {"hmp_container": vectors.resign(hmp, identity)}


async def test_ingest_results_in_order(node):
    a, b = note(ALICE, "a"), note(ALICE, "b")
    results = await node.ingest([encode_wire(a), b"{}", a, b])
    assert [r.status for r in results] == ["stored", "rejected", "duplicate", "stored"]
    assert results[1].reason == R.SCHEMA
    assert node.rejections[R.SCHEMA] == 1


async def test_links_made_in_either_arrival_order(node):
    parent = note(ALICE, "parent")
    pdid = parent["hmp_container"]["head"]["container_did"]
    reply = note(BOB, "reply", related={"in_reply_to": pdid})
    await node.ingest([reply])  # the reply arrives first
    await node.ingest([parent])
    got = await node.get(pdid)
    block = got["container"]["referenced-by"]
    assert block["links"] == [{"type": "in_reply_to", "target": reply["hmp_container"]["head"]["container_did"]}]
    assert block["peer_did"] == ME.did
    from hmpnode.container.backlinks import verify_referenced_by

    assert verify_referenced_by(block).ok


async def test_backlinks_from_peers_are_hints_until_confirmed(node):
    parent = note(ALICE, "parent")
    pdid = parent["hmp_container"]["head"]["container_did"]
    from hmpnode.container.backlinks import build_referenced_by

    fake_source = container_did_for(b"never seen")
    full = dict(parent, **{"referenced-by": build_referenced_by([{"type": "see_also", "target": fake_source}], BOB)})
    await node.ingest([full])
    hints = await node.db.read(lambda c: c.execute("SELECT target, relation, source FROM backlink_hints").fetchall())
    assert hints == [(pdid, "see_also", fake_source)]
    assert "referenced-by" not in (await node.get(pdid))["container"]  # a hint is not a link


async def test_evaluations_own_foreign_pending_and_replay(node):
    target = note(ALICE, "evaluated")
    tdid = target["hmp_container"]["head"]["container_did"]
    await node.ingest([target])
    own = await node.evaluate(tdid, type_="support", value=0.5)
    assert own["status"] == "active"
    # bob justifies his opposition in a container that points at the target...
    justification = note(BOB, "because", related={"in_reply_to": [tdid]})
    jdid = justification["hmp_container"]["head"]["container_did"]
    item = build_evaluation(BOB, value=-0.4, type="oppose", target=jdid, now=NOW)
    assert await node.add_evaluation(tdid, item) == "pending"  # justification not held yet
    await node.ingest([justification])
    block = await node.evaluations(tdid)
    assert {i["agent_did"] for i in block["items"]} == {ME.did, BOB.did}
    # the same item replayed onto another container is refused
    other = note(ALICE, "another")
    await node.ingest([other])
    with pytest.raises(NodeError) as err:
        await node.add_evaluation(other["hmp_container"]["head"]["container_did"], item)
    assert err.value.reason == "replay"
    # a later item by the same agent replaces the earlier one
    node.test_clock.now = NOW + timedelta(minutes=1)
    await node.evaluate(tdid, type_="oppose", value=-1)
    items = (await node.evaluations(tdid))["items"]
    assert [i["type"] for i in items if i["agent_did"] == ME.did] == ["oppose"]


async def test_versions_and_forks(node):
    v1 = note(ALICE, "v1")
    d1 = v1["hmp_container"]["head"]["container_did"]
    v2 = note(ALICE, "v2", related={"previous_version": d1})
    d2 = v2["hmp_container"]["head"]["container_did"]
    v3a = note(ALICE, "v3a", related={"previous_version": [d2]})
    v3b = note(ALICE, "v3b", related={"previous_version": [d2]})
    foreign = note(BOB, "bob's take", related={"previous_version": d1})
    await node.ingest([v1, v2, v3a, v3b, foreign])
    versions = await node.versions(d1)
    assert set(versions["latest"]) == {v3a["hmp_container"]["head"]["container_did"], v3b["hmp_container"]["head"]["container_did"]}
    assert set(versions["forks"]) == {d1, d2}
    assert versions["foreign"] == [foreign["hmp_container"]["head"]["container_did"]]


async def test_expired_stored_but_not_current(node):
    c = note(ALICE, "short-lived", ttl=NOW + timedelta(minutes=1))
    (r,) = await node.ingest([c])
    assert r.status == "stored" and not r.expired
    node.test_clock.now = NOW + timedelta(minutes=2)
    assert (await node.get(r.did))["expired"] is True
    current, _ = await node.list(ListQuery())
    assert r.did not in {i["did"] for i in current}
    expired, _ = await node.list(ListQuery(expired=True))
    assert [i["did"] for i in expired] == [r.did]


async def test_tofu_pin_survives_restart_and_blocks_substitution(tmp_path):
    n = Node(ME, tmp_path)
    await n.start()
    first = note(ALICE, "x")
    hmp = first["hmp_container"]
    hmp["head"]["sender_did"] = "did:other:alice"
    await n.ingest([resign(hmp, ALICE)])
    await n.stop()
    n = Node(ME, tmp_path)
    await n.start()
    impostor = note(BOB, "y")
    h2 = impostor["hmp_container"]
    h2["head"]["sender_did"] = "did:other:alice"
    (r,) = await n.ingest([resign(h2, BOB)])
    assert (r.status, r.reason) == ("rejected", R.KEY_MISMATCH)
    await n.stop()


async def test_two_first_keys_in_one_batch(node):
    a = note(ALICE, "a")["hmp_container"]
    b = note(BOB, "b")["hmp_container"]
    a["head"]["sender_did"] = b["head"]["sender_did"] = "did:other:same"
    results = await node.ingest([resign(a, ALICE), resign(b, BOB)])
    assert sorted(r.status for r in results) == ["rejected", "stored"]


async def test_revocation_by_peer_announce(node):
    revoke = build_container(ALICE, "peer_announce", {"addresses": [], "key_is_falsified": True}, now=NOW)
    (r,) = await node.ingest([revoke])
    assert r.status == "stored"
    later = note(ALICE, "after", now=NOW + timedelta(seconds=1))
    node.test_clock.now = NOW + timedelta(seconds=2)
    (r2,) = await node.ingest([later])
    assert (r2.status, r2.reason) == ("rejected", R.REVOKED)


async def test_opaque_did_conflict_kept_apart(node):
    base = note(ALICE, "one")["hmp_container"]
    base["head"]["container_did"] = "did:other:container:42"
    unsigned = dict(base, head={k: v for k, v in base["head"].items() if k != "signature"})
    base["head"]["signature"] = b64url_encode(ALICE.sign(canonical_json(unsigned)))
    twin = note(ALICE, "two")["hmp_container"]
    twin["head"]["container_did"] = "did:other:container:42"
    unsigned = dict(twin, head={k: v for k, v in twin["head"].items() if k != "signature"})
    twin["head"]["signature"] = b64url_encode(ALICE.sign(canonical_json(unsigned)))
    results = await node.ingest([{"hmp_container": base}, {"hmp_container": twin}, {"hmp_container": base}])
    assert [r.status for r in results] == ["stored", "conflict", "duplicate"]
    got = await node.get("did:other:container:42")
    assert got["container"]["hmp_container"]["payload"] == {"text": "one"}


async def test_opaque_did_repadded_signature_is_a_duplicate_not_a_conflict(node):
    """Padding is ignored on input (profile section 13) and head.signature is not signed:
    a relay that re-pads it must not make a second container under one opaque DID."""
    base = note(ALICE, "one")["hmp_container"]
    base["head"]["container_did"] = "did:other:container:43"
    unsigned = dict(base, head={k: v for k, v in base["head"].items() if k != "signature"})
    base["head"]["signature"] = b64url_encode(ALICE.sign(canonical_json(unsigned)))
    padded = copy.deepcopy(base)
    padded["head"]["signature"] += "=="
    results = await node.ingest([{"hmp_container": base}, {"hmp_container": padded}])
    assert [r.status for r in results] == ["stored", "duplicate"]
    (again,) = await node.ingest([{"hmp_container": dict(padded, head=dict(padded["head"], signature=padded["head"]["signature"] + "="))}])
    assert again.status == "duplicate"


async def test_opaque_did_held_with_padding_by_an_older_version_is_a_duplicate(node):
    """Rows stored before schema 9 kept head.signature as received, padding included: an
    unpadded copy of such a container is the same container, not a conflict."""
    base = note(ALICE, "one")["hmp_container"]
    base["head"]["container_did"] = "did:other:container:44"
    unsigned = dict(base, head={k: v for k, v in base["head"].items() if k != "signature"})
    base["head"]["signature"] = b64url_encode(ALICE.sign(canonical_json(unsigned)))
    (first,) = await node.ingest([{"hmp_container": base}])
    assert first.status == "stored"
    await node.db.write(lambda conn: conn.execute(
        "UPDATE containers SET signature = signature || '==' WHERE seq = ?", (first.seq,)))
    (again,) = await node.ingest([{"hmp_container": copy.deepcopy(base)}])
    assert (again.status, again.seq) == ("duplicate", first.seq)
    assert await node.db.read(lambda conn: conn.execute(
        "SELECT COUNT(*) FROM containers WHERE did = ?", (base["head"]["container_did"],)).fetchone()[0]) == 1


async def test_evaluation_extras_are_ignored_and_not_kept(node):
    """An item with members beyond the signed ones (spec 3.2) counts; the extras and the
    signature's padding are not kept, so a relay cannot vary the stored item or its hash.
    Refused as malformed before profile section 13."""
    c = note(ALICE, "judged")
    did = c["hmp_container"]["head"]["container_did"]
    item = build_evaluation(BOB, value=0.5, type="support", target=did, now=NOW)
    sent = dict(item, comment="unsigned, relay-editable", signature=item["signature"] + "==")
    (r,) = await node.ingest([dict(c, evaluations={"evaluations_hash": "sha256:" + "0" * 64, "items": [sent]})])
    assert r.status == "stored" and r.evaluations == {"active": 1}
    block = await node.evaluations(did)
    assert block["items"] == [item]
    forged = dict(sent, value=-0.5)  # a signed member changed: still refused
    other = note(ALICE, "judged too")
    forged["target"] = other["hmp_container"]["head"]["container_did"]
    (r2,) = await node.ingest([dict(other, evaluations={"items": [forged]})])
    assert r2.status == "stored" and r2.evaluations == {"bad_signature": 1}


def _broken(class_, payload, *, sender=ALICE):
    """A container of a known class whose payload breaks the class schema, signed."""
    c = build_container(sender, "note", payload, now=NOW)["hmp_container"]
    c["head"]["class"] = class_
    return resign(c, sender)


async def test_class_schema_mismatch_from_a_peer_is_stored_and_flagged(node):
    """A peer's container of a class the node only stores for agents is kept and relayed
    unchanged, flagged class_schema (it was rejected before); the same from the local
    agent, and any class the node acts on, is still refused."""
    goal = _broken("goal", {"title": 5})
    (r,) = await node.ingest([goal], source="peer:did:hmp:agent:p")
    assert (r.status, r.store_and_forward) == ("stored", ["class_schema"])
    got = await node.get(r.did)
    assert got["container"]["hmp_container"] == goal["hmp_container"]
    assert "class_schema" in got["store_and_forward"]
    (mine,) = await node.ingest([_broken("task", {"title": 5})])
    assert (mine.status, mine.reason) == ("rejected", R.CLASS_SCHEMA)
    for class_ in ("vote", "peer_announce", "consensus_result", "container_index"):
        (acted,) = await node.ingest([_broken(class_, {"target_did": 5, "addresses": 5, "x": 5})],
                                     source="peer:did:hmp:agent:p")
        assert (acted.status, acted.reason) == ("rejected", R.CLASS_SCHEMA), class_


async def test_encrypted_for_me_decrypts(node):
    c = build_container(ALICE, "note", {"text": "secret"}, now=NOW, rng=lambda n: bytes(n),
                        encrypt_to=[Recipient(ME.did, ME.public_key)])
    (r,) = await node.ingest([c])
    got = await node.get(r.did, decrypt=True)
    assert got["payload"] == {"text": "secret"}
    mine, _ = await node.list(ListQuery(recipient=ME.did))
    assert [i["did"] for i in mine] == [r.did]


async def test_list_filters_and_cursor(node):
    cs = [note(ALICE if i % 2 else BOB, f"n{i}", tags=["even" if i % 2 == 0 else "odd"]) for i in range(25)]
    await node.ingest(cs)
    seen, cursor = [], 0
    for _ in range(10):
        page, nxt = await node.list(ListQuery(tag="even", limit=5, after_seq=cursor))
        seen += [i["did"] for i in page]
        if nxt is None:
            break
        cursor = nxt
    evens = [c["hmp_container"]["head"]["container_did"] for i, c in enumerate(cs) if i % 2 == 0]
    assert seen == evens
    by_alice, _ = await node.list(ListQuery(sender=ALICE.did, limit=100))
    assert len(by_alice) == 12


async def test_events_resume_from_cursor(node):
    await node.ingest([note(ALICE, "before")])
    stream = node.events(ListQuery(after_seq=0))
    first = await asyncio.wait_for(stream.__anext__(), 30)
    assert first["container"]["hmp_container"]["payload"] == {"text": "before"}
    waiting = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await node.ingest([note(ALICE, "live")])
    live = await asyncio.wait_for(waiting, 30)
    assert live["container"]["hmp_container"]["payload"] == {"text": "live"}
    await stream.aclose()
    resumed = node.events(ListQuery(after_seq=first["seq"]))
    again = await asyncio.wait_for(resumed.__anext__(), 30)
    assert again["seq"] == live["seq"]
    await resumed.aclose()


async def test_schema_is_migrated_and_versioned(node):
    path = node.db.path
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == node.db.schema_version >= 1
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
