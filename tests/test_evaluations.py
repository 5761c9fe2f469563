"""Evaluation items (profile section 9): build, verify, replay rule, merge, hash."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from datetime import datetime, timedelta, timezone
from itertools import permutations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import b64url_encode, format_time
from hmpnode.container.evaluations import (
    EVALUATION_TYPES,
    EvaluationCheck,
    EvaluationError,
    build_evaluation,
    evaluations_block,
    evaluations_hash,
    is_valid_type,
    kept_form,
    merge_evaluations,
    signed_string,
    verify_evaluation,
)
from hmpnode.identity.keys import Identity
from hmpnode.identity.registry import MemoryKeyRegistry

A = Identity(bytes([1]) * 32)
B = Identity(bytes([2]) * 32)
C = Identity(bytes([3]) * 32)
T0 = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
EVALUATED = "did:hmp:container:QmEvaluated"
OTHER = "did:hmp:container:QmOther"
JUST = "did:hmp:container:QmJustification"


def ev(identity=A, *, value=-0.4, type="oppose", target=EVALUATED, now=T0):
    return build_evaluation(identity, value=value, type=type, target=target, now=now)


def sign(item, identity):
    """Re-sign an item (possibly with a foreign agent_did) with `identity`."""
    out = dict(item)
    out["signature"] = b64url_encode(identity.sign(signed_string(out)))
    return out


def check(item, evaluated=EVALUATED, **kw) -> EvaluationCheck:
    result = verify_evaluation(item, evaluated, **kw)
    assert "unexpected" not in result.detail  # explicit checks, not the catch-all
    assert result.pending == (result.reason == "target_unknown")
    return result


# -- signed string -------------------------------------------------------------


def test_signed_string_layout():
    item = ev()
    assert signed_string(item) == (
        f"-0.4, oppose, {EVALUATED}, 2026-11-29T10:15:00Z, {A.did}".encode()
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [(1, "1"), (1.0, "1"), (-1, "-1"), (0, "0"), (-0.0, "0"), (0.5, "0.5"),
     (-0.4, "-0.4"), (1e-7, "1e-7"), (0.1 + 0.2, "0.30000000000000004")],
)
def test_signed_string_writes_value_as_canonical_json(value, text):
    item = {"value": value, "type": "t", "target": "d", "timestamp": "x", "agent_did": "a"}
    assert signed_string(item) == f"{text}, t, d, x, a".encode()
    assert text.encode() == canonical_json(value)


@pytest.mark.parametrize("value", [True, False, "0.5", None, math.nan, math.inf, [0.5]])
def test_signed_string_rejects_non_numbers(value):
    item = {"value": value, "type": "t", "target": "d", "timestamp": "x", "agent_did": "a"}
    with pytest.raises(EvaluationError):
        signed_string(item)


def test_signed_string_rejects_missing_and_non_string_fields():
    with pytest.raises(EvaluationError):
        signed_string({"value": 1, "type": "t"})
    with pytest.raises(EvaluationError):
        signed_string({"value": 1, "type": 1, "target": "d", "timestamp": "x", "agent_did": "a"})
    with pytest.raises(EvaluationError):
        signed_string({"value": 1, "type": "\ud800", "target": "d", "timestamp": "x", "agent_did": "a"})


# -- types ---------------------------------------------------------------------


def test_types():
    assert EVALUATION_TYPES == ("support", "oppose", "extend", "replace", "comment")
    assert all(is_valid_type(t) for t in EVALUATION_TYPES)
    assert is_valid_type("revise") and is_valid_type("x" * 64) and is_valid_type("a,b")
    for bad in ("", "x" * 65, "a, b", None, 5):
        assert not is_valid_type(bad)


# -- build / verify ------------------------------------------------------------


def test_build_verify_round_trip():
    item = ev()
    assert set(item) == {"value", "type", "target", "timestamp", "agent_did",
                         "public_key", "sig_algo", "signature"}
    assert item["timestamp"] == "2026-11-29T10:15:00Z"
    assert item["agent_did"] == A.did and item["public_key"] == A.public_key_b58
    assert check(item) == EvaluationCheck(True, None, "", False)


def test_round_trip_through_json_text():
    item = ev(value=1.0)
    assert check(orjson.loads(canonical_json(item))).ok  # 1.0 arrives as the integer 1
    assert check(json.loads(json.dumps(ev(value=-0.25)))).ok


def test_millisecond_timestamps():
    item = ev(now=T0 + timedelta(microseconds=123456))
    assert item["timestamp"] == "2026-11-29T10:15:00.123Z"
    assert check(item).ok


@given(
    st.floats(min_value=-1, max_value=1) | st.sampled_from([-1, 0, 1]),
    st.sampled_from(EVALUATION_TYPES) | st.text(min_size=1, max_size=64).filter(lambda t: ", " not in t),
    st.integers(min_value=1, max_value=255),
    st.datetimes(
        min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(timezone.utc)
    ),
)
@settings(max_examples=150, deadline=None)
def test_round_trip_property(value, kind, seed, now):
    ident = Identity(bytes([seed]) * 32)
    item = build_evaluation(ident, value=value, type=kind, target=EVALUATED, now=now)
    assert check(item).ok
    assert check(orjson.loads(orjson.dumps(item))).ok


@pytest.mark.parametrize(
    "kw",
    [
        {"value": 1.5}, {"value": -1.0001}, {"value": True}, {"value": math.nan},
        {"value": "0.5"}, {"type": ""}, {"type": "a, b"}, {"type": "x" * 65},
        {"target": ""}, {"target": "did:a, did:b"}, {"now": datetime(2026, 1, 1)},
    ],
)
def test_build_rejects_bad_arguments(kw):
    with pytest.raises(EvaluationError):
        ev(**kw)


# -- tampering -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("value", 0.4),
        ("value", -0.41),
        ("type", "support"),
        ("target", OTHER),
        ("timestamp", "2026-11-29T10:15:01Z"),
        ("timestamp", "2026-11-29T10:15:00.000Z"),  # same instant, different signed bytes
        ("signature", None),  # filled in below: another valid signature by A
    ],
)
def test_tampered_fields_fail_signature(field, value):
    item = ev()
    item[field] = value if value is not None else ev(value=0.9)["signature"]
    # evaluate against the tampered target too, so that only the signature can fail
    assert check(item, evaluated=item["target"]).reason == "bad_signature"


def test_flipped_signature_bits():
    item = ev()
    sig = item["signature"]
    item["signature"] = ("B" if sig[0] == "A" else "A") + sig[1:]
    assert check(item).reason == "bad_signature"
    for bad in ("", "!!", b64url_encode(b"\x00" * 64), b64url_encode(b"\x01" * 65)):
        item["signature"] = bad
        assert check(item).reason == "bad_signature"


def test_agent_did_of_other_agent_is_key_mismatch():
    item = ev()
    item["agent_did"] = B.did
    assert check(item).reason == "key_mismatch"


def test_public_key_of_other_agent_is_key_mismatch():
    item = ev()
    item["public_key"] = B.public_key_b58
    assert check(item).reason == "key_mismatch"


def test_item_moved_to_other_identity_is_bad_signature():
    item = ev()
    item["agent_did"], item["public_key"] = B.did, B.public_key_b58
    assert check(item).reason == "bad_signature"


def test_sig_algo_is_checked():
    item = ev()
    item["sig_algo"] = "ecdsa"
    assert check(item).reason == "unsupported_sig_algo"


def test_key_from_registry():
    item = ev()
    del item["public_key"]
    assert check(item).reason == "unknown_key"
    reg = MemoryKeyRegistry()
    assert check(item, registry=reg).reason == "unknown_key"
    reg.pin(A.did, A.public_key)
    assert check(item, registry=reg).ok
    wrong = MemoryKeyRegistry()
    wrong.pin(A.did, B.public_key)
    assert check(item, registry=wrong).reason == "key_mismatch"
    assert check(ev(), registry=wrong).reason == "key_mismatch"


def test_opaque_agent_did_uses_pinned_key():
    item = ev()
    item["agent_did"] = "did:example:alice"
    item = sign(item, A)
    assert check(item).ok  # TOFU: the item's own key, nothing pinned
    reg = MemoryKeyRegistry()
    reg.pin("did:example:alice", B.public_key)
    assert check(item, registry=reg).reason == "key_mismatch"
    del item["public_key"]
    assert check(item, registry=reg).reason == "bad_signature"  # B's key, A's signature
    good = MemoryKeyRegistry()
    good.pin("did:example:alice", A.public_key)
    assert check(item, registry=good).ok


def test_revocation_rejects_items_after_it():
    # Same rule as for containers (profile section 4): later timestamps are refused;
    # the revocation instant itself is not "later".
    reg = MemoryKeyRegistry()
    reg.revoke(A.did, T0)
    assert check(ev(now=T0 + timedelta(seconds=1)), registry=reg).reason == "revoked"
    assert check(ev(now=T0), registry=reg).ok
    assert check(ev(now=T0 + timedelta(days=1)), registry=reg).reason == "revoked"
    assert check(ev(now=T0 - timedelta(seconds=1)), registry=reg).ok
    assert check(ev(B), registry=reg).ok


def test_future_timestamp_only_with_now():
    item = ev(now=T0 + timedelta(hours=1))
    assert check(item).ok
    assert check(item, now=T0).reason == "future_timestamp"
    assert check(item, now=T0 + timedelta(minutes=56)).ok  # within the 300 s skew
    assert check(item, now=T0, max_skew=timedelta(hours=2)).ok


@pytest.mark.parametrize(
    "mutate",
    [
        lambda i: i.update(value=1.5),
        lambda i: i.update(value=-2),
        lambda i: i.update(value=True),
        lambda i: i.update(value=None),
        lambda i: i.update(value=math.nan),
        lambda i: i.update(value=math.inf),
        lambda i: i.update(value=10**400),
        lambda i: i.update(timestamp="2026-11-29 10:15:00Z"),
        lambda i: i.update(timestamp="2026-11-29T10:15:00+00:00"),
        lambda i: i.update(timestamp="2026-02-30T10:15:00Z"),
        lambda i: i.update(type="a, b"),
        lambda i: i.update(type="x" * 65),
        lambda i: i.update(type=""),
        lambda i: i.update(target="did:a, did:b"),
        lambda i: i.update(agent_did=""),
        lambda i: i.update(public_key="not base58 0OIl"),
        lambda i: i.update(public_key=5),
        lambda i: i.pop("signature"),
        lambda i: i.pop("sig_algo"),
        lambda i: i.pop("value"),
        lambda i: i.update(agent_did=None),
    ],
)
def test_malformed_items(mutate):
    item = ev()
    mutate(item)
    assert check(item).reason == "malformed"


def test_extra_members_are_ignored_and_not_kept():
    """Spec 3.2 / profile section 13: unknown members do not refuse an item (they did
    before); they are unsigned, so `kept_form` drops them, and the signature's padding."""
    item = ev()
    sent = dict(item, note="unsigned", nested={"x": [1]}, signature=item["signature"] + "=")
    assert check(sent).ok
    assert kept_form(sent) == item
    assert evaluations_hash([kept_form(sent)]) == evaluations_hash([item])
    assert check(dict(sent, value=0.4)).reason == "bad_signature"  # a signed member still counts
    assert check(dict(sent, type="support")).reason == "bad_signature"


