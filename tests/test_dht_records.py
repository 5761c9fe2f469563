"""Signed DHT records and the bounded record store (hmpnode.net.dhtrecords): build, verify,
forgery, staleness, PoW, size and shape limits, set merging and store caps. Sans-IO."""

from __future__ import annotations

import hashlib
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import b58decode, b64url_decode, b64url_encode
from hmpnode.identity.keys import Identity, ed25519_verify
from hmpnode.net.announce import make_address_record
from hmpnode.net.dhtrecords import (
    OWN_GROUP,
    SIGNATURE_CONTEXT,
    DhtRecord,
    PeerRecord,
    ProviderRecord,
    RecordError,
    RecordLimits,
    RecordStore,
    StoreLimits,
    TopicRecord,
    build_peer_record,
    build_provider_record,
    build_topic_record,
    decode_record_set,
    encode_record_set,
    eviction_group,
    fair_order,
    is_newer,
    key_id,
    merge_ranked,
    merge_records,
    peer_key,
    provider_key,
    source_group,
    topic_key,
    verify_record,
)

TTL = timedelta(hours=1)
CONTAINER = "did:hmp:container:QmTestContainer"
D = 2  # address PoW difficulty used by these tests (256 hashes expected)


def ident(n: int) -> Identity:
    return Identity(hashlib.sha256(b"dht-records-%d" % n).digest())


def addrs(identity: Identity, *hosts: str, difficulty: int = D) -> list[dict]:
    hosts = hosts or ("udp://127.0.0.1:7421",)
    return [make_address_record(identity.did, h, difficulty=difficulty) for h in hosts]


def peer(identity: Identity, now, **kw) -> bytes:
    kw.setdefault("address_records", addrs(identity))
    kw.setdefault("ttl", TTL)
    kw.setdefault("min_difficulty", D)
    return build_peer_record(identity, now=now, **kw)


def check(raw, now, **kw):
    kw.setdefault("min_difficulty", D)
    return verify_record(raw, now=now, **kw)


def reason(raw, now, **kw) -> str:
    with pytest.raises(RecordError) as info:
        check(raw, now, **kw)
    return info.value.reason


def resign(identity: Identity, obj: dict) -> bytes:
    """Re-sign an edited record exactly as the builder signs (to test checks after the signature)."""
    unsigned = {k: v for k, v in obj.items() if k != "signature"}
    sig = identity.sign(canonical_json({**unsigned, "context": SIGNATURE_CONTEXT}))
    return canonical_json({**unsigned, "signature": b64url_encode(sig)})


def loads(raw: bytes) -> dict:
    import json

    return json.loads(raw)


# -- keys --------------------------------------------------------------------


def test_keys_and_their_ids():
    assert peer_key("did:hmp:agent:X") == "hmp:peer:did:hmp:agent:X"
    assert provider_key(CONTAINER) == "hmp:prov:" + CONTAINER
    assert topic_key("mesh/latency") == "hmp:topic:mesh/latency"
    # kademlia's digest(): SHA-1 of the UTF-8 bytes of the key string
    assert key_id("hmp:topic:é") == hashlib.sha1("hmp:topic:é".encode()).digest()
    for bad in ("", "a\nb", "x" * 129, 5):
        with pytest.raises(ValueError):
            topic_key(bad)  # type: ignore[arg-type]


# -- build and verify ----------------------------------------------------------


def test_peer_record_round_trip_and_exact_signature_input(now):
    alice = ident(1)
    raw = peer(alice, now, address_records=addrs(alice, "udp://127.0.0.1:7421", "tcp://node.example:7420"),
               roles=["relay"], mailman=["did:hmp:agent:Someone"])
    obj = loads(raw)
    assert raw == canonical_json(obj)  # emitted canonical
    assert set(obj) == {"v", "kind", "did", "public_key", "timestamp", "expires", "addresses", "roles", "mailman",
                        "signature"}
    assert obj["v"] == 1 and obj["kind"] == "peer" and obj["did"] == alice.did
    assert obj["timestamp"] == "2026-11-29T10:15:00Z" and obj["expires"] == "2026-11-29T11:15:00Z"
    # signature input by hand: the record without `signature`, plus the context member
    unsigned = {k: v for k, v in obj.items() if k != "signature"}
    message = canonical_json({**unsigned, "context": "hmp-dht-record-v1"})
    assert ed25519_verify(b58decode(obj["public_key"]), message, b64url_decode(obj["signature"]))
    rec = check(raw, now)
    assert isinstance(rec, PeerRecord)
    assert rec.key == peer_key(alice.did) and rec.raw == raw
    assert rec.addresses == ("udp://127.0.0.1:7421", "tcp://node.example:7420")
    assert rec.roles == ("relay",) and rec.mailman == ("did:hmp:agent:Someone",)
    assert rec.timestamp == now and rec.expires == now + TTL
    # bound to its key
    assert check(raw, now, key=peer_key(alice.did), key_id_=key_id(peer_key(alice.did))) == rec


def test_provider_and_topic_records(now):
    alice = ident(1)
    prov = check(build_provider_record(alice, CONTAINER, now=now, ttl=TTL), now, key=provider_key(CONTAINER))
    assert isinstance(prov, ProviderRecord) and prov.container == CONTAINER and prov.did == alice.did
    top = check(build_topic_record(alice, "mesh", now=now, ttl=TTL), now, key=topic_key("mesh"))
    assert isinstance(top, TopicRecord) and top.topic == "mesh"
    assert isinstance(top, DhtRecord)
    with pytest.raises(ValueError):
        build_provider_record(alice, "not a did", now=now, ttl=TTL)


