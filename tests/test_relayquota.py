"""Relay admission (hmpnode.net.relayquota): pure decisions over usage figures."""

from __future__ import annotations

from hmpnode.net.relayquota import RelayLimits, RelayUsage, admit, hold_until_us

LIMITS = RelayLimits(max_per_recipient=3, max_bytes_per_recipient=1000, max_total_bytes=10_000,
                     max_per_sender=5, max_bytes_per_sender=2000, max_bytes_per_address=3000,
                     max_unknown_bytes=250, max_hold_seconds=60)


def test_unknown_recipients_share_one_small_pool_whoever_sends():
    usage = RelayUsage()
    got = [admit(LIMITS, usage, sender=f"did:s{i % 3}", address=None, recipients=[f"did:r{i}"],
                 unknown={f"did:r{i}"}, size=100) for i in range(10)]
    assert got == [None, None] + ["relay_unknown_recipient"] * 8
    assert usage.unknown == [2, 200] and usage.total == [2, 200]
    # a known recipient still fits, and does not count against the pool
    assert admit(LIMITS, usage, sender="did:s0", address=None, recipients=["did:known"], unknown=set(), size=100) is None
    assert usage.unknown == [2, 200]


def test_per_sender_count_and_bytes_and_per_address_bytes():
    usage = RelayUsage()
    got = [admit(LIMITS, usage, sender="did:a", address=None, recipients=[f"did:r{i}"], unknown=set(), size=10)
           for i in range(7)]
    assert got == [None] * 5 + ["relay_sender_quota"] * 2
    assert admit(LIMITS, usage, sender="did:b", address=None, recipients=["did:r0"], unknown=set(), size=10) is None
    # bytes per sender
    usage = RelayUsage()
    assert admit(LIMITS, usage, sender="did:a", address=None, recipients=["did:x"], unknown=set(), size=900) is None
    assert admit(LIMITS, usage, sender="did:a", address=None, recipients=["did:y", "did:z"], unknown=set(),
                 size=600) == "relay_sender_quota"  # two holdings: 1200 more
    # one address minting DIDs: its bytes are bounded together
    usage = RelayUsage()
    got = [admit(LIMITS, usage, sender=f"did:fresh{i}", address="192.0.2.7", recipients=[f"did:r{i}"],
                 unknown=set(), size=900) for i in range(5)]
    assert got == [None, None, None, "relay_sender_quota", "relay_sender_quota"]
    assert admit(LIMITS, usage, sender="did:other", address="192.0.2.8", recipients=["did:q"], unknown=set(),
                 size=900) is None


def test_per_recipient_and_total_and_a_refusal_charges_nothing():
    usage = RelayUsage(total=[0, 9_950])
    assert admit(LIMITS, usage, sender="did:a", address=None, recipients=["did:r"], unknown=set(), size=100) == "relay_full"
    assert usage.senders.get("did:a", [0, 0]) == [0, 0] and usage.recipients == {}
    usage = RelayUsage()
    got = [admit(LIMITS, usage, sender=f"did:s{i}", address=None, recipients=["did:r"], unknown=set(), size=10)
           for i in range(4)]
    assert got == [None, None, None, "relay_quota_exceeded"]
    assert usage.total == [3, 30] and usage.recipients == {"did:r": [3, 30]}
    assert usage.senders.get("did:s3", [0, 0]) == [0, 0]


def test_nothing_to_hold_is_admitted():
    usage = RelayUsage(total=[10**9, 10**12])
    assert admit(LIMITS, usage, sender="did:a", address=None, recipients=[], unknown=set(), size=10) is None


def test_hold_time():
    assert hold_until_us(1_000_000, None, 60) == 61_000_000
    assert hold_until_us(1_000_000, 5_000_000, 60) == 5_000_000
    assert hold_until_us(1_000_000, 10**15, 60) == 61_000_000

