"""Peer handshake state machine: mutual authentication, failures, replay, reflection, fuzz."""

from __future__ import annotations

import copy
import random
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.encoding import b64url_decode, b64url_encode
from hmpnode.container.verify import Verifier
from hmpnode.identity import Identity
from hmpnode.identity.keys import ed25519_verify
from hmpnode.net.announce import build_peer_announce
from hmpnode.net.handshake import REASONS, Handshake, transcript_bytes
from tests.conftest import NOW

D = 2
ALICE = Identity(bytes([1]) * 32)
BOB = Identity(bytes([2]) * 32)
CAROL = Identity(bytes([3]) * 32)


def _announce(identity, **kw):
    kw.setdefault("addresses", [f"tcp://{identity.did[-6:].lower()}.example:7420"])
    return build_peer_announce(identity, now=NOW - timedelta(minutes=1), difficulty=D, **kw)


ANN = {who.did: _announce(who) for who in (ALICE, BOB, CAROL)}


def _rng(seed):
    r = random.Random(repr(seed))
    return lambda n: r.randbytes(n)


def _hs(identity, role, *, seed=None, announce=None, compression=("zstd", "gzip"),
        encryption=("x25519-chacha20poly1305",), max_age=None):
    return Handshake(
        identity,
        announce if announce is not None else ANN[identity.did],
        role=role,
        rng=_rng(seed if seed is not None else (identity.did, role)),
        now=NOW,
        verifier=Verifier(),
        min_difficulty=D,
        supported_compression=compression,
        supported_encryption=encryption,
        max_age=max_age,
    )


def _run(i, r):
    """Drive both machines to the end; return the messages each side sent."""
    sent_i = i.start()
    assert r.start() == []
    sent_r = r.receive(sent_i[0])
    out = []
    for m in sent_r:
        out += i.receive(m)
    for m in out:
        assert r.receive(m) == []
    return sent_i + out, sent_r


def _failed(h, reason):
    assert h.failed and not h.done and h.reason == reason and h.peer is None, (h.reason, h.detail)
    assert reason in REASONS


# -- the happy path --------------------------------------------------------------


def test_full_handshake():
    i, r = _hs(ALICE, "initiator"), _hs(BOB, "responder")
    sent_i, sent_r = _run(i, r)
    assert [m["type"] for m in sent_i] == ["hello", "proof"]
    assert [m["type"] for m in sent_r] == ["hello", "proof"]
    assert i.done and r.done and not i.failed and not r.failed and i.reason is None
    assert i.peer.did == BOB.did and i.peer.public_key == BOB.public_key
    assert r.peer.did == ALICE.did and r.peer.public_key == ALICE.public_key
    assert i.peer.announce.ok and i.peer.announce.addresses == tuple(
        a["addr"] for a in ANN[BOB.did]["hmp_container"]["payload"]["addresses"]
    )
    assert r.peer.verify_result.ok
    hello = sent_i[0]
    assert set(hello) == {"type", "version", "nonce", "announce", "compression", "encryption"}
    assert hello["version"] == 1 and len(b64url_decode(hello["nonce"])) == 32 and len(hello["nonce"]) == 43
    assert hello["announce"] == ANN[ALICE.did]
    # the proofs sign exactly the documented transcript
    for proof, signer, role in ((sent_r[1], BOB, "responder"), (sent_i[1], ALICE, "initiator")):
        assert proof == {"type": "proof", "did": signer.did, "public_key": signer.public_key_b58,
                         "signature": proof["signature"]}
        data = transcript_bytes(initiator_nonce=hello["nonce"], responder_nonce=sent_r[0]["nonce"],
                                initiator_did=ALICE.did, responder_did=BOB.did, role=role)
        assert data.startswith(b'{"context":"hmp-handshake-v1","initiator_did":')
        assert ed25519_verify(signer.public_key, data, b64url_decode(proof["signature"]))
    # finished: nothing more is sent, anything more is a protocol error
    assert i.receive(sent_r[1]) == []
    _failed(i, "unexpected_message")


def test_algorithm_intersection_in_our_preference_order():
    i = _hs(ALICE, "initiator", compression=["gzip", "zstd", "br"], encryption=["x25519-chacha20poly1305", "e2"])
    r = _hs(BOB, "responder", compression=["zstd", "gzip"], encryption=["other"])
    _run(i, r)
    assert i.peer.compression == ("gzip", "zstd") and r.peer.compression == ("zstd", "gzip")
    assert i.peer.encryption == () and r.peer.encryption == ()


