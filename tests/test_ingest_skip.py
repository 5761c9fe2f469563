"""Skip work already done (issue 15): a container the store holds (same DID, same
signature) is answered `duplicate` before it is verified; everything else is verified
in full, as before. Verify calls are counted, not timed."""

from __future__ import annotations

import copy
import threading

import orjson
import pytest

from hmpnode import vectors
from hmpnode.container import reasons as R
from hmpnode.container.build import build_container
from hmpnode.container.peek import head_view
from hmpnode.container.encoding import b64url_encode
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity
from hmpnode.node import Keep, Node, answer_held, duplicate_key
from hmpnode.store.records import Held

from .conftest import NOW, Clock

ME, ALICE = Identity(bytes([50]) * 32), Identity(bytes([51]) * 32)


@pytest.fixture
async def node(tmp_path):
    n = Node(ME, tmp_path, clock=Clock(), batch_wait_ms=0.5)
    await n.start()
    yield n
    await n.stop()


@pytest.fixture
def verify_calls(monkeypatch):
    """Counts Verifier.verify calls in every thread (the node verifies on a pool)."""
    calls = {"n": 0}
    lock = threading.Lock()
    real = Verifier.verify

    def counting(self, raw, **options):
        with lock:
            calls["n"] += 1
        return real(self, raw, **options)

    monkeypatch.setattr(Verifier, "verify", counting)
    return calls


def note(text: str, **options):
    return build_container(ALICE, "note", {"text": text}, now=NOW, tags=["t"], **options)


async def snapshot(node: Node):
    """Everything ingest could change about a container: rows, tags, index, labels."""
    def read(conn):
        return {table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
                for table in ("containers", "tags", "recipients", "links", "evaluations", "memory_sources", "scope_members")}
    return await node.db.read(read)


async def test_held_container_resent_costs_no_verify_call(node, verify_calls):
    first = note("once")
    (stored,) = await node.ingest([first])
    assert stored.status == "stored" and verify_calls["n"] == 1
    again = await node.ingest([copy.deepcopy(first), copy.deepcopy(first)], source="peer:did:hmp:x")
    assert [(r.status, r.seq) for r in again] == [("duplicate", stored.seq)] * 2
    assert verify_calls["n"] == 1  # no verification at all
    assert node.counters["duplicate_unverified"] == 2 and node.counters["verified"] == 1
    assert node.counters["ingest_duplicate"] == 2


async def test_tampered_body_with_held_did_and_signature_is_duplicate_and_changes_nothing(node, verify_calls):
    genuine = note("the real text")
    (stored,) = await node.ingest([genuine])
    before = await snapshot(node)
    forged = copy.deepcopy(genuine)
    hmp = forged["hmp_container"]
    hmp["payload"] = {"text": "forged text"}
    hmp["head"]["tags"] = ["forged"]
    hmp["head"]["broadcast"] = not hmp["head"].get("broadcast", False)
    calls = verify_calls["n"]
    (result,) = await node.ingest([forged], source="peer:did:hmp:mallory")
    assert (result.status, result.did, result.seq) == ("duplicate", stored.did, stored.seq)
    assert verify_calls["n"] == calls
    assert await snapshot(node) == before
    got = await node.get(stored.did)
    assert got["container"]["hmp_container"] == genuine["hmp_container"]


async def test_held_did_with_other_signature_is_verified_in_full(node, verify_calls):
    held = note("held")
    (stored,) = await node.ingest([held])
    other = copy.deepcopy(held)
    other["hmp_container"]["head"]["signature"] = b64url_encode(bytes(64))
    calls = verify_calls["n"]
    (result,) = await node.ingest([other])
    assert (result.status, result.reason) == ("rejected", R.BAD_SIGNATURE)  # the profile's check, in order
    assert verify_calls["n"] == calls + 1 and node.counters["duplicate_unverified"] == 0
    # an opaque DID signed twice: the second copy is verified, and kept apart as a conflict
    base = note("one")["hmp_container"]
    base["head"]["container_did"] = "did:other:container:7"
    vectors.resign(base, ALICE, keep_did=True)
    twin = note("two")["hmp_container"]
    twin["head"]["container_did"] = "did:other:container:7"
    vectors.resign(twin, ALICE, keep_did=True)
    r1, = await node.ingest([{"hmp_container": base}])
    r2, = await node.ingest([{"hmp_container": twin}])
    assert (r1.status, r2.status) == ("stored", "conflict")
    assert verify_calls["n"] == calls + 3
    r3, = await node.ingest([{"hmp_container": copy.deepcopy(twin)}])  # the conflict copy is not the held row
    assert r3.status == "duplicate" and verify_calls["n"] == calls + 4