def test_builder_refuses_what_verifiers_would_refuse(now):
    alice, bob = ident(1), ident(2)
    with pytest.raises(ValueError, match="address_records"):
        peer(alice, now, address_records=addrs(bob))  # bob's PoW does not hash with alice's DID
    with pytest.raises(ValueError, match="bad_addr"):
        peer(alice, now, address_records=addrs(alice, "ftp://h:1"))
    with pytest.raises(ValueError):
        peer(alice, now, address_records=[])
    with pytest.raises(ValueError, match="ttl"):
        peer(alice, now, ttl=timedelta(hours=25))
    with pytest.raises(ValueError, match="timezone"):
        peer(alice, now.replace(tzinfo=None))
    with pytest.raises(ValueError, match="bytes"):
        peer(alice, now, roles=["r" * 100] * 10)  # fine per item, too big in all


# -- forgery -------------------------------------------------------------------


def test_any_edit_breaks_the_signature(now):
    alice = ident(1)
    obj = loads(peer(alice, now))
    for member, value in [
        ("roles", ["mailman"]),
        ("expires", "2026-11-29T12:15:00Z"),
        ("timestamp", "2026-11-29T10:16:00Z"),
        ("addresses", obj["addresses"] + [make_address_record(alice.did, "tcp://evil.example:1", difficulty=D)]),
    ]:
        assert reason(canonical_json({**obj, member: value}), now) == "bad_signature", member
    sig = bytearray(b64url_decode(obj["signature"]))
    sig[0] ^= 1
    assert reason(canonical_json({**obj, "signature": b64url_encode(bytes(sig))}), now) == "bad_signature"


def test_did_must_be_self_certifying_and_match_the_key(now):
    alice, mallory = ident(1), ident(9)
    obj = loads(peer(alice, now))
    # mallory signs a record that claims alice's DID with mallory's key
    forged = {**obj, "public_key": mallory.public_key_b58}
    assert reason(resign(mallory, forged), now) == "key_mismatch"
    # a DID that is not self-certifying cannot publish at all
    other = {**obj, "did": "did:example:alice"}
    assert reason(resign(alice, other), now) == "bad_did"


def test_record_must_match_the_key_it_is_stored_under(now):
    alice, bob = ident(1), ident(2)
    raw = peer(alice, now)
    assert reason(raw, now, key=peer_key(bob.did)) == "wrong_key"
    assert reason(raw, now, key_id_=key_id(peer_key(bob.did))) == "wrong_key"
    prov = build_provider_record(alice, CONTAINER, now=now, ttl=TTL)
    assert reason(prov, now, key=provider_key(CONTAINER + "x")) == "wrong_key"
    assert reason(prov, now, key=peer_key(alice.did)) == "wrong_key"


# -- time ----------------------------------------------------------------------


def test_future_skew_is_the_lan_freshness_window(now):
    """Issue 10, DHT: 16 Sybil DIDs dated 290 s ahead were accepted (5 min skew) and,
    newest first, pushed a legitimate record out. Now 120 s: 290 s ahead is `future`."""
    assert RecordLimits().max_skew == timedelta(seconds=120)
    sybil = ident(66)
    ahead = build_topic_record(sybil, "chess", now=now + timedelta(seconds=290), ttl=TTL)
    assert reason(ahead, now) == "future"
    check(build_topic_record(sybil, "chess", now=now + timedelta(seconds=120), ttl=TTL), now)
    s = store()
    result = s.put(key_id(topic_key("chess")), ahead, now=now, source="127.0.0.2")
    assert (result.accepted, result.reason, len(s)) == (False, "future", 0)


def test_expired_future_and_lifetime(now):
    alice = ident(1)
    raw = peer(alice, now)
    assert reason(raw, now + TTL) == "expired"  # expires == now counts as expired
    check(raw, now + TTL - timedelta(milliseconds=1))
    skew = RecordLimits().max_skew
    check(raw, now - skew)  # timestamp = now + skew is accepted
    assert reason(raw, now - skew - timedelta(seconds=1)) == "future"
    obj = loads(raw)
    assert reason(resign(alice, {**obj, "expires": "2026-11-30T10:15:00.001Z"}), now) == "bad_lifetime"
    assert reason(resign(alice, {**obj, "expires": obj["timestamp"]}), now - timedelta(minutes=1)) == "bad_lifetime"
    assert reason(resign(alice, {**obj, "timestamp": "2026-11-29 10:15:00Z"}), now) == "bad_time"


def test_newer_wins_with_a_total_order(now):
    alice = ident(1)
    old = check(peer(alice, now), now)
    new = check(peer(alice, now + timedelta(seconds=1)), now)
    assert is_newer(new, old) and not is_newer(old, new) and not is_newer(old, old)
    # equal timestamps: the greater canonical bytes win, on every replica alike
    a = check(peer(alice, now, roles=["a"]), now)
    b = check(peer(alice, now, roles=["b"]), now)
    winner = max(a, b, key=lambda r: r.raw)
    assert merge_records([a, b]) == [winner] == merge_records([b, a])


# -- proof of work -------------------------------------------------------------