def test_start_and_constructor_misuse_raise():
    h = _hs(ALICE, "initiator")
    with pytest.raises(RuntimeError):
        h.receive({"type": "hello"})
    h.start()
    with pytest.raises(RuntimeError):
        h.start()
    with pytest.raises(ValueError):
        _hs(ALICE, "observer")
    with pytest.raises(ValueError):
        _hs(ALICE, "initiator", announce=ANN[BOB.did])
    with pytest.raises(ValueError):
        _hs(ALICE, "initiator", compression="zstd")


# -- failures ----------------------------------------------------------------------


def _hello_of(identity, seed="x"):
    h = _hs(identity, "initiator", seed=seed)
    return h.start()[0]


def _responder_after(hello):
    r = _hs(BOB, "responder")
    r.start()
    return r, r.receive(hello)


def _initiator_after_hello():
    """Alice's initiator, having sent hello; Bob's genuine reply."""
    i, r = _hs(ALICE, "initiator"), _hs(BOB, "responder")
    hello = i.start()[0]
    r.start()
    return i, r, hello, r.receive(hello)


@pytest.mark.parametrize("message", [
    None, 1, "hello", [], {}, {"type": 1}, {"type": "hello"},
    {"type": "hello", "version": 2},
    {"type": "hello", "version": True},
])
def test_malformed_messages(message):
    r = _hs(BOB, "responder")
    r.start()
    assert r.receive(message) == []
    _failed(r, "malformed")
    assert r.receive(_hello_of(ALICE)) == []  # failure is final
    _failed(r, "malformed")


@pytest.mark.parametrize("field,value", [
    ("nonce", "short"), ("nonce", b64url_encode(bytes(32)) + "=="), ("nonce", b64url_encode(bytes(31))),
    ("nonce", None), ("compression", "zstd"), ("compression", [1]), ("compression", ["x"] * 33),
    ("encryption", [""]), ("encryption", None), ("announce", "not a container"),
])
def test_malformed_hello_fields(field, value):
    hello = dict(_hello_of(ALICE), **{field: value})
    r, out = _responder_after(hello)
    assert out == []
    _failed(r, "malformed")


def test_malformed_proofs():
    for change in ({"did": None}, {"public_key": "0OIl"}, {"public_key": b64url_encode(bytes(8))}, {"signature": "+/"}):
        i, _, _, (hello_r, proof_r) = _initiator_after_hello()
        i.receive(hello_r)
        assert i.receive(dict(proof_r, **change)) == []
        _failed(i, "malformed")


def test_unexpected_messages():
    i, _, _, (hello_r, proof_r) = _initiator_after_hello()
    assert i.receive(proof_r) == []  # proof before hello
    _failed(i, "unexpected_message")

    i, _, _, (hello_r, proof_r) = _initiator_after_hello()
    i.receive(hello_r)
    assert i.receive(hello_r) == []  # hello twice
    _failed(i, "unexpected_message")

    r = _hs(BOB, "responder")
    r.start()
    assert r.receive({"type": "ping"}) == []
    _failed(r, "unexpected_message")


def test_bad_announce():
    hello = _hello_of(ALICE)
    cases = {
        "tampered": copy.deepcopy(hello["announce"]),
        "expired": _announce(ALICE, ttl=NOW - timedelta(seconds=1)),
        "weak": build_peer_announce(ALICE, addresses=["tcp://a.example:1"], now=NOW, difficulty=0, rng_start=0),
        "revoked": _announce(ALICE, addresses=[], key_is_falsified=True),
        "no_address": _announce(ALICE, addresses=[]),
    }
    cases["tampered"]["hmp_container"]["payload"]["name"] = "mallory"
    assert cases["weak"]["hmp_container"]["payload"]["addresses"][0]["difficulty"] < D  # deterministic (nonce 0)
    for name, announce in cases.items():
        r, out = _responder_after(dict(hello, announce=announce))
        assert out == [], name
        _failed(r, "bad_announce")