@pytest.mark.parametrize("field", ["type", "target", "agent_did", "timestamp", "signature", "public_key"])
def test_lone_surrogates_are_malformed_or_bad_signature(field):
    item = ev()
    item[field] = "x\ud800"
    assert check(item).reason in ("malformed", "bad_signature")
    assert check(item).reason == ("bad_signature" if field == "signature" else "malformed")


def test_evaluated_did_must_be_a_string():
    assert check(ev(), evaluated=None).reason == "malformed"
    assert check(ev(), evaluated="").reason == "malformed"


# -- replay rule ---------------------------------------------------------------


def holding(**containers):
    """resolve() over {did: (sender_did, related)}; keys use _ for ':'."""
    table = {k.replace("_", ":"): v for k, v in containers.items()}
    return table.get


def test_direct_item_does_not_count_for_another_container():
    item = ev(target=EVALUATED)
    assert check(item, evaluated=EVALUATED).ok
    # copied onto OTHER: target is EVALUATED, which A did not author
    resolve = {EVALUATED: (B.did, {})}.get
    assert check(item, evaluated=OTHER, resolve=resolve).reason == "replay"
    assert check(item, evaluated=OTHER, resolve=lambda d: None).reason == "target_unknown"


@pytest.mark.parametrize("relation", ["in_reply_to", "see_also", "contradicts", "x:custom"])
@pytest.mark.parametrize("as_list", [False, True])
def test_justification_by_same_agent_pointing_at_container(relation, as_list):
    related = {relation: [EVALUATED] if as_list else EVALUATED}
    resolve = {JUST: (A.did, related)}.get
    item = ev(target=JUST)
    assert check(item, resolve=resolve).ok
    assert check(item, evaluated=OTHER, resolve=resolve).reason == "replay"


