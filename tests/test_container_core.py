"""Build / verify / encrypt / compress round trips and the flags of VerifyResult."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest

from hmpnode.container import crypto
from hmpnode.container import reasons as R
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.compression import CompressionError, compress, decompress
from hmpnode.container.encoding import EncodingError, b58encode, b64url_decode, b64url_encode, format_time, parse_time, sha256_tag
from hmpnode.container.payload import PayloadError, open_payload
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity, MemoryKeyRegistry
from hmpnode.vectors import DeterministicRng, resign

PAYLOAD = {"title": "t", "text": "hello " * 50}


def _resign(hmp, identity):
    return {"hmp_container": resign(hmp, identity)}


@pytest.mark.parametrize("compression", [None, "zstd", "gzip"])
@pytest.mark.parametrize("n_recipients", [0, 1, 3])
def test_round_trip(alice, now, compression, n_recipients):
    recipients = [Identity(bytes([10 + i]) * 32) for i in range(n_recipients)]
    c = build_container(alice, "note", PAYLOAD, now=now, rng=DeterministicRng("t"), compression=compression,
                        encrypt_to=[Recipient(r.did, r.public_key) for r in recipients] or None)
    head = c["hmp_container"]["head"]
    result = Verifier().verify(encode_wire(c), now=now)
    assert result.ok, result.detail
    assert result.container_did == head["container_did"].strip()
    assert head["container_did"].startswith("did:hmp:container:Qm")
    if n_recipients == 1:
        assert len(head["recipient"]) == 1 and "key_recipient" in head and "group_recipient" not in head
    if n_recipients > 1:
        assert "recipient" not in head and "key_recipient" not in head and len(head["group_recipient"]) == 3
    for r in recipients:
        assert open_payload(c["hmp_container"], r) == PAYLOAD
    if n_recipients:
        with pytest.raises(PayloadError) as err:
            open_payload(c["hmp_container"], alice)
        assert err.value.code == "not_recipient"
    else:
        assert open_payload(c["hmp_container"]) == PAYLOAD


def test_payload_type_and_hash_cover_transmitted_bytes(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now, compression="zstd")
    head, payload = c["hmp_container"]["head"], c["hmp_container"]["payload"]
    assert head["payload_type"] == "zstd+json" and head["compression"] == "zstd"
    assert head["payload_hash"] == sha256_tag(b64url_decode(payload))
    plain = build_container(alice, "note", PAYLOAD, now=now)
    assert plain["hmp_container"]["head"]["payload_hash"] == sha256_tag(canonical_json(PAYLOAD))


def test_verification_hands_over_the_payload_it_opened(alice, bob, now):
    """Callers (the node's index) reuse what verification decompressed; an encrypted
    payload is never opened by verification."""
    v = Verifier()
    for compression in (None, "zstd", "gzip"):
        result = v.verify(encode_wire(build_container(alice, "note", PAYLOAD, now=now, compression=compression)), now=now)
        assert result.ok and result.payload == PAYLOAD
    sealed = build_container(alice, "note", PAYLOAD, now=now, encrypt_to=[Recipient(bob.did, bob.public_key)],
                             rng=os.urandom)
    result = v.verify(encode_wire(sealed), now=now)
    assert result.ok and result.payload is None


def test_signature_excludes_only_signature(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now, head_extra={"x_custom": [1, 2.5]})
    hmp = c["hmp_container"]
    unsigned = dict(hmp, head={k: v for k, v in hmp["head"].items() if k != "signature"})
    sig = b64url_decode(hmp["head"]["signature"])
    import nacl.bindings as sodium

    sodium.crypto_sign_open(sig + canonical_json(unsigned), alice.public_key)


def test_bare_form_accepted(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now)
    result = Verifier().verify(json.dumps(c["hmp_container"]), now=now)
    assert result.ok and result.container["hmp_container"] == c["hmp_container"]


def test_unsigned_blocks_do_not_affect_validity(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now)
    c["referenced-by"] = {"links": []}
    c["evaluations"] = {"items": []}
    c["relay_chain"] = [{"relay_did": "did:hmp:agent:x"}]
    assert Verifier().verify(encode_wire(c), now=now).ok


def test_expired_is_flagged_not_rejected(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now, ttl=now + timedelta(minutes=5))
    assert not Verifier().verify(c, now=now).expired
    later = Verifier().verify(c, now=now + timedelta(minutes=5))
    assert later.ok and later.expired


def test_future_timestamp_within_skew_is_accepted(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now + timedelta(seconds=299))
    assert Verifier().verify(c, now=now).ok
    c = build_container(alice, "note", PAYLOAD, now=now + timedelta(seconds=301))
    assert Verifier().verify(c, now=now).reason == R.FUTURE_TIMESTAMP


def test_store_and_forward_flags(alice, now):
    c = build_container(alice, "x_unknown_class", PAYLOAD, now=now)
    assert Verifier().verify(c, now=now).store_and_forward == {"class"}
    # A compression and an encryption we do not know: verified, stored, forwarded unopened.
    hmp = {"head": dict(c["hmp_container"]["head"]), "payload": b64url_encode(b"opaque bytes")}
    hmp["head"].update({"compression": "brotli", "payload_type": "encrypted+brotli+json",
                        "encryption_algo": "rsa-oaep-sha256", "key_recipient": b64url_encode(b"k" * 10),
                        "recipient": ["did:hmp:agent:x"], "payload_hash": sha256_tag(b"opaque bytes")})
    result = Verifier().verify(_resign(hmp, alice), now=now)
    assert result.ok, result.detail
    assert result.store_and_forward == {"class", "compression", "encryption"}


def test_tofu_pin_candidate_and_pinned_key(alice, bob, now):
    c = build_container(alice, "note", PAYLOAD, now=now)
    hmp = c["hmp_container"]
    hmp["head"]["sender_did"] = "did:other:alice"
    signed = _resign(hmp, alice)
    result = Verifier().verify(signed, now=now)
    assert result.ok and result.pin_candidate == ("did:other:alice", alice.public_key)
    registry = MemoryKeyRegistry()
    registry.pin("did:other:alice", bob.public_key)
    assert Verifier(registry=registry).verify(signed, now=now).reason == R.KEY_MISMATCH
    registry2 = MemoryKeyRegistry()
    registry2.pin("did:other:alice", alice.public_key)
    del hmp["head"]["public_key"]
    resigned = _resign(hmp, alice)
    assert Verifier(registry=registry2).verify(resigned, now=now).ok
    assert Verifier().verify(resigned, now=now).reason == R.UNKNOWN_KEY


def test_revocation_rejects_later_flags_earlier(alice, now):
    registry = MemoryKeyRegistry()
    registry.revoke(alice.did, now)
    before = build_container(alice, "note", PAYLOAD, now=now - timedelta(seconds=1))
    at = build_container(alice, "note", PAYLOAD, now=now)
    after = build_container(alice, "note", PAYLOAD, now=now + timedelta(seconds=1))
    v = Verifier(registry=registry)
    assert v.verify(before, now=now).key_revoked_later
    assert v.verify(at, now=now).ok  # the revocation itself carries this timestamp
    assert v.verify(after, now=now + timedelta(seconds=2)).reason == R.REVOKED


def test_group_and_single_fields_are_exclusive(alice, bob, carol, now):
    c = build_container(alice, "note", PAYLOAD, now=now, rng=os.urandom,
                        encrypt_to=[Recipient(bob.did, bob.public_key), Recipient(carol.did, carol.public_key)])
    hmp = c["hmp_container"]
    hmp["head"]["recipient"] = [bob.did]
    assert Verifier().verify(_resign(hmp, alice), now=now).reason == R.SCHEMA


def test_tampered_envelope_and_ciphertext(alice, bob, now):
    c = build_container(alice, "note", PAYLOAD, now=now, rng=os.urandom, encrypt_to=[Recipient(bob.did, bob.public_key)])
    hmp = json.loads(json.dumps(c["hmp_container"]))
    env = bytearray(b64url_decode(hmp["head"]["key_recipient"]))
    env[40] ^= 1
    hmp["head"]["key_recipient"] = b64url_encode(bytes(env))
    with pytest.raises(PayloadError) as err:
        open_payload(hmp, bob)
    assert err.value.code == "decrypt_failed"
    hmp = json.loads(json.dumps(c["hmp_container"]))
    body = bytearray(b64url_decode(hmp["payload"]))
    body[-1] ^= 1
    hmp["payload"] = b64url_encode(bytes(body))
    with pytest.raises(PayloadError) as err:
        open_payload(hmp, bob)
    assert err.value.code == "decrypt_failed"
    # ...and the signature check catches the same tampering without any key:
    assert Verifier().verify({"hmp_container": hmp}, now=now).reason == R.PAYLOAD_HASH_MISMATCH


def test_envelope_construction_matches_profile(bob):
    """Rebuild one envelope by hand from the profile's formula and compare."""
    import nacl.bindings as sodium
    import nacl.encoding
    import nacl.hash

    rng = DeterministicRng("envelope")
    key = bytes(range(32))
    envelope = crypto.seal_key(key, bob.public_key, rng)
    eph_secret = rng.draws[0]
    x = sodium.crypto_sign_ed25519_pk_to_curve25519(bob.public_key)
    e_pub = sodium.crypto_scalarmult_base(eph_secret)
    shared = sodium.crypto_scalarmult(eph_secret, x)
    kek = nacl.hash.blake2b(shared + e_pub + x, digest_size=32, person=b"hmp-key-recip-v1", encoder=nacl.encoding.RawEncoder)
    expected = e_pub + sodium.crypto_aead_chacha20poly1305_ietf_encrypt(key, e_pub, bytes(12), kek)
    assert envelope == expected and len(envelope) == 80
    assert crypto.open_key(envelope, bob) == key


def test_compression_bounds():
    bomb = compress(b"\0" * (20 * 1024 * 1024), "zstd")
    with pytest.raises(CompressionError):
        decompress(bomb, "zstd")
    gz = compress(b"\0" * (20 * 1024 * 1024), "gzip")
    with pytest.raises(CompressionError):
        decompress(gz, "gzip")
    for algo in ("zstd", "gzip"):
        data = compress(b"abc" * 100, algo)
        assert decompress(data, algo) == b"abc" * 100
        for bad in (data + b"x", data[:-3], b"", data + data):
            with pytest.raises(CompressionError):
                decompress(bad, algo)


def test_compressed_bomb_inside_signed_container_is_malformed(alice, now):
    c = build_container(alice, "note", {"text": "x" * (17 * 1024 * 1024)}, now=now, compression="zstd")
    assert len(encode_wire(c)) < 1024 * 1024
    result = Verifier().verify(encode_wire(c), now=now)
    assert (result.ok, result.reason) == (False, R.MALFORMED) and "limit" in result.detail


def test_encodings():
    assert b64url_encode(b"\xff\xfe") == "__4"
    assert b64url_decode("__4") == b64url_decode("__4=") == b"\xff\xfe"
    # trailing padding, however much, is ignored (spec A.4.3(5), profile section 13); refused before
    assert b64url_decode("QQ") == b64url_decode("QQ=") == b64url_decode("QQ===") == b"A"
    assert b64url_decode("QUJD=") == b64url_decode("QUJD====") == b"ABC"
    for only_padding in ("=", "=====", "QR=", "QQ=A"):  # no data, non-canonical bits, '=' inside
        with pytest.raises(EncodingError):
            b64url_decode(only_padding)
    for bad in ("__5", "+/4", "a", "ab=c", "ab===", "*", "ab\n"):
        with pytest.raises(EncodingError):
            b64url_decode(bad)
    assert format_time(parse_time("2026-11-29T10:15:00.123456Z")) == "2026-11-29T10:15:00.123Z"
    for bad in ("2026-11-29 10:15:00Z", "2026-11-29T10:15:00+00:00", "2026-13-01T00:00:00Z", "2026-11-29T10:15:00.1234567Z"):
        with pytest.raises(EncodingError):
            parse_time(bad)
    assert b58encode(b"\0\0\1") == "112"


def test_build_rejects_conflicting_options(alice, bob, now):
    with pytest.raises(ValueError):
        build_container(alice, "n", {}, now=now, compression="brotli")
    with pytest.raises(ValueError):
        build_container(alice, "n", {}, now=now, head_extra={"signature": "x"})
    with pytest.raises(ValueError):
        build_container(alice, "n", {}, now=now, recipients=[bob.did], encrypt_to=[Recipient(bob.did, bob.public_key)])


def test_tofu_for_agent_dids_that_are_not_self_certifying(alice, now):
    c = build_container(alice, "note", PAYLOAD, now=now)
    hmp = c["hmp_container"]
    hmp["head"]["sender_did"] = "did:hmp:agent:B"  # the spec's own example form
    result = Verifier().verify(_resign(hmp, alice), now=now)
    assert result.ok and result.pin_candidate == ("did:hmp:agent:B", alice.public_key)


def test_binary_payloads(alice, now):
    c = build_container(alice, "x_blob", b"\x00\x01binary", now=now, binary=True, compression="zstd")
    assert c["hmp_container"]["head"]["payload_type"] == "zstd+binary"
    assert Verifier().verify(c, now=now).ok
    assert open_payload(c["hmp_container"]) == b"\x00\x01binary"
    # a corrupt frame under a valid signature is malformed
    hmp = c["hmp_container"]
    hmp["payload"] = b64url_encode(b"not zstd")
    hmp["head"]["payload_hash"] = sha256_tag(b"not zstd")
    assert Verifier().verify(_resign(hmp, alice), now=now).reason == R.MALFORMED
    # a known class carries JSON
    g = build_container(alice, "x_blob", b"raw", now=now, binary=True)
    g["hmp_container"]["head"]["class"] = "goal"
    assert Verifier().verify(_resign(g["hmp_container"], alice), now=now).reason == R.CLASS_SCHEMA


def test_strict_json_inside_compressed_payload(alice, now):
    from hmpnode.container.compression import compress

    for text in (b'{"title":"a","title":"b"}', b'{"n":18446744073709551616}', b'{"n":NaN}'):
        data = compress(text, "zstd")
        c = build_container(alice, "x_note", {}, now=now)
        hmp = c["hmp_container"]
        hmp["head"].update(payload_type="zstd+json", compression="zstd", payload_hash=sha256_tag(data))
        hmp["payload"] = b64url_encode(data)
        result = Verifier().verify(_resign(hmp, alice), now=now)
        assert result.reason == R.MALFORMED, (text, result)


@pytest.mark.parametrize("text", [b'{"a":1,"a":2}', b'{"n":18446744073709551616}', b'{"n":9007199254740992}',
                                  b'{"n":-Infinity}', b'[' * 70 + b']' * 70])
def test_loads_strict_rejects(text):
    from hmpnode.container.canonical import CanonicalError, loads_strict

    with pytest.raises(CanonicalError):
        loads_strict(text)


def test_builder_checks_plaintext_against_the_class_schema(alice, bob, now):
    with pytest.raises(ValueError, match="schema"):
        build_container(alice, "goal", {"title": "bad priority", "priority": "high"}, now=now, rng=os.urandom,
                        encrypt_to=[Recipient(bob.did, bob.public_key)])
    with pytest.raises(ValueError):
        build_container(alice, "note", {}, now=now, ttl="next tuesday")


def test_nesting_limit_is_on_the_full_form(alice, now):
    from hmpnode.container.canonical import CanonicalError

    def nest(n):
        v: dict = {}
        for _ in range(n):
            v = {"a": v}
        return v

    c = build_container(alice, "note", nest(61), now=now)  # payload at depth 2: deepest dict at 63
    assert Verifier().verify(encode_wire(c), now=now).ok
    with pytest.raises(CanonicalError):
        build_container(alice, "note", nest(62), now=now)


def test_builder_output_always_verifies_or_is_refused(alice, now):
    with pytest.raises(ValueError):
        build_container(alice, "goal", b"raw", now=now, binary=True)
    for bad in ({"network": "wan"}, {"network": "lan:999.1.1.1/8"}, {"confidence": 2.0}, {"tags": ["x" * 300]}):
        with pytest.raises(ValueError):
            build_container(alice, "note", {}, now=now, **bad)


def test_bare_form_nesting_matches_full_form(alice, now):
    def nest(n):
        v: dict = {}
        for _ in range(n):
            v = {"a": v}
        return v

    c = build_container(alice, "note", nest(61), now=now)
    assert Verifier().verify(json.dumps(c["hmp_container"]), now=now).ok
    hmp = c["hmp_container"]
    hmp["payload"] = nest(62)
    hmp["head"]["payload_hash"] = sha256_tag(canonical_json(hmp["payload"]))
    bare = json.dumps(_resign(hmp, alice)["hmp_container"])
    assert Verifier().verify(bare, now=now).reason == R.MALFORMED


def test_size_limit_applies_to_parsed_input_too(alice, now):
    from hmpnode.container.verify import Limits

    c = build_container(alice, "note", {"text": "x" * 5000}, now=now)
    assert Verifier().verify(c, now=now).ok
    small = Verifier(limits=Limits(max_container_bytes=4096))
    assert small.verify(c, now=now).reason == R.MALFORMED
    assert small.verify({"hmp_container": {"head": {}, "payload": {"n": 2**60}}}, now=now).reason == R.MALFORMED