def test_self_connection_by_did_and_by_nonce():
    # a peer presenting our own (valid) announce
    r, out = _responder_after(dict(_hello_of(ALICE), announce=ANN[BOB.did]))
    assert out == []
    _failed(r, "self_connection")
    # our own hello reflected back (same nonce)
    i = _hs(ALICE, "initiator")
    hello = i.start()[0]
    assert i.receive(hello) == []
    _failed(i, "self_connection")
    # the nonce alone echoed by another node
    i = _hs(ALICE, "initiator")
    hello = i.start()[0]
    assert i.receive(dict(_hello_of(CAROL), nonce=hello["nonce"])) == []
    _failed(i, "self_connection")


def test_did_mismatch():
    # Carol answers with Bob's announce but proves as Carol
    i, _, hello, (hello_r, _) = _initiator_after_hello()
    carol = _hs(CAROL, "responder")
    carol.start()
    _, proof_c = carol.receive(hello)
    i.receive(hello_r)
    assert i.receive(proof_c) == []
    _failed(i, "did_mismatch")


def test_key_mismatch():
    i, _, _, (hello_r, proof_r) = _initiator_after_hello()
    i.receive(hello_r)
    assert i.receive(dict(proof_r, public_key=CAROL.public_key_b58)) == []
    _failed(i, "key_mismatch")


def test_bad_signature():
    i, _, _, (hello_r, proof_r) = _initiator_after_hello()
    i.receive(hello_r)
    sig = bytearray(b64url_decode(proof_r["signature"]))
    sig[0] ^= 1
    assert i.receive(dict(proof_r, signature=b64url_encode(bytes(sig)))) == []
    _failed(i, "bad_signature")
    # and the responder refuses a bad initiator proof
    i, r = _hs(ALICE, "initiator"), _hs(BOB, "responder")
    r.start()
    hello_r, proof_r = r.receive(i.start()[0])
    i.receive(hello_r)
    (proof_i,) = i.receive(proof_r)
    assert r.receive(dict(proof_i, signature=b64url_encode(bytes(64)))) == []
    _failed(r, "bad_signature")


def test_replayed_proof_from_another_session_fails():
    # a recorded session between Alice and Bob...
    old_i, old_r = _hs(ALICE, "initiator", seed=1), _hs(BOB, "responder", seed=2)
    sent_i, sent_r = _run(old_i, old_r)
    assert old_i.done and old_r.done
    # ...replayed by Mallory, who posts Bob's announce and proof to Alice (fresh nonces)
    i = _hs(ALICE, "initiator", seed=3)
    i.start()
    assert i.receive(dict(sent_r[0], nonce=b64url_encode(bytes(range(32))))) == []
    assert i.receive(sent_r[1]) == []
    _failed(i, "bad_signature")
    # ...or to Bob as the responder: Alice's old initiator proof does not fit the new nonce
    r = _hs(BOB, "responder", seed=4)
    r.start()
    assert [m["type"] for m in r.receive(sent_i[0])] == ["hello", "proof"]
    assert r.receive(sent_i[1]) == []
    _failed(r, "bad_signature")


def test_reflected_proof_with_role_swapped_fails():
    # Bob signs as initiator over the very nonces/DIDs of this session: the signature is
    # genuine, but it is presented as the responder's proof.
    i, r = _hs(ALICE, "initiator"), _hs(BOB, "responder")
    hello_i = i.start()[0]
    r.start()
    hello_r, proof_r = r.receive(hello_i)
    data = transcript_bytes(initiator_nonce=hello_i["nonce"], responder_nonce=hello_r["nonce"],
                            initiator_did=ALICE.did, responder_did=BOB.did, role="initiator")
    swapped = dict(proof_r, signature=b64url_encode(BOB.sign(data)))
    i.receive(hello_r)
    assert i.receive(swapped) == []
    _failed(i, "bad_signature")


def test_reflection_between_two_sessions_fails():
    # Mallory (Carol) opens a session to Bob and one to Alice and tries to pass Alice's
    # responder proof to Bob as her own: it names Alice, not Carol, and is the wrong role.
    to_bob, bob = _hs(CAROL, "initiator"), _hs(BOB, "responder")
    hello_c = to_bob.start()[0]
    bob.start()
    bob.receive(hello_c)
    alice = _hs(ALICE, "responder")
    alice.start()
    _, proof_a = alice.receive(hello_c)
    assert bob.receive(proof_a) == []
    _failed(bob, "did_mismatch")
    # relabelled as Carol's, the signature still does not verify
    bob = _hs(BOB, "responder")
    bob.start()
    bob.receive(hello_c)
    assert bob.receive(dict(proof_a, did=CAROL.did, public_key=CAROL.public_key_b58)) == []
    _failed(bob, "bad_signature")