def test_justification_pointing_at_two_containers_counts_for_both():
    # documented residual risk
    resolve = {JUST: (A.did, {"see_also": [EVALUATED, OTHER]})}.get
    item = ev(target=JUST)
    assert check(item, resolve=resolve).ok
    assert check(item, evaluated=OTHER, resolve=resolve).ok


def test_justification_by_another_author_is_replay():
    resolve = {JUST: (B.did, {"in_reply_to": EVALUATED})}.get
    assert check(ev(target=JUST), resolve=resolve).reason == "replay"


@pytest.mark.parametrize("related", [{}, None, [], "did:x", {"in_reply_to": [5, None]}, {"x": OTHER}])
def test_justification_not_pointing_at_container_is_replay(related):
    resolve = {JUST: (A.did, related)}.get
    assert check(ev(target=JUST), resolve=resolve).reason == "replay"


def test_unknown_target_is_pending():
    item = ev(target=JUST)
    for kw in ({}, {"resolve": lambda d: None}):
        result = check(item, **kw)
        assert result == EvaluationCheck(False, "target_unknown", result.detail, True)


def test_pending_only_after_signature_checked():
    item = ev(target=JUST)
    item["value"] = 0.9
    assert check(item).reason == "bad_signature"


def test_odd_resolve_answer_is_replay_not_crash():
    assert check(ev(target=JUST), resolve=lambda d: "garbage").reason == "replay"


