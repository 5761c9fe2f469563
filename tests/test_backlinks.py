"""referenced-by blocks (profile section 8): build, verify, merge."""

from __future__ import annotations

import copy
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.backlinks import (
    BacklinkCheck,
    build_referenced_by,
    links_from_related,
    merge_referenced_by,
    read_links,
    referenced_by_hash,
    sort_links,
    verify_referenced_by,
)
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import b64url_encode, sha256_tag
from hmpnode.identity.keys import Identity
from hmpnode.identity.registry import MemoryKeyRegistry

A = Identity(bytes([1]) * 32)
B = Identity(bytes([2]) * 32)
C1 = "did:hmp:container:C1"
LINKS = [
    {"type": "see_also", "target": "did:hmp:container:C4"},
    {"type": "depends_on", "target": "did:hmp:container:C3"},
    {"type": "depends_on", "target": "did:hmp:container:C2"},
    {"type": "in_reply_to", "target": "did:hmp:container:C6"},
]


def block(links=LINKS, identity=A):
    return build_referenced_by(links, identity)


def resign(b, identity=A, *, peer_did=None):
    """Re-sign `b` over its (possibly altered) links, keeping their order."""
    body = canonical_json(b["links"])
    out = dict(b)
    out["signature"] = b64url_encode(identity.sign(body))
    out["referenced-by_hash"] = sha256_tag(body)
    out["public_key"] = identity.public_key_b58
    out["peer_did"] = peer_did or identity.did
    return out


def check(b, **kw) -> BacklinkCheck:
    result = verify_referenced_by(b, **kw)
    # Hostile input is handled by explicit checks, not by the catch-all.
    assert "unexpected" not in result.detail
    return result


# -- links_from_related ------------------------------------------------------


def test_links_from_related_accepts_strings_and_arrays():
    related = {
        "previous_version": "did:hmp:container:abc122",
        "see_also": ["did:hmp:container:ctx-31", "did:hmp:container:goal-953"],
        "depends_on": ["did:hmp:container:goal-953", "did:hmp:container:goal-953"],
    }
    assert links_from_related("did:hmp:container:me", related) == [
        ("depends_on", "did:hmp:container:goal-953"),
        ("previous_version", "did:hmp:container:abc122"),
        ("see_also", "did:hmp:container:ctx-31"),
        ("see_also", "did:hmp:container:goal-953"),
    ]


def test_links_from_related_skips_junk_and_self_references():
    related = {
        "see_also": ["did:x", 5, None, {"a": 1}, ["nested"], "", "did:me"],
        "extends": 7,
        "in_reply_to": "did:me",
        "": "did:y",
    }
    assert links_from_related("did:me", related) == [("see_also", "did:x")]


@pytest.mark.parametrize("related", [None, [], "did:x", 3, True])
def test_links_from_related_non_object(related):
    assert links_from_related("did:me", related) == []


# -- sort_links ----------------------------------------------------------------


def test_sort_links_dedupes_and_sorts():
    dup = LINKS + [dict(LINKS[0]), ("depends_on", "did:hmp:container:C2")]
    assert sort_links(dup) == [
        {"type": "depends_on", "target": "did:hmp:container:C2"},
        {"type": "depends_on", "target": "did:hmp:container:C3"},
        {"type": "in_reply_to", "target": "did:hmp:container:C6"},
        {"type": "see_also", "target": "did:hmp:container:C4"},
    ]


def test_sort_links_uses_code_point_order():
    links = [{"type": "t", "target": "\U0001f600"}, {"type": "t", "target": "\ufb01"}]
    # UTF-16 order would put U+1F600 (surrogates D83D...) first; code point order does not.
    assert [link["target"] for link in sort_links(links)] == ["\ufb01", "\U0001f600"]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "t"},
        {"type": "t", "target": "d", "x": 1},
        {"type": 1, "target": "d"},
        {"type": "", "target": "d"},
        ("t",),
        "t,d",
    ],
)
def test_sort_links_rejects_bad_links(bad):
    with pytest.raises(ValueError):
        sort_links([bad])


# -- build / verify ------------------------------------------------------------