def test_invalid_addresses_are_dropped_and_none_left_is_refused(now):
    alice, bob = ident(1), ident(2)
    good = make_address_record(alice.did, "udp://127.0.0.1:1", difficulty=D)
    copied = make_address_record(bob.did, "udp://10.0.0.1:1", difficulty=D)  # another DID's PoW
    weak = make_address_record(alice.did, "udp://127.0.0.1:2", difficulty=0)
    while weak["difficulty"] >= D:  # pick a nonce whose hash really is weaker
        weak = make_address_record(alice.did, "udp://127.0.0.1:2", difficulty=0, start_nonce=weak["nonce"] + 1)
    lying = {**good, "difficulty": 60}
    bad_scheme = make_address_record(alice.did, "http://127.0.0.1:3", difficulty=D)
    obj = loads(peer(alice, now))
    raw = resign(alice, {**obj, "addresses": [copied, good, weak, lying, bad_scheme, "x", good]})
    rec = check(raw, now, limits=RecordLimits(max_record_bytes=2048))
    assert rec.addresses == ("udp://127.0.0.1:1",)
    assert rec.dropped == ((0, "pow_mismatch"), (2, "pow_too_weak"), (3, "pow_too_weak"), (4, "bad_addr"),
                           (5, "malformed"))
    raw = resign(alice, {**obj, "addresses": [copied, weak]})
    assert reason(raw, now) == "no_valid_address"
    # the reader's minimum difficulty decides
    strong = peer(alice, now)
    assert reason(strong, now, min_difficulty=20) == "no_valid_address"


# -- size and shape ------------------------------------------------------------


def test_size_caps(now):
    alice = ident(1)
    raw = peer(alice, now)
    assert reason(raw + b" " * 1024, now) == "too_large"  # checked on the raw bytes, before parsing
    small = RecordLimits(max_record_bytes=len(raw) - 1)
    assert reason(raw, now, limits=small) == "too_large"
    assert reason(loads(raw), now, limits=small) == "too_large"  # parsed input: canonical size


@pytest.mark.parametrize(
    "edit, code",
    [
        (lambda o: {**o, "v": 2}, "bad_version"),
        (lambda o: {**o, "v": True}, "bad_version"),
        (lambda o: {**o, "kind": "peers"}, "bad_kind"),
        (lambda o: {k: v for k, v in o.items() if k != "roles"}, "malformed"),
        (lambda o: {**o, "extra": 1}, "malformed"),
        (lambda o: {**o, "context": SIGNATURE_CONTEXT}, "malformed"),
        (lambda o: {**o, "roles": "relay"}, "malformed"),
        (lambda o: {**o, "roles": [1]}, "malformed"),
        (lambda o: {**o, "mailman": ["x"] * 17}, "malformed"),
        (lambda o: {**o, "addresses": []}, "malformed"),
        (lambda o: {**o, "addresses": {}}, "malformed"),
        (lambda o: {**o, "did": 5}, "malformed"),
        (lambda o: {**o, "public_key": "0OIl"}, "malformed"),
        (lambda o: {**o, "signature": "***"}, "malformed"),
    ],
)
def test_shape(now, edit, code):
    obj = loads(peer(ident(1), now))
    assert reason(canonical_json(edit(obj)), now) == code


@pytest.mark.parametrize(
    "data",
    [b"", b"nope", b"[]", b"null", b'"x"', b'{"kind": "peer", "kind": "peer"}', b"[" * 50 + b"]" * 50,
     b'{"v": 1, "n": 9007199254740993}', "\udc00", 5, None, ["x"]],
)
def test_garbage_is_malformed(now, data):
    assert reason(data, now) in {"malformed", "bad_kind"}


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=6),
    max_leaves=20,
))
def test_verify_never_raises_anything_else(value):
    from datetime import datetime, timezone

    now = datetime(2026, 11, 29, tzinfo=timezone.utc)
    for candidate in (value, {"kind": "peer", **value} if isinstance(value, dict) else value):
        try:
            verify_record(candidate, now=now)
        except RecordError:
            pass
    try:
        decode_record_set(value, now=now, key="hmp:peer:x")
    except Exception as exc:  # pragma: no cover - the assertion is the point
        raise AssertionError(f"decode_record_set raised {exc!r}") from exc


# -- record sets ---------------------------------------------------------------


def test_merge_keeps_newest_per_signer_then_fits_caps(now):
    recs = []
    for n in range(5):
        recs.append(check(build_provider_record(ident(n), CONTAINER, now=now + timedelta(seconds=n), ttl=TTL), now))
    older_dup = check(build_provider_record(ident(4), CONTAINER, now=now, ttl=TTL), now)
    merged = merge_records([*recs, older_dup])
    assert [r.did for r in merged] == [ident(n).did for n in (4, 3, 2, 1, 0)]
    assert merged[0].timestamp == now + timedelta(seconds=4)
    assert merge_records(recs, max_entries=2) == merged[:2]
    size = len(encode_record_set(merged[:3]))
    assert merge_records(recs, max_bytes=size) == merged[:3]


def test_decode_record_set_keeps_the_valid_elements(now):
    alice, bob = ident(1), ident(2)
    key = provider_key(CONTAINER)
    good = [build_provider_record(i, CONTAINER, now=now, ttl=TTL) for i in (alice, bob)]
    forged = loads(good[0])
    forged["did"] = bob.did  # signature no longer matches (and key_mismatch first)
    other_key = build_provider_record(alice, CONTAINER + "2", now=now, ttl=TTL)
    value = b"[" + b",".join([good[0], canonical_json(forged), other_key, b'"x"', good[1]]) + b"]"
    records, refused = decode_record_set(value, now=now, key=key)
    assert [r.did for r in records] == [alice.did, bob.did] and refused == 3
    # a single record object (a verbatim-storing peer) and text values are read too
    records, refused = decode_record_set(good[0].decode(), now=now, key=key)
    assert len(records) == 1 and refused == 0
    records, refused = decode_record_set(value, now=now, key=key, max_items=1)
    assert len(records) == 1 and refused == 4
    for junk in (b"[", 5, {"value": 1}, b"\xff"):
        assert decode_record_set(junk, now=now, key=key) == ([], 1)