async def test_resent_with_blocks_is_verified_as_before(node, verify_calls):
    c = note("blocks")
    (stored,) = await node.ingest([c])
    with_block = dict(copy.deepcopy(c), evaluations={"items": []})
    results = await node.ingest([with_block, encode_wire(with_block)])
    assert [r.status for r in results] == ["duplicate", "duplicate"]
    assert verify_calls["n"] == 3 and node.counters["duplicate_unverified"] == 0


async def test_held_container_resent_as_bytes_costs_no_verify_call(node, verify_calls):
    """Wire text (API import items, a single import) is answered from the store like a
    parsed container (docs/protocol.md#rule-import-as-text): its DID and signature read
    from the bytes (peek.head_view); the answer is the held row's."""
    c = note("bytes")
    (stored,) = await node.ingest([c])
    wire = encode_wire(c)
    results = await node.ingest([wire, wire.decode(), orjson.dumps(c, option=orjson.OPT_INDENT_2)])
    assert [(r.status, r.seq) for r in results] == [("duplicate", stored.seq)] * 3
    assert verify_calls["n"] == 1 and node.counters["duplicate_unverified"] == 3
    # what the bytes claim decides nothing else: another signature is verified in full
    other = wire.replace(c["hmp_container"]["head"]["signature"].encode(), b64url_encode(bytes(64)).encode())
    (result,) = await node.ingest([other])
    assert (result.status, result.reason) == ("rejected", R.BAD_SIGNATURE) and verify_calls["n"] == 2


async def test_duplicate_answer_keeps_the_agents_labels(node):
    c = note("labelled")
    (stored,) = await node.ingest([c])
    (again,) = await node.ingest([copy.deepcopy(c)], keep=Keep(source="notes"))
    assert again.status == "duplicate" and node.counters["duplicate_unverified"] == 1
    labels = await node.db.read(lambda conn: conn.execute("SELECT seq, label FROM memory_sources").fetchall())
    assert labels == [(stored.seq, "notes")]


def test_duplicate_key_only_for_parsed_containers_without_taken_blocks():
    c = note("k")
    hmp = c["hmp_container"]
    key = (hmp["head"]["container_did"], hmp["head"]["signature"])
    assert duplicate_key(c) == key
    assert duplicate_key(hmp) == key  # the bare form
    assert duplicate_key(encode_wire(c)) is None  # bytes: read through head_view first
    assert duplicate_key(head_view(encode_wire(c))) == key
    assert duplicate_key(dict(c, **{"referenced-by": {}})) is None
    assert duplicate_key(dict(c, evaluations={})) is None
    assert duplicate_key({"hmp_container": dict(hmp, head=dict(hmp["head"], signature=7))}) is None
    assert duplicate_key({"hmp_container": dict(hmp, head=dict(hmp["head"], signature="A" * 129))}) is None
    assert duplicate_key({"hmp_container": []}) is None


def test_answer_held_takes_the_held_row_never_the_copy():
    held = {"did:a": Held(5, "sig-a", "h", 100, "store_and_forward_for_x"), "did:b": Held(6, "sig-b", "h", None, "")}
    answers = answer_held({0: ("did:a", "sig-a"), 1: ("did:b", "other"), 2: ("did:c", "sig-c"), 3: ("did:b", "sig-b")},
                          held, now_us=100)
    assert sorted(answers) == [0, 3]
    assert (answers[0].seq, answers[0].expired, answers[0].store_and_forward) == (5, True, ["store_and_forward_for_x"])
    assert (answers[3].seq, answers[3].expired, answers[3].store_and_forward) == (6, False, [])
