"""What ingest reads before verification, from bytes (hmpnode.container.peek): the same
answers as from the parsed object, for every input (docs/protocol.md#rule-import-as-text)."""

from __future__ import annotations

import copy

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container import inflight
from hmpnode.container.build import build_container
from hmpnode.container.peek import head_view
from hmpnode.container.verify import encode_wire
from hmpnode.identity import Identity
from hmpnode.node import _did_of, duplicate_key

from .conftest import NOW

ALICE = Identity(bytes([61]) * 32)
LIMIT = 16 * 1024 * 1024


def _answers(raw):
    """What ingest reads of a container before verifying it."""
    return duplicate_key(raw), _did_of(raw), inflight.decompressed_cost(raw, LIMIT)


def _same(text: bytes) -> None:
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = None
    view = head_view(text)
    if parsed is None:
        # not JSON to the strict reader (a number beyond float range, invalid UTF-8 where
        # msgspec skips): verification refuses it; the view, if any, answers only for
        # the DID and signature it claims, as for a tampered copy
        # (protocol.md#rule-duplicate-before-verification)
        assert view is None or isinstance(view, dict)
        return
    if not isinstance(parsed, dict):
        assert view is None
        return
    assert _answers(view) == _answers(parsed), text[:300]
    assert _answers(head_view(text.decode("utf-8"))) == _answers(view)


def test_text_with_lone_surrogates_is_no_view():
    """A str holding a lone surrogate (no UTF-8 text) gives no view and raises nothing
    (msgspec raised UnicodeEncodeError for it); verification refuses it as malformed."""
    for text in ('{"head":{"container_did":"\ud800"}}', "\ud800", '{"hmp_container":{"head":{"signature":"\udfff"}}}'):
        assert head_view(text) is None


def _containers():
    c = build_container(ALICE, "note", {"text": "hello"}, now=NOW, tags=["t"])
    z = build_container(ALICE, "note", {"text": "z" * 5000}, now=NOW, compression="zstd")
    g = build_container(ALICE, "note", {"text": "g" * 3000}, now=NOW, compression="gzip")
    return [c, z, g]


def test_wire_text_reads_as_the_parsed_container():
    for c in _containers():
        hmp = c["hmp_container"]
        head = hmp["head"]
        variants = [
            c, hmp, dict(c, evaluations={"items": []}), dict(c, **{"referenced-by": {}}), dict(hmp, evaluations=[]),
            {"hmp_container": None}, {"hmp_container": "x"}, {"hmp_container": []}, {"hmp_container": {}},
            {"hmp_container": dict(hmp, head=None)}, {"hmp_container": dict(hmp, head="h")},
            {"hmp_container": dict(hmp, head=dict(head, signature=7))},
            {"hmp_container": dict(hmp, head=dict(head, container_did=["x"]))},
            {"hmp_container": dict(hmp, head=dict(head, container_did="d" * 513))},
            {"hmp_container": dict(hmp, head=dict(head, signature="A" * 129))},
            {"hmp_container": dict(hmp, head=dict(head, payload_type=5))},
            {"hmp_container": dict(hmp, payload=None)}, {"hmp_container": dict(hmp, payload=[1])},
            {"hmp_container": {k: v for k, v in hmp.items() if k != "payload"}},
            dict(hmp, head="no object"), {"head": head}, {"payload": "x"},
            {"hmp_container": hmp, "head": "ignored beside hmp_container"},
        ]
        for v in variants:
            _same(orjson.dumps(v))
            _same(encode_wire(v) if isinstance(v.get("hmp_container", v), dict) and "hmp_container" in v
                  and isinstance(v["hmp_container"].get("head"), dict) else orjson.dumps(v, option=orjson.OPT_INDENT_2))
    wire = encode_wire(_containers()[0])
    head = _containers()[0]["hmp_container"]["head"]
    assert duplicate_key(head_view(wire)) == (head["container_did"], head["signature"])
    # the last of duplicate keys counts, as for the parsed object
    _same(wire[:-1] + b',"hmp_container":{"head":{"container_did":"d","signature":"s"}}}')
    _same(wire[:-1] + b',"evaluations":1,"evaluations":2}')
    # escapes in a compressed payload's text are read as the parser reads them
    z = copy.deepcopy(_containers()[1])
    text = orjson.dumps(z).replace(z["hmp_container"]["payload"][:2].encode(),
                                   "".join(f"\\u{ord(ch):04x}" for ch in z["hmp_container"]["payload"][:2]).encode(), 1)
    _same(text)
    for text in (b"42", b'"x"', b"[1]", b"null", b"{", b"", b"{}", b'{"a":1e999}', b'{"head":{"a":"\xff"}}',
                 b"[" * 2000 + b"]" * 2000, b'{"x":' + b"[" * 1010 + b"]" * 1010 + b"}"):
        _same(text)


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_keys = st.sampled_from(["hmp_container", "head", "payload", "evaluations", "referenced-by", "container_did",
                         "signature", "payload_type", "x"])


def _shaped(depth: int):
    value = _json if depth == 0 else st.one_of(_json, _shaped(depth - 1))
    return st.dictionaries(_keys, value, max_size=6)


@settings(max_examples=400, deadline=None)
@given(doc=_shaped(3), payload_type=st.sampled_from(["json", "text", "json+zstd", "json+gzip", 7]),
       payload=st.sampled_from(["KLUv_QBYUQAAeHh4", "H4sIAAAAAAAAA0tMBAB0_JJEAwAAAA", "!!", "", 3]))
def test_any_document_reads_as_the_parsed_one(doc, payload_type, payload):
    _same(orjson.dumps(doc))
    container = {"hmp_container": {"head": {"container_did": "did:x", "signature": "s", "payload_type": payload_type},
                                   "payload": payload}}
    _same(orjson.dumps(container))
    _same(orjson.dumps(dict(container["hmp_container"], **doc)))


async def test_an_import_of_wire_text_is_planned_as_the_parsed_one(tmp_path):
    """The decompressed budget of a batch of bytes counts the sizes the payloads declare,
    as for parsed containers (before: each object text cost the whole per-container
    limit, so a batch of compressed containers as text was refused past the first few)."""
    from hmpnode.node import Node

    from .conftest import Clock

    node = Node(Identity(bytes([62]) * 32), tmp_path, clock=Clock(), batch_wait_ms=0.5)
    await node.start()
    try:
        notes = [build_container(ALICE, "note", {"i": i, "text": "a" * 3_000_000}, now=NOW, compression="zstd")
                 for i in range(10)]
        budget = 7_000_000  # two of five fit
        plan = [("stored", None)] * 2 + [("rejected", "over_budget")] * 3
        results = await node.ingest([encode_wire(c) for c in notes[:5]], budget=budget)
        assert [(r.status, r.reason) for r in results] == plan
        assert [r.did for r in results] == [c["hmp_container"]["head"]["container_did"] for c in notes[:5]]
        parsed = await node.ingest(notes[5:], budget=budget)  # the same plan for parsed containers
        assert [(r.status, r.reason) for r in parsed] == plan
    finally:
        await node.stop()