# -- the store -----------------------------------------------------------------


def store(own: Identity | None = None, **limits) -> RecordStore:
    return RecordStore(own_did=(own or ident(0)).did, min_difficulty=D, limits=StoreLimits(**limits))


def test_store_newer_wins_and_stale_cannot_overwrite(now):
    alice = ident(1)
    s = store()
    kid = key_id(peer_key(alice.did))
    old, new = peer(alice, now), peer(alice, now + timedelta(seconds=5))
    assert s.put(kid, new, now=now, source="10.0.0.1").accepted
    result = s.put(kid, old, now=now, source="10.0.0.2")
    assert (result.accepted, result.reason) == (False, "stale")
    assert s.put(kid, new, now=now, source="10.0.0.2").reason == "duplicate"
    assert [r.raw for r in s.get(kid, now=now)] == [new]
    assert s.reply_value(kid, now=now) == b"[" + new + b"]"
    assert s.put(key_id(peer_key(ident(2).did)), new, now=now, source=None).reason == "wrong_key"
    assert s.put(kid, b"{}", now=now, source=None).reason == "bad_kind"
    assert s.reply_value(key_id("nothing"), now=now) is None


def test_store_set_caps_keep_the_newest(now):
    s = store(max_set_entries=3)
    kid = key_id(provider_key(CONTAINER))
    for n in range(1, 4):
        assert s.put(kid, build_provider_record(ident(n), CONTAINER, now=now + timedelta(seconds=n), ttl=TTL),
                     now=now, source="10.0.0.1").accepted
    # older than all three: does not make the cut
    late_old = build_provider_record(ident(9), CONTAINER, now=now, ttl=TTL)
    assert s.put(kid, late_old, now=now, source="10.0.0.1").reason == "set_full"
    # newer: pushes out the oldest
    fresh = build_provider_record(ident(8), CONTAINER, now=now + timedelta(seconds=9), ttl=TTL)
    assert s.put(kid, fresh, now=now, source="10.0.0.1").accepted
    assert [r.did for r in s.get(kid, now=now)] == [ident(8).did, ident(3).did, ident(2).did]
    assert s.stats() == {"stored_records": 3, "stored_bytes": sum(len(r.raw) for r in s.get(kid, now=now)),
                         "stored_keys": 1, "stored_own": 0}
    # the byte cap of a set
    raws = [build_provider_record(ident(n), CONTAINER, now=now + timedelta(seconds=n), ttl=TTL) for n in (1, 2, 3)]
    cap = len(raws[1]) + len(raws[2]) + 3  # room for the two newest only
    s2 = store(max_set_bytes=cap)
    for raw in raws:
        s2.put(kid, raw, now=now, source=None)
    assert [r.raw for r in s2.get(kid, now=now)] == [raws[2], raws[1]]
    assert len(s2.reply_value(kid, now=now)) <= cap


def test_store_quotas_and_totals(now):
    alice = ident(1)
    s = store(max_per_signer=2)
    for n in range(2):
        c = f"{CONTAINER}{n}"
        assert s.put(key_id(provider_key(c)), build_provider_record(alice, c, now=now, ttl=TTL), now=now,
                     source="10.0.0.1").accepted
    c = CONTAINER + "x"
    raw = build_provider_record(alice, c, now=now, ttl=TTL)
    assert s.put(key_id(provider_key(c)), raw, now=now, source="10.0.0.1").reason == "signer_quota"
    assert s.put(key_id(provider_key(c)), raw, now=now, source=None).accepted  # our own: no quota
    # replacing one's own record is not a new entry
    c0 = CONTAINER + "0"
    newer = build_provider_record(alice, c0, now=now + timedelta(seconds=1), ttl=TTL)
    assert s.put(key_id(provider_key(c0)), newer, now=now, source="10.0.0.1").accepted

    s = store(max_per_source=2)
    for n in range(2):
        assert s.put(key_id(peer_key(ident(n).did)), peer(ident(n), now), now=now, source="10.0.0.9").accepted
    assert s.put(key_id(peer_key(ident(5).did)), peer(ident(5), now), now=now, source="10.0.0.9").reason == (
        "source_quota")
    assert s.put(key_id(peer_key(ident(5).did)), peer(ident(5), now), now=now, source="10.0.0.8").accepted

    # full: our own records take the room of others' (never the reverse); full of own records, nothing goes
    s = store(max_entries=2)
    for n in range(2):
        s.put(key_id(peer_key(ident(n).did)), peer(ident(n), now), now=now, source="10.0.0.1")
    result = s.put(key_id(peer_key(ident(5).did)), peer(ident(5), now), now=now, source=None)
    assert (result.accepted, result.evicted, len(s)) == (True, 1, 2)
    assert s.put(key_id(peer_key(ident(6).did)), peer(ident(6), now), now=now, source=None).accepted
    assert s.put(key_id(peer_key(ident(7).did)), peer(ident(7), now), now=now, source=None).reason == "store_full"
    assert s.put(key_id(peer_key(ident(8).did)), peer(ident(8), now), now=now, source="10.0.0.1").reason == (
        "store_full")
    raw = peer(ident(1), now)
    s = store(max_bytes=len(raw) + 10)
    assert s.put(key_id(peer_key(ident(1).did)), raw, now=now, source=None).accepted
    assert s.put(key_id(peer_key(ident(2).did)), peer(ident(2), now), now=now, source=None).reason == "store_full"


