"""Relay chain (profile section 11): hmpnode.net.relay."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.encoding import b58encode, b64url_encode
from hmpnode.identity.keys import Identity, agent_did_for_key
from hmpnode.identity.registry import MemoryKeyRegistry
from hmpnode.net.relay import ENTRY_MEMBERS, RelayCheck, append_relay, signed_string, verify_relay_chain

R1 = Identity(bytes([11]) * 32)
R2 = Identity(bytes([12]) * 32)
R3 = Identity(bytes([13]) * 32)
T0 = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
T1 = T0 + timedelta(seconds=1, milliseconds=250)
FULL = {"hmp_container": {"head": {"version": "5.0"}, "payload": {"x": 1}}, "referenced-by": {"links": []}}


def two_hops() -> dict:
    return append_relay(append_relay(FULL, R1, now=T0), R2, now=T1)


def chain() -> list[dict]:
    return copy.deepcopy(two_hops()["relay_chain"])


def resign(entry: dict, identity: Identity) -> dict:
    entry = dict(entry)
    entry["signature"] = b64url_encode(identity.sign(signed_string(entry["timestamp"], entry["relay_did"])))
    return entry


def test_round_trip_two_relays():
    snapshot = copy.deepcopy(FULL)
    one = append_relay(FULL, R1, now=T0)
    two = append_relay(one, R2, now=T1)
    assert FULL == snapshot and "relay_chain" not in FULL  # input not mutated
    assert len(one["relay_chain"]) == 1  # nor the intermediate result
    assert two["hmp_container"] == FULL["hmp_container"] and two["referenced-by"] == FULL["referenced-by"]
    c = two["relay_chain"]
    assert [e["relay_did"] for e in c] == [R1.did, R2.did]
    assert c[0] == {
        "relay_did": R1.did,
        "timestamp": "2026-11-29T10:15:00Z",
        "sig_algo": "ed25519",
        "public_key": R1.public_key_b58,
        "signature": b64url_encode(R1.sign(f"2026-11-29T10:15:00Z, {R1.did}".encode())),
    }
    assert c[1]["timestamp"] == "2026-11-29T10:15:01.250Z"
    assert verify_relay_chain(c) == RelayCheck(True, None, "", None)
    assert verify_relay_chain([]).ok


def test_append_refuses_bad_input():
    with pytest.raises(ValueError):
        append_relay({"head": {}, "payload": {}}, R1, now=T0)  # bare form
    with pytest.raises(ValueError):
        append_relay({**FULL, "relay_chain": {}}, R1, now=T0)
    with pytest.raises(ValueError):
        append_relay(FULL, R1, now=T0.replace(tzinfo=None))


def tampered(index: int, **changes) -> list[dict]:
    c = chain()
    c[index].update(changes)
    return c


@pytest.mark.parametrize("name,bad,reason,index", [
    ("timestamp", lambda: tampered(0, timestamp="2026-11-29T10:15:02Z"), "bad_signature", 0),
    ("timestamp_form", lambda: tampered(1, timestamp="2026-11-29 10:15:02"), "malformed", 1),
    ("timestamp_calendar", lambda: [resign({**chain()[0], "timestamp": "2026-02-30T10:00:00Z"}, R1)], "malformed", 0),
    ("relay_did_other_foreign", lambda: tampered(1, relay_did="did:example:relay"), "bad_signature", 1),
    ("relay_did_other_agent", lambda: tampered(1, relay_did=R1.did), "key_mismatch", 1),
    ("relay_did_empty", lambda: tampered(0, relay_did=""), "malformed", 0),
    ("public_key_other_identity", lambda: tampered(1, public_key=R3.public_key_b58), "key_mismatch", 1),
    ("public_key_other_resigned", lambda: [resign({**chain()[0], "public_key": R3.public_key_b58}, R3)], "key_mismatch", 0),
    ("public_key_not_b58", lambda: tampered(0, public_key="0OIl"), "malformed", 0),
    ("public_key_short", lambda: tampered(0, public_key=b58encode(b"\x01" * 31)), "malformed", 0),
    ("signature_other", lambda: tampered(1, signature=chain()[0]["signature"]), "bad_signature", 1),
    ("signature_flip", lambda: tampered(0, signature=("B" if chain()[0]["signature"][0] == "A" else "A") + chain()[0]["signature"][1:]), "bad_signature", 0),
    ("signature_not_b64", lambda: tampered(0, signature="a+b/"), "bad_signature", 0),
    ("signature_empty", lambda: tampered(0, signature=""), "bad_signature", 0),
    ("sig_algo", lambda: tampered(1, sig_algo="ed448"), "unsupported_sig_algo", 1),
    ("sig_algo_case", lambda: tampered(0, sig_algo="Ed25519"), "unsupported_sig_algo", 0),
    ("extra_member", lambda: tampered(1, note="hi"), "malformed", 1),
    ("missing_member", lambda: [{k: v for k, v in e.items() if k != "sig_algo"} for e in chain()], "malformed", 0),
    ("non_string_member", lambda: tampered(0, timestamp=1764411300), "malformed", 0),
    ("null_member", lambda: tampered(1, signature=None), "malformed", 1),
    ("entry_not_object", lambda: [chain()[0], [1, 2]], "malformed", 1),
    ("surrogate_did", lambda: tampered(0, relay_did="did:x:\udc80"), "malformed", 0),
])
def test_tamper(name, bad, reason, index):
    check = verify_relay_chain(bad())
    assert (check.ok, check.reason, check.index) == (False, reason, index), check
    assert check.detail


def test_chain_not_a_list():
    for value in (None, {}, "[]", 3, tuple(chain()), {"0": chain()[0]}):
        check = verify_relay_chain(value)
        assert (check.ok, check.reason, check.index) == (False, "malformed", None)


def test_max_entries():
    c = append_relay(FULL, R1, now=T0)
    for i in range(3):
        c = append_relay(c, R2, now=T0 + timedelta(seconds=i))
    assert verify_relay_chain(c["relay_chain"], max_entries=4).ok
    check = verify_relay_chain(c["relay_chain"], max_entries=3)
    assert (check.ok, check.reason, check.index) == (False, "malformed", 3)
    entry = c["relay_chain"][0]
    assert verify_relay_chain([entry] * 32).ok  # default limit: 32
    assert verify_relay_chain([entry] * 33).reason == "malformed"
    assert verify_relay_chain([{}] * 33).index == 32  # length is checked before content


def test_registry_binding():
    c = chain()
    reg = MemoryKeyRegistry()
    assert verify_relay_chain(c, registry=reg).ok
    reg.revoke(R2.did, T0)  # R2 signed at T1, after its revocation
    check = verify_relay_chain(c, registry=reg)
    assert (check.reason, check.index) == ("revoked", 1)
    reg2 = MemoryKeyRegistry()
    reg2.revoke(R1.did, T0)  # signed at the revocation instant: not refused
    assert verify_relay_chain(c, registry=reg2).ok
    # a foreign-form DID binds to its pinned key
    foreign = resign({**c[0], "relay_did": "did:example:relay"}, R1)
    assert verify_relay_chain([foreign]).ok
    reg3 = MemoryKeyRegistry()
    reg3.pin("did:example:relay", R3.public_key)
    assert verify_relay_chain([foreign], registry=reg3).reason == "key_mismatch"
    reg4 = MemoryKeyRegistry()
    assert verify_relay_chain([foreign], registry=reg4).ok
    assert reg4.pinned_key("did:example:relay") is None  # verification never pins


def test_entry_can_be_copied_to_another_container():
    """Documented limitation: the signed string does not name the container."""
    other = {"hmp_container": {"head": {"version": "5.0", "other": True}, "payload": {}}}
    moved = {**other, "relay_chain": chain()}
    assert verify_relay_chain(moved["relay_chain"]).ok


def test_self_certifying_did_must_hash_to_key():
    did = agent_did_for_key(R3.public_key)
    entry = resign({**chain()[0], "relay_did": did}, R1)  # R1's key, R3's DID
    assert verify_relay_chain([entry]).reason == "key_mismatch"


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40) | st.binary(max_size=8)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
_member_values = st.one_of(
    _json,
    st.sampled_from([R1.did, R2.did, "2026-11-29T10:15:00Z", "ed25519", R1.public_key_b58, "", "\udc80"]),
)


@st.composite
def _entries(draw):
    base = dict(draw(st.sampled_from(chain())))
    for key in draw(st.sets(st.sampled_from(sorted(ENTRY_MEMBERS)))):
        base[key] = draw(_member_values)
    for key in draw(st.sets(st.sampled_from(sorted(ENTRY_MEMBERS)), max_size=2)):
        base.pop(key, None)
    if draw(st.booleans()):
        base[draw(st.text(max_size=8))] = draw(_json)
    return base


_REASONS = {"malformed", "key_mismatch", "unknown_key", "revoked", "unsupported_sig_algo", "bad_signature"}


@settings(max_examples=200, deadline=None)
@given(st.one_of(_json, st.lists(st.one_of(_entries(), _json), max_size=6)), st.integers(0, 40))
def test_hostile_chains_never_raise(value, max_entries):
    check = verify_relay_chain(value, max_entries=max_entries)
    assert isinstance(check, RelayCheck)
    if check.ok:
        assert isinstance(value, list) and len(value) <= max_entries
        assert all(isinstance(e, dict) and set(e) == ENTRY_MEMBERS for e in value)
    else:
        assert check.reason in _REASONS and check.detail
        assert check.index is None or (isinstance(value, list) and 0 <= check.index <= len(value))


@settings(max_examples=200, deadline=None)
@given(st.lists(_entries(), min_size=1, max_size=4))
def test_hostile_entries_reason_is_the_first_bad_one(entries):
    check = verify_relay_chain(entries)
    if not check.ok:
        assert verify_relay_chain(entries[: check.index]).ok
        single = verify_relay_chain([entries[check.index]])
        assert (single.reason, single.index) == (check.reason, 0)