def test_build_verify_round_trip():
    b = block()
    assert b["links"] == sort_links(LINKS)
    assert b["peer_did"] == A.did and b["public_key"] == A.public_key_b58
    assert b["sig_algo"] == "ed25519"
    assert b["referenced-by_hash"] == sha256_tag(canonical_json(b["links"]))
    assert b["referenced-by_hash"] == referenced_by_hash(b["links"])
    assert check(b) == BacklinkCheck(True, None, "")
    assert check(block([])).ok


def test_build_is_deterministic():
    assert block() == block(list(reversed(LINKS)))


def test_round_trip_through_json_text():
    import orjson

    b = block()
    assert check(orjson.loads(canonical_json(b))).ok


@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=12), st.text(min_size=1, max_size=24)),
        max_size=12,
    ),
    st.integers(min_value=1, max_value=255),
)
@settings(max_examples=100, deadline=None)
def test_round_trip_property(pairs, seed):
    ident = Identity(bytes([seed]) * 32)
    b = build_referenced_by(pairs, ident)
    assert check(b).ok
    assert len(b["links"]) == len(set(pairs))


def test_tamper_links_keeping_hash_is_hash_mismatch():
    b = block()
    b["links"] = b["links"][:-1]
    assert check(b).reason == "hash_mismatch"


def test_tamper_links_with_fresh_hash_is_bad_signature():
    b = block()
    b["links"] = b["links"][:-1]
    b["referenced-by_hash"] = sha256_tag(canonical_json(b["links"]))
    assert check(b).reason == "bad_signature"


def test_tamper_hash_is_hash_mismatch():
    b = block()
    b["referenced-by_hash"] = "sha256:" + "0" * 64
    assert check(b).reason == "hash_mismatch"
    b["referenced-by_hash"] = b["referenced-by_hash"].upper()
    assert check(b).reason == "hash_mismatch"


def test_unsorted_links_are_accepted_as_signed():
    """Spec 3.16.3/3.16.4 never require an order (profile section 13): the hash and
    signature are checked over the links as sent. Refused as malformed before."""
    b = block()
    b["links"] = list(reversed(b["links"]))
    b = resign(b)
    assert check(b).ok
    assert read_links(b["links"]) == read_links(block()["links"])


def test_reordering_signed_links_is_hash_mismatch():
    """Order is covered by the hash and the signature: a relay cannot reorder a block."""
    b = block()
    b["links"] = list(reversed(b["links"]))
    assert check(b).reason == "hash_mismatch"
    b["referenced-by_hash"] = referenced_by_hash(b["links"])
    assert check(b).reason == "bad_signature"


def test_duplicate_links_count_once():
    b = block()
    b["links"] = [b["links"][0], b["links"][0], *b["links"][1:]]
    assert check(resign(b)).ok
    assert read_links(b["links"]) == read_links(block()["links"])


def test_grouped_and_compact_forms_of_spec_12_3():
    """12.3.1 grouped and 12.3.2 compact links verify as signed and read as the same pairs."""
    canonical = read_links(LINKS)
    grouped = [{"type": "see_also", "target": ["did:hmp:container:C4"]},
               {"type": "depends_on", "target": ["did:hmp:container:C3", "did:hmp:container:C2"]},
               {"type": "in_reply_to", "target": "did:hmp:container:C6"}]
    compact = {"depends_on": ["did:hmp:container:C2", "did:hmp:container:C3"],
               "see_also": ["did:hmp:container:C4"], "in_reply_to": ["did:hmp:container:C6"]}
    for links in (grouped, compact):
        b = resign(dict(block(), links=links))
        assert check(b).ok, links
        assert read_links(links) == canonical
        tampered = copy.deepcopy(b)
        if isinstance(links, dict):
            tampered["links"]["see_also"].append("did:hmp:container:C9")
        else:
            tampered["links"][0]["target"].append("did:hmp:container:C9")
        assert check(tampered).reason == "hash_mismatch"
    confirm, calls = _confirm_from({key: True for key in canonical})
    merged = merge_referenced_by(C1, [], [resign(dict(block(), links=compact))], confirm)
    assert [(link["type"], link["target"]) for link in merged.links] == canonical


