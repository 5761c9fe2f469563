"""peer_announce discovery records: PoW address records, addr parsing, announce checks (profile section 10)."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode import vectors
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import sha256_tag
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.verify import Verifier, VerifyResult
from hmpnode.net.announce import (
    DEFAULT_MIN_DIFFICULTY,
    MAX_NONCE,
    AnnounceCheck,
    build_peer_announce,
    check_address_record,
    check_peer_announce,
    leading_zeros,
    make_address_record,
    newer_announce,
    parse_addr,
    pow_hash,
)

D = 2  # test difficulty: 256 hashes expected per record
DID = "did:hmp:agent:TestDid"
ADDRS = ["tcp://node.example:7420", "udp://[2001:db8::1]:7421"]


def _check(identity, now, *, min_difficulty=D, **kw):
    kw.setdefault("addresses", ADDRS)
    kw.setdefault("difficulty", D)
    raw = build_peer_announce(identity, now=now, **kw)
    result = Verifier().verify(raw, now=now)
    assert result.ok, (result.reason, result.detail)
    return check_peer_announce(result, min_difficulty=min_difficulty, now=now)


# -- PoW address records -----------------------------------------------------


def test_hash_formula_by_hand():
    expected = hashlib.sha256(b"did:hmp:agent:TestDid -- tcp://h:1 -- 42").hexdigest()
    assert pow_hash(DID, "tcp://h:1", 42) == expected


def test_record_round_trip_and_exact_formula():
    rec = make_address_record(DID, "tcp://h:1", difficulty=D)
    assert set(rec) == {"addr", "nonce", "pow_hash", "difficulty"}
    by_hand = hashlib.sha256(f"{DID} -- tcp://h:1 -- {rec['nonce']}".encode()).hexdigest()
    assert rec["pow_hash"] == by_hand
    assert rec["pow_hash"].startswith("0" * D)
    assert rec["difficulty"] == len(by_hand) - len(by_hand.lstrip("0")) >= D
    # it is the first such nonce: deterministic given start_nonce
    for n in range(rec["nonce"]):
        assert not pow_hash(DID, "tcp://h:1", n).startswith("0" * D)
    assert make_address_record(DID, "tcp://h:1", difficulty=D) == rec
    assert check_address_record(DID, rec, min_difficulty=D) is None
    later = make_address_record(DID, "tcp://h:1", difficulty=D, start_nonce=rec["nonce"] + 1)
    assert later["nonce"] > rec["nonce"]
    assert check_address_record(DID, later, min_difficulty=D) is None


def test_default_difficulty_is_cheap_and_valid():
    assert DEFAULT_MIN_DIFFICULTY == 3
    rec = make_address_record(DID, "udp://1.2.3.4:9")
    assert rec["pow_hash"].startswith("000")
    assert check_address_record(DID, rec, min_difficulty=DEFAULT_MIN_DIFFICULTY) is None


def test_make_record_gives_up_and_validates():
    with pytest.raises(ValueError, match="no nonce"):
        make_address_record(DID, "tcp://h:1", difficulty=8, max_tries=10)
    with pytest.raises(ValueError):
        make_address_record(DID, "tcp://h:1", difficulty=65)
    with pytest.raises(ValueError):
        make_address_record(DID, "tcp://h:1", start_nonce=-1)
    with pytest.raises(ValueError):
        make_address_record(DID, "", difficulty=0)
    with pytest.raises(ValueError, match="no nonce"):  # never past 2**53-1
        make_address_record(DID, "tcp://h:1", difficulty=8, start_nonce=MAX_NONCE - 3)


@pytest.mark.parametrize(("digest", "count"), [
    ("f" * 64, 0), ("0" + "f" * 63, 1), ("000a" + "0" * 60, 3), ("0" * 64, 64), ("00f0", 2),
])
def test_leading_zeros(digest, count):
    assert leading_zeros(digest) == count


def _good():
    return make_address_record(DID, "tcp://h:1", difficulty=D)


@pytest.mark.parametrize(("field", "value"), [
    ("addr", None), ("addr", 5), ("addr", ""), ("addr", "x" * 1025),
    ("nonce", -1), ("nonce", 2**53), ("nonce", True), ("nonce", 1.0), ("nonce", "1"), ("nonce", None),
    ("pow_hash", "A" * 64), ("pow_hash", "0" * 63), ("pow_hash", "0" * 65), ("pow_hash", "0" * 64 + "\n"),
    ("pow_hash", "g" * 64), ("pow_hash", 0), ("pow_hash", "sha256:" + "0" * 57),
    ("difficulty", -1), ("difficulty", 65), ("difficulty", False), ("difficulty", 2.0), ("difficulty", "2"),
])
def test_malformed_fields(field, value):
    rec = dict(_good(), **{field: value})
    assert check_address_record(DID, rec, min_difficulty=0) == "malformed"


@pytest.mark.parametrize("field", ["addr", "nonce", "pow_hash", "difficulty"])
def test_missing_field_is_malformed(field):
    rec = _good()
    del rec[field]
    assert check_address_record(DID, rec, min_difficulty=0) == "malformed"


@pytest.mark.parametrize("value", [None, [], "tcp://h:1", 3, [_good()]])
def test_non_object_record_is_malformed(value):
    assert check_address_record(DID, value, min_difficulty=0) == "malformed"


def test_pow_mismatch():
    rec = _good()
    assert check_address_record(DID, dict(rec, nonce=rec["nonce"] + 1), min_difficulty=0) == "pow_mismatch"
    assert check_address_record(DID, dict(rec, addr="tcp://h:2"), min_difficulty=0) == "pow_mismatch"
    assert check_address_record(DID, dict(rec, pow_hash="0" * 64), min_difficulty=0) == "pow_mismatch"
    # bound to the DID: copied into another agent's announce it fails
    assert check_address_record(DID + "x", rec, min_difficulty=0) == "pow_mismatch"


def test_min_difficulty_enforced():
    rec = _good()
    actual = leading_zeros(rec["pow_hash"])
    assert check_address_record(DID, rec, min_difficulty=actual) is None
    assert check_address_record(DID, rec, min_difficulty=actual + 1) == "pow_too_weak"
    # claiming more zeros than the hash has
    assert check_address_record(DID, dict(rec, difficulty=actual + 1), min_difficulty=0) == "pow_too_weak"
    # claiming less than the node demands, though the hash would do
    assert check_address_record(DID, dict(rec, difficulty=0), min_difficulty=1) == "pow_too_weak"
    assert check_address_record(DID, dict(rec, difficulty=0), min_difficulty=0) is None
    # difficulty 0 records: any nonce
    zero = make_address_record(DID, "tcp://h:1", difficulty=0)
    assert zero["nonce"] == 0
    assert check_address_record(DID, zero, min_difficulty=0) is None
    with pytest.raises(ValueError):
        check_address_record(DID, rec, min_difficulty=65)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)
_FIELDS = st.fixed_dictionaries({}, optional={
    "addr": _JSON | st.text(min_size=1), "nonce": _JSON | st.integers(0, MAX_NONCE),
    "pow_hash": _JSON | st.text("0123456789abcdef", min_size=64, max_size=64),
    "difficulty": _JSON | st.integers(0, 64),
})


@settings(max_examples=300, deadline=None)
@given(did=st.text(), record=_JSON | _FIELDS, min_difficulty=st.integers(0, 64))
def test_check_record_never_raises(did, record, min_difficulty):
    assert check_address_record(did, record, min_difficulty=min_difficulty) in (
        None, "malformed", "pow_mismatch", "pow_too_weak",
    )


# -- parse_addr ----------------------------------------------------------------


@pytest.mark.parametrize(("addr", "parsed"), [
    ("tcp://node.example:7420", ("tcp", "node.example", 7420)),
    ("udp://localhost:1", ("udp", "localhost", 1)),
    ("tcp://192.0.2.7:65535", ("tcp", "192.0.2.7", 65535)),
    ("udp://[2001:db8::1]:7421", ("udp", "2001:db8::1", 7421)),
    ("tcp://[::1]:80", ("tcp", "::1", 80)),
    ("tcp://a-b.c-d.example:8080", ("tcp", "a-b.c-d.example", 8080)),
])
def test_parse_addr_good(addr, parsed):
    assert parse_addr(addr) == parsed


@pytest.mark.parametrize("addr", [
    "", "tcp://", "tcp://host", "tcp://host:", "tcp://:80", "http://host:80", "TCP://host:80",
    "quic://host:80", "tcp://host:0", "tcp://host:65536", "tcp://host:080", "tcp://host:-1",
    "tcp://host:80/path", "tcp://user@host:80", "tcp://host:80?x", "tcp:/host:80", "host:80",
    "tcp://2001:db8::1:80", "tcp://[2001:db8::g]:80", "tcp://[fe80::1%eth0]:80", "tcp://[]:80",
    "tcp://999.1.1.1:80", "tcp://1.2.3:80", "tcp://-bad.example:80", "tcp://bad-.example:80",
    "tcp://a..b:80", "tcp://ho st:80", "tcp://" + "a" * 64 + ":80", "tcp://host:80\n",
    "tcp://host:8080808080", "tcp://hóst:80", None, 80,
])
def test_parse_addr_bad(addr):
    with pytest.raises(ValueError):
        parse_addr(addr)


# -- peer_announce -------------------------------------------------------------


def test_build_verify_check_round_trip(alice, bob, now):
    raw = build_peer_announce(
        alice, addresses=ADDRS, now=now, name="alice", interests=["ai"], roles=["relay"],
        mailman=[bob.did], difficulty=D, rng_start=1000,
    )
    payload = raw["hmp_container"]["payload"]
    assert payload["name"] == "alice" and "key_is_falsified" not in payload
    assert all(r["nonce"] >= 1000 for r in payload["addresses"])
    result = Verifier().verify(raw, now=now)
    assert result.ok, result.reason
    got = check_peer_announce(result, min_difficulty=D, now=now)
    assert got.ok and got.reason is None and got.dropped == ()
    assert got.did == alice.did
    assert got.addresses == tuple(ADDRS)
    assert got.roles == ("relay",) and got.mailman == (bob.did,)
    assert got.timestamp == now and got.revoked is False
    # a node demanding more than these records carry drops them all
    hard = check_peer_announce(result, min_difficulty=64, now=now)
    assert not hard.ok and hard.reason == "no_valid_address"
    assert hard.dropped == ((0, "pow_too_weak"), (1, "pow_too_weak"))


def test_build_rejects_bad_addresses(alice, now):
    with pytest.raises(ValueError):
        build_peer_announce(alice, addresses=["http://x:1"], now=now, difficulty=D)
    with pytest.raises(ValueError):
        build_peer_announce(alice, addresses="tcp://x:1", now=now, difficulty=D)


def _signed(identity, now, payload, class_="peer_announce", **kw):
    return Verifier().verify(build_container(identity, class_, payload, now=now, **kw), now=now)


def test_copied_record_fails_and_is_dropped(alice, bob, now):
    mine = make_address_record(bob.did, "tcp://bob.example:1", difficulty=D)
    stolen = make_address_record(alice.did, "tcp://alice.example:1", difficulty=D)
    assert check_address_record(bob.did, stolen, min_difficulty=D) == "pow_mismatch"
    result = _signed(bob, now, {"addresses": [stolen, mine, dict(mine, difficulty=64)]})
    got = check_peer_announce(result, min_difficulty=D, now=now)
    assert got.ok and got.addresses == ("tcp://bob.example:1",)
    assert got.dropped == ((0, "pow_mismatch"), (2, "pow_too_weak"))
    assert "addresses[0]: pow_mismatch" in got.detail
    # the class schema keeps malformed records out; should one get through, it is dropped
    result.container["hmp_container"]["payload"]["addresses"].append({"addr": "x"})
    again = check_peer_announce(result, min_difficulty=D, now=now)
    assert again.ok and again.dropped[-1] == (3, "malformed")
    only_stolen = check_peer_announce(_signed(bob, now, {"addresses": [stolen]}), min_difficulty=D, now=now)
    assert not only_stolen.ok and only_stolen.reason == "no_valid_address"
    assert only_stolen.dropped == ((0, "pow_mismatch"),)


def test_bad_payload_shape_refused(alice, now):
    result = _signed(alice, now, {"addresses": []})
    for bad in ({"addresses": "tcp://h:1"}, {"addresses": [], "roles": [1]}, {"addresses": [], "mailman": "x"}):
        result.container["hmp_container"]["payload"] = bad
        got = check_peer_announce(result, min_difficulty=D, now=now)
        assert not got.ok and got.reason == "bad_payload"
    result.container["hmp_container"]["payload"] = [1]
    assert check_peer_announce(result, min_difficulty=D, now=now).reason == "unreadable"


def test_duplicate_addresses_listed_once(alice, now):
    got = _check(alice, now, addresses=["tcp://a.example:1", "tcp://a.example:1"])
    assert got.ok and got.addresses == ("tcp://a.example:1",)


def test_no_addresses_is_refused(alice, now):
    got = _check(alice, now, addresses=[])
    assert not got.ok and got.reason == "no_valid_address" and got.did == alice.did


def test_revocation_needs_no_address(alice, now):
    got = _check(alice, now, addresses=[], key_is_falsified=True)
    assert got.ok and got.revoked and got.addresses == ()
    bare = check_peer_announce(_signed(alice, now, {"addresses": [], "key_is_falsified": True}), min_difficulty=D, now=now)
    assert bare.ok and bare.revoked
    not_revoked = check_peer_announce(
        _signed(alice, now, {"addresses": [], "key_is_falsified": False}), min_difficulty=D, now=now
    )
    assert not not_revoked.ok and not not_revoked.revoked


def test_revocation_without_addresses_member(alice, now):
    """Spec 4.1 lets a revocation carry no `addresses` at all (profile section 13); it
    failed the class schema before. Without `key_is_falsified` the member is still needed,
    from a peer too: peer_announce is a class the node acts on."""
    result = _signed(alice, now, {"key_is_falsified": True})
    assert result.ok, result.detail
    got = check_peer_announce(result, min_difficulty=D, now=now)
    assert got.ok and got.revoked and got.addresses == ()
    unsigned = build_container(alice, "peer_announce", {"key_is_falsified": True}, now=now)
    unsigned["hmp_container"]["payload"] = {"name": "alice"}
    unsigned["hmp_container"]["head"]["payload_hash"] = sha256_tag(canonical_json({"name": "alice"}))
    resigned = {"hmp_container": vectors.resign(unsigned["hmp_container"], alice)}
    for from_peer in (False, True):
        refused = Verifier().verify(resigned, now=now, from_peer=from_peer)
        assert (refused.ok, refused.reason) == (False, "class_schema")
        assert "'addresses' is a required property or 'key_is_falsified' is a required property" in refused.detail
    not_revoked = check_peer_announce(_signed(alice, now, {"key_is_falsified": False}), min_difficulty=D, now=now)
    assert not not_revoked.ok and not_revoked.reason == "bad_payload"


def test_encrypted_announce_is_unreadable(alice, bob, now):
    payload = {"addresses": [make_address_record(alice.did, "tcp://a.example:1", difficulty=D)]}
    result = _signed(alice, now, payload, encrypt_to=[Recipient(bob.did, bob.public_key)], rng=os.urandom)
    assert result.ok
    got = check_peer_announce(result, min_difficulty=D, now=now)
    assert not got.ok and got.reason == "unreadable" and got.did == alice.did


def test_compressed_announce_is_read(alice, now):
    payload = {"addresses": [make_address_record(alice.did, "tcp://a.example:1", difficulty=D)]}
    for compression in ("zstd", "gzip"):
        result = _signed(alice, now, payload, compression=compression)
        assert result.ok and result.container["hmp_container"]["head"]["compression"] == compression
        got = check_peer_announce(result, min_difficulty=D, now=now)
        assert got.ok and got.addresses == ("tcp://a.example:1",)


def test_wrong_class_refused(alice, now):
    result = _signed(alice, now, {"anything": 1}, class_="note")
    assert result.ok
    got = check_peer_announce(result, min_difficulty=D, now=now)
    assert not got.ok and got.reason == "wrong_class"


def test_unverified_refused(alice, now):
    got = check_peer_announce(VerifyResult(False, "bad_signature", "nope"), min_difficulty=D, now=now)
    assert not got.ok and got.reason == "unverified" and "bad_signature" in got.detail
    odd = check_peer_announce(VerifyResult(True, container={"hmp_container": {}}), min_difficulty=D, now=now)
    assert not odd.ok and odd.reason == "unverified"


def test_expired_announce_refused_but_revocation_kept(alice, now):
    ttl = now + timedelta(minutes=5)
    later = now + timedelta(minutes=10)
    assert _check(alice, now, ttl=ttl).ok
    raw = build_peer_announce(alice, addresses=ADDRS, now=now, ttl=ttl, difficulty=D)
    result = Verifier().verify(raw, now=now)
    got = check_peer_announce(result, min_difficulty=D, now=later)
    assert not got.ok and got.reason == "expired"
    rev = build_peer_announce(alice, addresses=[], now=now, ttl=ttl, difficulty=D, key_is_falsified=True)
    assert check_peer_announce(Verifier().verify(rev, now=now), min_difficulty=D, now=later).revoked


# -- newer_announce ------------------------------------------------------------


def test_newer_announce(alice, bob, now):
    old = _check(alice, now)
    new = _check(alice, now + timedelta(seconds=1))
    same = _check(alice, now, name="other")
    assert newer_announce(None, old)
    assert newer_announce(old, new)
    assert not newer_announce(new, old)  # stale
    assert not newer_announce(old, same)  # equal timestamp: keep current
    assert not newer_announce(old, old)
    with pytest.raises(ValueError):
        newer_announce(old, _check(bob, now + timedelta(seconds=1)))


def test_newer_announce_refused_candidate_and_revocation(alice, now):
    current = _check(alice, now)
    refused = AnnounceCheck(False, "no_valid_address", did=alice.did, timestamp=now + timedelta(hours=1))
    assert not newer_announce(current, refused)
    assert newer_announce(refused, current)
    revocation = _check(alice, now - timedelta(seconds=1), addresses=[], key_is_falsified=True)
    assert newer_announce(current, revocation)  # a revocation wins whatever its timestamp
    assert not newer_announce(revocation, _check(alice, now + timedelta(seconds=5)))  # and is final


def test_the_protocols_member_lists_what_the_peer_port_speaks(alice, now):
    """`protocols` (issue 11): absent means the v1 of before it existed; a list of short
    strings is read as given; anything else is nothing we know (such a peer is not dialled)."""
    assert _check(alice, now, protocols=["hmp-peer/2"]).protocols == ("hmp-peer/2",)
    plain = build_peer_announce(alice, addresses=ADDRS, now=now, difficulty=D)
    assert "protocols" not in plain["hmp_container"]["payload"]
    assert _check(alice, now).protocols == ("hmp-peer/1",)
    odd = build_container(alice, "peer_announce", {
        "addresses": plain["hmp_container"]["payload"]["addresses"], "protocols": "hmp-peer/2"}, now=now)
    assert check_peer_announce(Verifier().verify(odd, now=now), min_difficulty=D, now=now).protocols == ()
    for bad in ("hmp-peer/2", [], [""], ["x" * 33]):
        with pytest.raises(ValueError):
            build_peer_announce(alice, addresses=ADDRS, now=now, difficulty=D, protocols=bad)