# -- merge ---------------------------------------------------------------------


def test_merge_later_timestamp_wins():
    old = ev(value=-0.4, now=T0)
    new = ev(value=0.9, type="support", now=T0 + timedelta(seconds=1))
    assert merge_evaluations([old, new]) == [new]
    assert merge_evaluations([new, old]) == [new]


def test_merge_compares_parsed_times_not_strings():
    # As strings "...:01Z" > "...:01.500Z" ('Z' > '.'), but 01.500 is later.
    whole = ev(value=0.1, now=T0 + timedelta(seconds=1))
    frac = ev(value=0.2, now=T0 + timedelta(seconds=1, milliseconds=500))
    assert whole["timestamp"] > frac["timestamp"]
    assert merge_evaluations([whole, frac]) == [frac]
    assert merge_evaluations([frac, whole]) == [frac]


def test_merge_tie_breaks_by_greater_signature():
    a = ev(value=0.1)
    b = ev(value=0.2)
    assert a["timestamp"] == b["timestamp"] and a["signature"] != b["signature"]
    winner = max(a, b, key=lambda i: i["signature"])
    assert merge_evaluations([a, b]) == [winner]
    assert merge_evaluations([b, a]) == [winner]
    # same instant written differently also ties on time
    c = sign({**ev(value=0.3), "timestamp": "2026-11-29T10:15:00.000Z"}, A)
    winner = max(a, b, c, key=lambda i: i["signature"])
    assert merge_evaluations([c, a, b]) == [winner]


def test_merge_same_signature_with_and_without_public_key_is_deterministic():
    a = ev()
    bare = {k: v for k, v in a.items() if k != "public_key"}
    assert merge_evaluations([a, bare]) == merge_evaluations([bare, a])