# -- fuzz --------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
TYPES = st.sampled_from(["hello", "proof", "ping", ""]) | st.text(max_size=8)
SHAPED = st.fixed_dictionaries({"type": TYPES}, optional={
    k: JSON for k in ("version", "nonce", "announce", "compression", "encryption", "did", "public_key", "signature")
})


@settings(max_examples=200, deadline=None)
@given(st.lists(JSON | SHAPED, min_size=1, max_size=3), st.sampled_from(["initiator", "responder", "initiator_mid"]))
def test_receive_never_raises(messages, where):
    if where == "initiator_mid":
        h, _, _, (hello_r, _) = _initiator_after_hello()
        h.receive(hello_r)
    else:
        h = _hs(ALICE, where)
        h.start()
    for m in messages:
        out = h.receive(m)
        assert isinstance(out, list)
        if h.failed:
            assert out == [] and h.reason in REASONS
    assert not h.done


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["hello_r", "proof_r"]), st.sampled_from(
    ["type", "version", "nonce", "announce", "compression", "encryption", "did", "public_key", "signature"]), JSON)
def test_mutated_genuine_messages_never_raise(which, key, value):
    i, _, _, (hello_r, proof_r) = _initiator_after_hello()
    msg = dict(hello_r if which == "hello_r" else proof_r, **{key: value})
    if which == "proof_r":
        i.receive(hello_r)
    out = i.receive(msg)
    if i.failed:
        assert out == [] and i.reason in REASONS and i.peer is None
    else:  # only an unchanged value, a member the message does not read, or algorithm lists may pass
        read = {"type", "version", "nonce", "announce", "compression", "encryption"} if which == "hello_r" \
            else {"type", "did", "public_key", "signature"}
        assert msg == (hello_r if which == "hello_r" else proof_r) or key not in read \
            or (key in {"compression", "encryption"} and isinstance(value, list))


def test_an_announce_from_a_clock_ahead_is_clock_skew_with_its_offset():
    """A peer whose clock is an hour ahead signs a valid announce: refused as clock_skew
    (not bad_announce), and the handshake says by how much; a forged one stays bad_announce."""
    hello = _hello_of(ALICE)
    ahead = build_peer_announce(ALICE, addresses=["tcp://a.example:1"], now=NOW + timedelta(hours=1), difficulty=D)
    r, out = _responder_after(dict(hello, announce=ahead))
    assert out == []
    _failed(r, "clock_skew")
    assert r.skew == (ALICE.did, 3600.0) and "3600 s ahead" in r.detail
    forged = copy.deepcopy(ahead)
    forged["hmp_container"]["payload"]["name"] = "mallory"
    r, _ = _responder_after(dict(hello, announce=forged))
    _failed(r, "bad_announce")
    assert r.skew is None
    # within the window: the handshake goes on, and the offset is read all the same
    i, r = _hs(ALICE, "initiator"), _hs(BOB, "responder")
    _run(i, r)
    assert i.done and r.done and r.skew == (ALICE.did, -60.0) and i.skew == (BOB.did, -60.0)


def test_given_a_max_age_an_announce_from_a_clock_behind_is_clock_skew():
    hello = _hello_of(ALICE)
    behind = build_peer_announce(ALICE, addresses=["tcp://a.example:1"], now=NOW - timedelta(hours=1), difficulty=D)
    r = _hs(BOB, "responder", max_age=timedelta(minutes=10))  # as the mesh sets it (its MCE window)
    r.start()
    assert r.receive(dict(hello, announce=behind)) == []
    _failed(r, "clock_skew")
    assert r.skew == (ALICE.did, -3600.0) and "3600 s behind" in r.detail
    # without a max_age (the default) an old announce is no reason to refuse
    r, out = _responder_after(dict(hello, announce=behind))
    assert r.skew == (ALICE.did, -3600.0) and not r.failed and [m["type"] for m in out] == ["hello", "proof"]