def test_store_culls_expired_records_and_frees_quota(now):
    s = store(max_per_source=1)
    a, b = ident(1), ident(2)
    short = peer(a, now, ttl=timedelta(seconds=10))
    assert s.put(key_id(peer_key(a.did)), short, now=now, source="10.0.0.1").accepted
    later = now + timedelta(seconds=10)
    assert s.get(key_id(peer_key(a.did)), now=later) == [] and len(s) == 0
    assert s.put(key_id(peer_key(b.did)), peer(b, later), now=later, source="10.0.0.1").accepted
    # an expired record is refused outright
    assert s.put(key_id(peer_key(a.did)), short, now=later, source=None).reason == "expired"


def test_only_own_records_are_republished(now):
    me, other = ident(0), ident(1)
    s = store(me)
    mine = peer(me, now)
    s.put(key_id(peer_key(me.did)), mine, now=now, source=None)
    s.put(key_id(peer_key(other.did)), peer(other, now), now=now, source="10.0.0.1")
    assert s.own_older_than(now) == [(key_id(peer_key(me.did)), mine)]
    assert s.own_older_than(now - timedelta(seconds=1)) == []
    assert len(list(s.records(now=now))) == 2


def test_the_example_in_the_protocol_document(now):
    """docs/protocol.md (DHT section) shows this record byte for byte; it must stay true."""
    alice = Identity(bytes([1]) * 32)
    raw = build_peer_record(
        alice,
        address_records=[make_address_record(alice.did, "udp://192.0.2.7:7421"),
                         make_address_record(alice.did, "tcp://192.0.2.7:7420")],
        roles=["relay"], now=now, ttl=timedelta(hours=2),
    )
    assert raw == (
        b'{"addresses":[{"addr":"udp://192.0.2.7:7421","difficulty":3,"nonce":3541,'
        b'"pow_hash":"0001d7f360063f217b7bb11e03afc46347eb1f363e103756858b89fcdca8fef1"},'
        b'{"addr":"tcp://192.0.2.7:7420","difficulty":3,"nonce":9029,'
        b'"pow_hash":"000f731608a7c87f76695063d3d76cff111a64800c5c28e6c14b6490f461dedb"}],'
        b'"did":"did:hmp:agent:jPUMBAvNeJo8USHNtJ81Wm7cqnk","expires":"2026-11-29T12:15:00Z","kind":"peer",'
        b'"mailman":[],"public_key":"AKnL4NNf3DGWZJS6cPknBuEGnVsV4A4m5tgebLHaRSZ9","roles":["relay"],'
        b'"signature":"ihkAMYC-YUpf_4gI7-SIMBQx62uqr9iSt_Ny0yIbssOnrNa-hB38CkC7FCKaUv5Ei9i_eXiwTyxJ_PlRIOZGAg",'
        b'"timestamp":"2026-11-29T10:15:00Z","v":1}'
    )
    assert key_id(peer_key(alice.did)).hex() == "d607c6bbd88017b75e16121c8e497d0108be1991"


# -- fair shares: source groups, eviction, serving order -------------------------


def test_source_groups():
    assert source_group("203.0.113.77") == "203.0.113.0/24"
    assert source_group("::ffff:203.0.113.77") == "203.0.113.0/24"  # a mapped address is its IPv4 form
    assert source_group("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert source_group("2001:db8:1:2::9", v6_prefix=48) == "2001:db8:1::/48"
    assert source_group("198.51.100.1", v4_prefix=32) == "198.51.100.1/32"
    # on one host the nodes are told apart by their loopback address
    assert source_group("127.0.0.2") == "127.0.0.2" and source_group("::1") == "::1"
    assert source_group(None) == OWN_GROUP
    assert source_group("not-an-ip") == "not-an-ip"


def test_eviction_group_rules():
    # the largest gives, if it holds at least two more than the newcomer's group
    assert eviction_group({"a": 5, "b": 1}, "c") == "a"
    assert eviction_group({"a": 5, "b": 1}, "b") == "a"
    assert eviction_group({"a": 2, "b": 1}, "b") == "b"  # a swap would not even things out: b churns its own
    assert eviction_group({"a": 1, "b": 1}, "c") is None  # equals are not pushed out by a newcomer
    assert eviction_group({"a": 3}, "a") == "a"
    assert eviction_group({}, "a") is None
    assert eviction_group({"a": 3, "b": 3}, "c") == "b"  # ties: the greater name, the same on every replica
    # own records are never taken for another group; they take from the largest other group
    assert eviction_group({OWN_GROUP: 9, "a": 1}, "b") is None
    assert eviction_group({OWN_GROUP: 9, "a": 1}, OWN_GROUP) == "a"
    assert eviction_group({OWN_GROUP: 9}, OWN_GROUP) == OWN_GROUP


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d", OWN_GROUP]), st.integers(0, 20)),
       st.sampled_from(["a", "b", "e", OWN_GROUP]))