def test_merge_one_per_agent_sorted_by_agent_did():
    items = [ev(C), ev(A), ev(B), ev(A, now=T0 - timedelta(days=1))]
    merged = merge_evaluations(items)
    assert [i["agent_did"] for i in merged] == sorted([A.did, B.did, C.did])
    assert all(i["timestamp"] == format_time(T0) for i in merged)


def test_merge_rejects_unverified_garbage():
    with pytest.raises(EvaluationError):
        merge_evaluations([{"agent_did": "x"}])
    with pytest.raises(EvaluationError):
        merge_evaluations([{**ev(), "timestamp": "yesterday"}])


POOL = [
    ev(ident, value=v, now=T0 + timedelta(seconds=s, milliseconds=ms))
    for ident in (A, B, C)
    for v in (-1, 0.5)
    for s in (0, 1)
    for ms in (0, 500)
] + [sign({**ev(A, value=0.7), "timestamp": "2026-11-29T10:15:01.5Z"}, A)]


@given(st.lists(st.sampled_from(POOL), max_size=12), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_merge_is_order_independent(items, rnd):
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert merge_evaluations(shuffled) == merge_evaluations(items)
    assert evaluations_hash(shuffled) == evaluations_hash(items)
    # idempotent and associative with earlier merges
    merged = merge_evaluations(items)
    assert merge_evaluations(merged + shuffled) == merged


def test_merge_all_permutations_small():
    items = [POOL[0], POOL[3], POOL[-1], POOL[9]]
    results = {orjson.dumps(merge_evaluations(list(p))) for p in permutations(items)}
    assert len(results) == 1


# -- evaluations_hash / block --------------------------------------------------


def test_evaluations_block_and_hash():
    items = [ev(B, value=0.5, type="support"), ev(A)]
    blk = evaluations_block(items)
    assert [i["agent_did"] for i in blk["items"]] == sorted([A.did, B.did])
    expected = "sha256:" + hashlib.sha256(canonical_json(blk["items"])).hexdigest()
    assert blk["evaluations_hash"] == expected == evaluations_hash(items)
    assert evaluations_hash(list(reversed(items))) == expected
    # independent serialisation: the items hold only strings and short decimals
    text = json.dumps(blk["items"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert expected == "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_evaluations_hash_is_stable():
    # Ed25519 is deterministic and the identities are fixed, so this is a vector.
    items = [ev(A), ev(B, value=1, type="support", target=JUST)]
    assert evaluations_hash(items) == evaluations_hash(copy.deepcopy(items))
    assert evaluations_hash(items) == STABLE_HASH
    assert evaluations_hash([]) == "sha256:" + hashlib.sha256(b"[]").hexdigest()


STABLE_HASH = "sha256:ce91540a76eff980bad5dc60383f719272fe27cda5889cb2cdfe94dfc39e30d1"


def test_block_changes_when_an_opinion_changes():
    before = evaluations_block([ev(A), ev(B)])
    after = evaluations_block([ev(A), ev(B), ev(B, value=0.1, now=T0 + timedelta(hours=1))])
    assert before["evaluations_hash"] != after["evaluations_hash"]


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
FIELDS = ["value", "type", "target", "timestamp", "agent_did", "public_key", "sig_algo", "signature"]


@given(json_values, json_values)
@settings(max_examples=200, deadline=None)
def test_verify_never_raises_on_random_json(item, evaluated):
    reg = MemoryKeyRegistry()
    result = check(item, evaluated, registry=reg, resolve=lambda d: None)
    assert result.ok is False


@given(st.sampled_from(FIELDS), json_values, json_values)
@settings(max_examples=200, deadline=None)
def test_verify_never_raises_on_mutated_item(field, value, related):
    item = copy.deepcopy(ev(target=JUST))
    item[field] = value
    reg = MemoryKeyRegistry()
    reg.revoke(B.did, T0)
    result = check(item, registry=reg, resolve={JUST: (A.did, related)}.get, now=T0)
    assert isinstance(result.ok, bool)
    if result.ok:
        assert item[field] == ev(target=JUST)[field]