@pytest.mark.parametrize("links", [
    {"depends_on": "did:hmp:container:C2"},  # a compact value is an array
    {"depends_on": []},
    [{"type": "depends_on", "target": []}],
    [{"type": "depends_on", "target": ["did:1", 5]}],
    [{"type": "depends_on", "target": ["did:1", ""]}],
    {"": ["did:1"]},
])
def test_unreadable_link_forms_are_malformed_even_if_signed(links):
    assert check(resign(dict(block(), links=links))).reason == "malformed"


def test_extra_link_member_is_malformed():
    b = block()
    b["links"][0]["note"] = "x"
    assert check(resign(b)).reason == "malformed"


def test_peer_did_of_other_agent_is_key_mismatch():
    b = block()
    b["peer_did"] = B.did
    assert check(b).reason == "key_mismatch"


def test_public_key_of_other_agent_is_key_mismatch():
    b = block()
    b["public_key"] = B.public_key_b58
    assert check(b).reason == "key_mismatch"


def test_block_moved_to_other_identity_is_bad_signature():
    b = block()
    b["peer_did"], b["public_key"] = B.did, B.public_key_b58
    assert check(b).reason == "bad_signature"


def test_sig_algo_is_checked():
    b = block()
    b["sig_algo"] = "rsa"
    assert check(b).reason == "unsupported_sig_algo"


@pytest.mark.parametrize(
    "signature",
    [
        lambda s: s[:-2] + ("AA" if s[-2:] != "AA" else "BA"),
        lambda s: "",
        lambda s: "not base64!",
        lambda s: b64url_encode(b"\x00" * 64),
        lambda s: b64url_encode(b"\x00" * 63),
        lambda s: block([])["signature"],
    ],
)
def test_signature_tamper_is_bad_signature(signature):
    b = block()
    b["signature"] = signature(b["signature"])
    assert check(b).reason == "bad_signature"


def test_padded_signature_is_accepted():
    b = block()
    b["signature"] += "=="
    assert check(b).ok


def test_opaque_did_uses_pinned_key():
    reg = MemoryKeyRegistry()
    b = resign(block(), A, peer_did="did:example:node-a")
    assert check(b).ok  # nothing pinned yet: trust on first use is the caller's job
    assert check(b, registry=reg).ok
    reg.pin("did:example:node-a", B.public_key)
    assert check(b, registry=reg).reason == "key_mismatch"
    reg2 = MemoryKeyRegistry()
    reg2.pin("did:example:node-a", A.public_key)
    assert check(b, registry=reg2).ok


def test_revoked_peer_is_rejected():
    reg = MemoryKeyRegistry()
    reg.revoke(A.did, datetime(2026, 1, 1, tzinfo=timezone.utc))
    assert check(block(), registry=reg).reason == "revoked"
    assert check(block(identity=B), registry=reg).ok


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("links"),
        lambda b: b.pop("signature"),
        lambda b: b.pop("referenced-by_hash"),
        lambda b: b.update(links={"type": "t", "target": "d"}),
        lambda b: b.update(links=[["t", "d"]]),
        lambda b: b.update(links=[{"type": "t", "target": 5}]),
        lambda b: b.update(public_key=5),
        lambda b: b.update(public_key="0OIl"),
        lambda b: b.update(public_key=B.public_key_b58[:-3]),
        lambda b: b.update(peer_did=""),
        lambda b: b.update(sig_algo=None),
    ],
)
def test_malformed_blocks(mutate):
    b = block()
    mutate(b)
    assert check(b).reason == "malformed"


def test_too_many_links_is_malformed():
    b = build_referenced_by([("t", f"did:{i:04d}") for i in range(20)], A)
    assert check(b).ok
    assert check(b, max_links=19).reason == "malformed"


def test_lone_surrogate_is_malformed():
    b = block()
    b["links"] = [{"type": "t", "target": "\ud800"}]
    assert check(b).reason == "malformed"


# -- merge ---------------------------------------------------------------------


def _confirm_from(truth: dict):
    calls = []

    def confirm(relation, source, container):
        calls.append((relation, source, container))
        return truth.get((relation, source))

    return confirm, calls