def test_eviction_group_never_takes_from_a_smaller_holder(counts, group):
    victim = eviction_group(counts, group)
    mine = counts.get(group, 0)
    if victim is None:
        others = [n for g, n in counts.items() if g not in (group, OWN_GROUP)]
        assert mine == 0 and (group != OWN_GROUP or not any(others))
        assert all(n < mine + 2 for n in others) or group == OWN_GROUP
    elif victim == group:
        assert mine > 0
    else:
        largest = max(n for g, n in counts.items() if g not in (group, OWN_GROUP))
        assert victim != OWN_GROUP and counts[victim] == largest
        assert group == OWN_GROUP or counts[victim] >= mine + 2


def _topic(n: int, now, seconds: int = 0, topic: str = "chess"):
    return check(build_topic_record(ident(n), topic, now=now + timedelta(seconds=seconds), ttl=TTL), now)


def test_fair_order_serves_one_record_per_group_first(now):
    sybils = [("127.0.0.2", _topic(100 + n, now, 100)) for n in range(16)]  # newer than the honest ones
    honest = [("198.51.100.0/24", _topic(1, now)), ("203.0.113.0/24", _topic(2, now, -5))]
    order = fair_order([*sybils, *honest])
    assert len(order) == 18 and set(order) == {r for _, r in sybils + honest}
    newest_sybil = max((r for _, r in sybils), key=lambda r: (r.timestamp, r.raw))
    assert order[:3] == [newest_sybil, honest[0][1], honest[1][1]]
    assert fair_order([]) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 11)), max_size=40, unique_by=lambda t: t[1]))
def test_fair_order_property(pairs):
    """Whatever the mix: a permutation; the first g records come from g distinct groups;
    within a group, newest first."""
    items = [(f"g{g}", _POOL[i]) for g, i in pairs]
    order = fair_order(items)
    assert sorted(map(id, order)) == sorted(id(r) for _, r in items)
    group_of = {id(r): g for g, r in items}
    groups = {g for g, _ in items}
    assert {group_of[id(r)] for r in order[: len(groups)]} == groups
    for g in groups:
        lane = [r for r in order if group_of[id(r)] == g]
        assert lane == sorted(lane, key=lambda r: (r.timestamp, r.raw), reverse=True)


def test_merge_ranked_keeps_each_holders_order(now):
    a, b, c = _topic(1, now), _topic(2, now, 50), _topic(3, now, 60)
    newer_a = _topic(1, now, 10)
    merged = merge_ranked([[c, b], [a, b], [newer_a]])
    # a signer's best position counts (a and c were first somewhere), then newest; newest record per signer
    assert merged == [c, newer_a, b]
    assert merge_ranked([]) == []


# -- the store under attack -------------------------------------------------------


def test_a_flood_from_17_addresses_evicts_itself_not_a_legitimate_store(now):
    """Issue 10, DHT: from 17 source addresses the store filled (nothing evicted) and a
    legitimate store was then refused (`store_full`). Now the group holding the most
    gives up its least recently stored record: the legitimate one is accepted, and the
    flood, going on, keeps evicting itself."""
    s = store(max_entries=64, max_per_source=8)
    flood = [check(build_provider_record(ident(1000 + n), f"{CONTAINER}{n}", now=now, ttl=TTL), now)
             for n in range(17 * 8 + 40)]
    accepted = 0
    for n, rec in enumerate(flood[: 17 * 8]):
        accepted += s.put_record(key_id(rec.key), rec, now=now, source=f"127.0.0.{2 + n % 17}").accepted
    assert len(s) == 64 and accepted == 17 * 8  # the store is full, and a full store took every one of them
    assert max(s.held_by().values()) - min(s.held_by().values()) <= 1  # the attackers evened each other out
    legit = check(build_provider_record(ident(1), CONTAINER, now=now, ttl=TTL), now)
    result = s.put_record(key_id(legit.key), legit, now=now, source="198.51.100.7")
    assert (result.accepted, result.evicted) == (True, 1)
    for n, rec in enumerate(flood[17 * 8:]):  # the flood goes on, from the same addresses
        s.put_record(key_id(rec.key), rec, now=now, source=f"127.0.0.{2 + n % 17}")
    assert s.get(key_id(legit.key), now=now) == [legit]
    assert s.held_by()["198.51.100.0/24"] == 1 and len(s) == 64


def test_per_address_and_per_subnet_quotas(now):
    s = store(max_per_source=3, max_per_group=5)
    recs = [check(peer(ident(200 + n), now), now) for n in range(12)]
    put = [s.put_record(key_id(r.key), r, now=now, source=f"203.0.113.{1 + n // 4}").reason for n, r in
           enumerate(recs[:8])]
    # 203.0.113.1: three, then source_quota; 203.0.113.2: two more fill the /24
    assert put == [None, None, None, "source_quota", None, None, "subnet_quota", "subnet_quota"]
    assert s.put_record(key_id(recs[8].key), recs[8], now=now, source="203.0.114.1").accepted  # another /24
    # loopback addresses are groups by themselves: only the per-address quota
    for n in range(4):
        assert s.put_record(key_id(recs[9 + n % 3].key), recs[9 + n % 3], now=now,
                            source=f"127.0.0.{10 + n}").reason in (None, "duplicate")
    assert s.held_by() == {"203.0.113.0/24": 5, "203.0.114.0/24": 1, "127.0.0.10": 1, "127.0.0.11": 1,
                           "127.0.0.12": 1}


