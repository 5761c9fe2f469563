"""The node's announce hook of the v2 handshake (hmpnode.net.peerauth), sans-IO: what
the v1 JSON handshake checked of the announce (clock skew both ways with the offset,
revocation, refusal of a claimed DID before any signature work), driven through real
`transport.NoiseHandshake` pairs."""

from __future__ import annotations

import copy
import random
from datetime import timedelta

import orjson
import pytest

from hmpnode.container.verify import Verifier
from hmpnode.identity import Identity
from hmpnode.net.announce import build_peer_announce
from hmpnode.net.peerauth import AnnounceGate, claimed_did
from hmpnode.net.transport import PROLOGUE, KeyPair, NoiseHandshake, TransportError, make_payload
from tests.conftest import NOW

D = 2
ALICE = Identity(bytes([1]) * 32)
BOB = Identity(bytes([2]) * 32)


def _rng(seed):
    r = random.Random(repr(seed))
    return lambda n: r.randbytes(n)


def _announce(identity, at=NOW - timedelta(minutes=1), **kw):
    return build_peer_announce(identity, addresses=["tcp://a.example:1"], now=at, difficulty=D,
                               protocols=["hmp-peer/2"], **kw)


class CountingVerifier(Verifier):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def verify(self, *args, **kwargs):
        self.calls += 1
        return super().verify(*args, **kwargs)


def _handshake(initiator_announce, *, early=None, max_age=None):
    """ALICE dials BOB; BOB's gate judges ALICE's announce. (BOB's gate, BOB's machine,
    the reason BOB failed with or None)."""
    si, sr = KeyPair.generate(_rng("si")), KeyPair.generate(_rng("sr"))
    gate = AnnounceGate(CountingVerifier(), min_difficulty=D, now=NOW, max_age=max_age, early=early)
    i = NoiseHandshake("initiator", si, PROLOGUE, make_payload(ALICE, orjson.dumps(initiator_announce), si.public),
                       _rng("i"), verify_announce=AnnounceGate(Verifier(), min_difficulty=D, now=NOW),
                       own_did=ALICE.did)
    r = NoiseHandshake("responder", sr, PROLOGUE, make_payload(BOB, orjson.dumps(_announce(BOB)), sr.public),
                       _rng("r"), verify_announce=gate, own_did=BOB.did)
    r.read_message(i.write_message())
    i.read_message(r.write_message())
    try:
        r.read_message(i.write_message())
    except TransportError as exc:
        return gate, r, exc.reason
    return gate, r, None


def test_a_good_announce_passes_with_its_offset_and_protocols():
    gate, r, failed = _handshake(_announce(ALICE))
    assert failed is None and r.complete and r.peer.did == ALICE.did
    check, result = gate.checked
    assert check.did == ALICE.did and check.protocols == ("hmp-peer/2",) and result.ok
    assert gate.skew == (ALICE.did, -60.0) and gate.clock_skew is None and gate.refusal is None


def test_an_announce_from_a_clock_ahead_completes_as_clock_skew_with_its_offset():
    """A peer whose clock is an hour ahead signs a valid announce: the handshake completes
    (its key is proven) and the gate says clock_skew with the offset, so the node can tell
    it inside the channel; a forged one fails as bad_announce."""
    ahead = _announce(ALICE, NOW + timedelta(hours=1))
    gate, r, failed = _handshake(ahead)
    assert failed is None and r.complete
    assert gate.skew == (ALICE.did, 3600.0) and "3600 s ahead" in gate.clock_skew and "+3600.000" in gate.clock_skew
    forged = copy.deepcopy(ahead)
    forged["hmp_container"]["payload"]["name"] = "mallory"
    gate, r, failed = _handshake(forged)
    assert failed == "bad_announce" and gate.clock_skew is None and gate.skew is None and not r.complete


def test_given_a_max_age_an_announce_from_a_clock_behind_is_clock_skew():
    behind = _announce(ALICE, NOW - timedelta(hours=1))
    gate, r, failed = _handshake(behind, max_age=timedelta(minutes=10))
    assert failed is None and r.complete
    assert gate.skew == (ALICE.did, -3600.0) and "3600 s behind" in gate.clock_skew
    gate, r, failed = _handshake(behind)  # without a max_age an old announce is no reason to refuse
    assert failed is None and gate.clock_skew is None and gate.skew == (ALICE.did, -3600.0)


def test_a_claimed_did_is_refused_before_any_signature_work():
    """The early hook sees the DID the announce claims and refuses it before the Verifier
    runs (no verification, no identity signature check): a banned DID costs nothing."""
    seen = []

    def early(did):
        seen.append(did)
        return "banned"

    gate, r, failed = _handshake(_announce(ALICE), early=early)
    assert failed == "bad_announce" and gate.refusal == "banned" and seen == [ALICE.did]
    assert gate._verifier.calls == 0 and gate.checked is None and not r.complete
    gate, r, failed = _handshake(_announce(ALICE), early=lambda did: None)
    assert failed is None and gate.refusal is None and gate._verifier.calls == 1


def test_a_revocation_is_refused():
    revocation = build_peer_announce(ALICE, addresses=["tcp://a.example:1"], now=NOW - timedelta(minutes=1),
                                     difficulty=D, key_is_falsified=True)
    gate, r, failed = _handshake(revocation)
    assert failed == "bad_announce" and not r.complete


@pytest.mark.parametrize("raw, did", [
    (b"not json", None), (b"[]", None), (b'{"hmp_container": {"head": {"sender_did": 7}}}', None),
    (b'{"hmp_container": {"head": {"sender_did": "did:x:y"}}}', "did:x:y"),
])
def test_claimed_did_reads_the_head_only(raw, did):
    assert claimed_did(raw) == did