def test_merge_keeps_confirmed_drops_false_reports_pending():
    local = [{"type": "see_also", "target": "did:L"}]
    received = build_referenced_by(
        [("depends_on", "did:T"), ("depends_on", "did:F"), ("in_reply_to", "did:P"), ("see_also", "did:L")],
        B,
    )
    confirm, calls = _confirm_from({("depends_on", "did:T"): True, ("depends_on", "did:F"): False})
    result = merge_referenced_by(C1, local, [received], confirm)
    assert result.links == [
        {"type": "depends_on", "target": "did:T"},
        {"type": "see_also", "target": "did:L"},
    ]
    assert result.dropped == [{"type": "depends_on", "target": "did:F"}]
    assert result.pending == [{"type": "in_reply_to", "target": "did:P"}]
    assert result.rejected == []
    # local links are not re-confirmed; every confirmation names the container
    assert ("see_also", "did:L", C1) not in calls
    assert all(c == C1 for _, _, c in calls)


def test_merge_asks_once_per_link_across_blocks():
    b1 = build_referenced_by([("x", "did:1"), ("x", "did:2")], A)
    b2 = build_referenced_by([("x", "did:2"), ("x", "did:3")], B)
    confirm, calls = _confirm_from({("x", "did:1"): True, ("x", "did:2"): True, ("x", "did:3"): True})
    result = merge_referenced_by(C1, [], [b1, b2], confirm)
    assert [link["target"] for link in result.links] == ["did:1", "did:2", "did:3"]
    assert sorted(calls) == [("x", "did:1", C1), ("x", "did:2", C1), ("x", "did:3", C1)]


def test_merge_ignores_unverified_blocks():
    good = build_referenced_by([("x", "did:good")], A)
    forged = build_referenced_by([("x", "did:forged")], B)
    forged["peer_did"] = A.did  # claims to come from A
    garbage = {"links": "nope"}
    confirm, calls = _confirm_from({("x", "did:good"): True, ("x", "did:forged"): True})
    result = merge_referenced_by(C1, [], [good, forged, garbage, None], confirm)
    assert result.links == [{"type": "x", "target": "did:good"}]
    assert [r.reason for r in result.rejected] == ["key_mismatch", "malformed", "malformed"]
    assert calls == [("x", "did:good", C1)]


def test_merge_non_boolean_verdict_drops():
    b = build_referenced_by([("x", "did:1")], A)
    result = merge_referenced_by(C1, [], [b], lambda *a: 1)
    assert result.links == [] and result.dropped == [{"type": "x", "target": "did:1"}]


def test_merge_result_round_trips_through_build():
    b = build_referenced_by([("x", "did:1")], A)
    result = merge_referenced_by(C1, [("a", "did:0")], [b], lambda *a: True)
    assert check(build_referenced_by(result.links, B)).ok


# -- hostile input -------------------------------------------------------------

# Includes lone surrogates (which JSON text can carry as escapes) and the ", " separator.
any_text = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    | st.sampled_from([",", " "]),
    max_size=12,
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(any_text, kids, max_size=4),
    max_leaves=20,
)
FIELDS = ["links", "peer_did", "public_key", "sig_algo", "signature", "referenced-by_hash"]


@given(json_values)
@settings(max_examples=200, deadline=None)
def test_verify_never_raises_on_random_json(value):
    result = check(value, registry=MemoryKeyRegistry())
    assert result.ok is False and result.reason == "malformed"


@given(st.sampled_from(FIELDS), json_values)
@settings(max_examples=200, deadline=None)
def test_verify_never_raises_on_mutated_block(field, value):
    b = copy.deepcopy(block())
    b[field] = value
    result = check(b, registry=MemoryKeyRegistry())
    assert isinstance(result.ok, bool)


@given(st.lists(json_values, max_size=4))
@settings(max_examples=100, deadline=None)
def test_verify_never_raises_on_random_links(links):
    b = copy.deepcopy(block())
    b["links"] = links
    assert not check(b).ok


@given(json_values)
@settings(max_examples=100, deadline=None)
def test_links_from_related_never_raises(value):
    for pair in links_from_related("did:me", value):
        assert isinstance(pair[0], str) and isinstance(pair[1], str)