@pytest.mark.parametrize("ahead", [0, 100])
@pytest.mark.parametrize("sybils_first", [False, True])
def test_sixteen_sybils_from_one_address_cannot_push_out_a_topic_member(now, ahead, sybils_first):
    """Issue 10, DHT: 16 fresh DIDs from one address, dated `ahead` s in the future
    (within the skew) or now, and one honest member of the topic from elsewhere."""
    s = store()
    kid = key_id(topic_key("chess"))
    honest = build_topic_record(ident(1), "chess", now=now - timedelta(seconds=30), ttl=TTL)
    sybils = [build_topic_record(ident(300 + n), "chess", now=now + timedelta(seconds=ahead), ttl=TTL)
              for n in range(16)]
    order = [*sybils, honest] if sybils_first else [honest, *sybils]
    results = {raw: s.put(kid, raw, now=now, source="127.0.0.1" if raw is honest else "127.0.0.2") for raw in order}
    assert results[honest].accepted
    held = s.get(kid, now=now)
    # kept, and served in the first round (one record per group), whatever the Sybils' timestamps
    assert len(held) == 16 and ident(1).did in [r.did for r in held[:2]]
    assert honest in s.reply_value(kid, now=now)
    # more Sybils from the same address only churn that address's own records
    for n in range(20):
        s.put(kid, build_topic_record(ident(400 + n), "chess", now=now + timedelta(seconds=ahead + 1), ttl=TTL),
              now=now, source="127.0.0.2")
    assert ident(1).did in [r.did for r in s.get(kid, now=now)]


def test_a_set_newcomer_from_a_new_group_takes_from_the_largest(now):
    s = store(max_set_entries=4)
    kid = key_id(topic_key("chess"))
    for n in range(3):
        assert s.put(kid, build_topic_record(ident(10 + n), "chess", now=now, ttl=TTL), now=now,
                     source="10.1.1.1").accepted
    assert s.put(kid, build_topic_record(ident(20), "chess", now=now, ttl=TTL), now=now, source="10.2.2.2").accepted
    # full (3 + 1); a third group takes the oldest of the largest group
    r = s.put(kid, build_topic_record(ident(30), "chess", now=now - timedelta(seconds=9), ttl=TTL), now=now,
              source="10.3.3.3")
    assert (r.accepted, r.evicted) == (True, 1)
    assert Counter(s.held_by()) == Counter({"10.1.1.0/24": 2, "10.2.2.0/24": 1, "10.3.3.0/24": 1})
    # the largest group (2) may not push out one holding 1: it replaces its own oldest, or is refused
    older = build_topic_record(ident(40), "chess", now=now - timedelta(seconds=60), ttl=TTL)
    assert s.put(kid, older, now=now, source="10.1.1.1").reason == "set_full"
    newer = build_topic_record(ident(41), "chess", now=now + timedelta(seconds=1), ttl=TTL)
    assert s.put(kid, newer, now=now, source="10.1.1.1").accepted
    assert {r.did for r in s.get(kid, now=now)} >= {ident(20).did, ident(30).did, ident(41).did}
    # our own record takes room from the largest group, and is never taken
    me = ident(0)
    assert s.put(kid, build_topic_record(me, "chess", now=now, ttl=TTL), now=now, source=None).accepted
    for n in range(6):
        s.put(kid, build_topic_record(ident(50 + n), "chess", now=now + timedelta(seconds=2), ttl=TTL), now=now,
              source=f"10.9.{n}.1")
    assert me.did in {r.did for r in s.get(kid, now=now)}


def test_others_records_are_held_at_most_max_hold_after_their_last_store(now):
    s = store(max_hold=timedelta(minutes=30))
    long = timedelta(hours=24)
    theirs = build_topic_record(ident(1), "chess", now=now, ttl=long)
    mine = build_topic_record(ident(0), "chess", now=now, ttl=long)
    kid = key_id(topic_key("chess"))
    assert s.put(kid, theirs, now=now, source="192.0.2.1").accepted
    assert s.put(kid, mine, now=now, source=None).accepted
    # the same record stored again by the same source counts from then
    assert s.put(kid, theirs, now=now + timedelta(minutes=20), source="192.0.2.1").reason == "duplicate"
    assert len(s.get(kid, now=now + timedelta(minutes=49))) == 2
    assert [r.did for r in s.get(kid, now=now + timedelta(minutes=50))] == [ident(0).did]  # ours: until expires
    assert s.held_by() == {}
    # ... but not when another address repeats it
    assert s.put(kid, theirs, now=now + timedelta(minutes=51), source="192.0.2.1").accepted
    s.put(kid, theirs, now=now + timedelta(minutes=70), source="192.0.2.99")
    assert [r.did for r in s.get(kid, now=now + timedelta(minutes=81))] == [ident(0).did]
    with pytest.raises(ValueError):
        StoreLimits(max_hold=timedelta(0))
    with pytest.raises(ValueError):
        StoreLimits(max_entries=0)


# A pool of verified records for property tests (signing once, not per example).
_PROP_NOW = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
_POOL = [
    verify_record(build_topic_record(ident(500 + n), "chess" if n % 3 else "go",
                                     now=_PROP_NOW + timedelta(seconds=n % 7), ttl=TTL), now=_PROP_NOW)
    for n in range(48)
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_POOL) - 1), st.sampled_from(
    ["127.0.0.2", "127.0.0.3", "10.0.0.1", "10.0.0.2", "10.0.1.1", "2001:db8::1", "2001:db8::2", None])),
    max_size=120),
    st.integers(4, 24), st.integers(2, 8), st.integers(1, 6))
def test_store_invariants_under_any_sequence_of_stores(steps, max_entries, max_set, per_source):
    """Any sequence of stores: the bounds hold, the books balance, every set is served
    fairly, and a group's records are only ever taken by a group holding fewer."""
    limits = StoreLimits(max_entries=max_entries, max_set_entries=max_set, max_per_source=per_source,
                         max_per_group=per_source + 1, max_bytes=max_entries * 400)
    s = RecordStore(own_did=ident(0).did, min_difficulty=D, limits=limits)
    for index, source in steps:
        rec = _POOL[index]
        kid = key_id(rec.key)
        group = s.group_of(source)
        before = {e.seq: e for es in s._sets.values() for e in es.values()}
        store_counts = Counter(s.held_by())
        set_counts = Counter(e.group for e in s._sets.get(kid, {}).values())
        result = s.put_record(kid, rec, now=_PROP_NOW, source=source)
        after = {e.seq for es in s._sets.values() for e in es.values()}
        for seq, entry in before.items():
            if seq in after or entry.group == group:
                continue  # kept, or room made in the newcomer's own group
            assert result.accepted and entry.group != OWN_GROUP  # own records are never taken by others
            if entry.kid == kid and entry.record.did == rec.did:
                continue  # replaced by its signer's newer record
            # taken from a group that held more than the newcomer's: in the set (by two), or in the store
            assert (
                group == OWN_GROUP
                or (entry.kid == kid and set_counts[entry.group] >= set_counts[group] + 2)
                or store_counts[entry.group] >= store_counts[group] + 1
            ), (entry.group, group, set_counts, store_counts)
        assert len(s) <= max_entries and s.stats()["stored_bytes"] <= limits.max_bytes
        held = list(s.records(now=_PROP_NOW))
        assert len(held) == len(s)
        per_kid = Counter(kid for kid, _ in held)
        assert all(n <= max_set for n in per_kid.values())
        assert all(n <= per_source for n in Counter(e.source for es in s._sets.values() for e in es.values()
                                                   if e.source is not None).values())
        assert sum(s.held_by().values()) == sum(1 for es in s._sets.values() for e in es.values()
                                                if e.source is not None)
        for kid in per_kid:
            served = s.get(kid, now=_PROP_NOW)
            assert len({r.did for r in served}) == len(served) == per_kid[kid]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_POOL) - 1), st.sampled_from(["127.0.0.2", "10.0.0.1", "10.0.1.1", None]),
                          st.integers(0, 40)), max_size=80))
def test_store_holds_nothing_past_its_time_under_any_sequence(steps):
    """Stores (some repeated, which refresh) with the clock moving on by 0..40 min:
    nothing is served past `expires` or, for others' records, past `max_hold` after the
    last STORE of it from its source; the books balance after every cull."""
    limits = StoreLimits(max_entries=12, max_set_entries=4, max_hold=timedelta(minutes=45))
    s = RecordStore(own_did=ident(0).did, min_difficulty=D, limits=limits)
    now = _PROP_NOW
    last_store: dict[tuple[bytes, str], datetime] = {}
    for index, source, minutes in steps:
        now += timedelta(minutes=minutes)
        rec = _POOL[index]
        kid = key_id(rec.key)
        s.cull(now)  # what put_record does first: an entry past its time is no longer "held"
        held = s._sets.get(kid, {}).get(rec.did)
        result = s.put_record(kid, rec, now=now, source=source)
        if result.accepted and source is not None and (held is None or held.source == source):
            last_store[(kid, rec.did)] = now
        for k, r in s.records(now=now):
            entry = s._sets[k][r.did]
            assert r.expires > now
            if entry.source is not None:
                assert now < last_store[(k, r.did)] + limits.max_hold
        assert len(s) == sum(len(es) for es in s._sets.values()) <= limits.max_entries
        assert sum(s.held_by().values()) == sum(1 for es in s._sets.values() for e in es.values()
                                                if e.source is not None)
        assert s.stats()["stored_bytes"] == sum(len(e.record.raw) for es in s._sets.values() for e in es.values())


def test_stored_records_cost_their_size_not_orjsons_buffer_and_own_ones_can_be_dropped(now):
    """Issue 11: orjson hands its output over in a buffer of at least 4 KiB, and a store
    keeps its records for hours; each stored record must cost about its own size.
    Own records are counted (`stored_own`) and can be dropped when no longer published."""
    import tracemalloc

    alice = ident(1)
    s = store(own=alice)
    containers = [f"{CONTAINER}{n}" for n in range(300)]
    raws = [build_provider_record(alice, c, now=now, ttl=TTL) for c in containers]  # allocated before measuring
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for c, raw in zip(containers, raws):
            assert s.put(key_id(provider_key(c)), raw, now=now, source=None).accepted
        per_record = (tracemalloc.get_traced_memory()[0] - before) / len(raws)
    finally:
        tracemalloc.stop()
    assert len(raws[0]) < 400
    assert per_record < 2500, per_record  # before: ~5900 (4 KiB of it the orjson buffer)
    assert s.stats()["stored_own"] == 300 and s.own_record(key_id(provider_key(containers[0]))) is not None
    assert s.drop_own(key_id(provider_key(containers[0])))
    assert not s.drop_own(key_id(provider_key(containers[0])))
    assert s.own_record(key_id(provider_key(containers[0]))) is None
    assert s.stats()["stored_own"] == 299 and len(s) == 299
    # a record stored by another node is not ours to drop
    bob = ident(2)
    assert s.put(key_id(provider_key(CONTAINER)), build_provider_record(bob, CONTAINER, now=now, ttl=TTL), now=now,
                 source="10.0.0.1").accepted
    assert not s.drop_own(key_id(provider_key(CONTAINER))) and len(s) == 300 and s.stats()["stored_own"] == 299
