"""Rate limits, strikes and bans (hmpnode.net.penalty): pure, time passed in."""

from __future__ import annotations

import pytest

from hmpnode.net.penalty import STRIKE_COST, BanList, DidChurn, Strikes, TokenBucket

T0 = 1_000.0  # an arbitrary monotonic start, far from 0


# -- TokenBucket -----------------------------------------------------------------------


def test_bucket_starts_full_then_refuses_after_burst():
    bucket = TokenBucket(rate=1.0, burst=5)
    assert [bucket.take(T0) for _ in range(5)] == [True] * 5
    assert bucket.take(T0) is False
    assert bucket.take(T0) is False  # a refusal costs nothing, still empty
    assert bucket.tokens == pytest.approx(0.0)


def test_bucket_refills_at_rate():
    bucket = TokenBucket(rate=2.0, burst=4)
    for _ in range(4):
        assert bucket.take(T0)
    assert not bucket.take(T0)
    # 0.25 s at 2 tokens/s: half a token, not enough
    assert not bucket.take(T0 + 0.25)
    # 0.5 s: one token in all
    assert bucket.take(T0 + 0.5)
    assert not bucket.take(T0 + 0.5)
    # 1.5 s later: three more tokens
    assert [bucket.take(T0 + 2.0) for _ in range(4)] == [True, True, True, False]


def test_bucket_never_saves_more_than_burst():
    bucket = TokenBucket(rate=10.0, burst=3)
    assert bucket.take(T0)
    # a long idle time refills to burst, not to rate * idle
    later = T0 + 3600
    assert [bucket.take(later) for _ in range(4)] == [True, True, True, False]
    assert bucket.tokens <= bucket.burst


def test_bucket_first_take_does_not_credit_time_since_zero():
    bucket = TokenBucket(rate=100.0, burst=2)
    # the first call initialises at `now`: no credit for T0 seconds since at=0
    assert bucket.take(T0) and bucket.take(T0)
    assert not bucket.take(T0)


def test_bucket_amount_greater_than_one():
    bucket = TokenBucket(rate=1.0, burst=10)
    assert bucket.take(T0, amount=7)
    assert bucket.tokens == pytest.approx(3)
    assert not bucket.take(T0, amount=4)  # refused: the 3 tokens stay
    assert bucket.tokens == pytest.approx(3)
    assert bucket.take(T0, amount=3)
    assert not bucket.take(T0, amount=0.5)
    assert bucket.take(T0 + 5, amount=5)


def test_bucket_amount_above_burst_is_always_refused():
    bucket = TokenBucket(rate=1000.0, burst=5)
    assert not bucket.take(T0, amount=6)
    assert not bucket.take(T0 + 1e6, amount=6)
    assert bucket.take(T0 + 1e6, amount=5)


# -- Strikes ----------------------------------------------------------------------------


def test_strike_costs_table():
    assert STRIKE_COST["rejected_container"] == 1
    assert STRIKE_COST["not_addressed"] == 1
    assert STRIKE_COST["rate_limited"] == 2
    assert STRIKE_COST["malformed_frame"] == 5
    assert STRIKE_COST["too_many_items"] == 5
    assert STRIKE_COST["bad_mce"] == 5
    assert STRIKE_COST["frame_too_large"] == 10


@pytest.mark.parametrize("reason", sorted(STRIKE_COST))
def test_each_reason_costs_its_strikes(reason):
    strikes = Strikes(threshold=1000, forgive_per_second=0.0)
    strikes.add(reason, T0)
    assert strikes.count == STRIKE_COST[reason]
    strikes.add(reason, T0, times=3)
    assert strikes.count == 4 * STRIKE_COST[reason]


def test_unknown_reason_costs_one():
    strikes = Strikes(threshold=100, forgive_per_second=0.0)
    strikes.add("something_new", T0)
    assert strikes.count == 1
    assert strikes.by_reason == {"something_new": 1}


def test_threshold_crossed_exactly_when_reached():
    strikes = Strikes(threshold=10, forgive_per_second=0.0)
    assert strikes.add("bad_mce", T0) is False  # 5
    assert strikes.add("rejected_container", T0, times=4) is False  # 9
    assert strikes.add("rejected_container", T0) is True  # 10 == threshold
    assert strikes.add("rejected_container", T0) is True  # still above


def test_one_large_offence_crosses_at_once():
    strikes = Strikes(threshold=10, forgive_per_second=0.0)
    assert strikes.add("frame_too_large", T0) is True


def test_honest_peer_rejections_stay_under_threshold_with_decay():
    # one rejected container every 10 s never accumulates at 0.1 strike/s
    strikes = Strikes(threshold=20)
    for i in range(500):
        assert strikes.add("rejected_container", T0 + 10 * i) is False
    assert strikes.count == pytest.approx(1.0)


def test_strikes_decay_over_time():
    strikes = Strikes(threshold=10, forgive_per_second=0.5)
    strikes.add("bad_mce", T0)  # 5
    strikes.add("rate_limited", T0 + 4)  # 5 - 2 + 2 = 5
    assert strikes.count == pytest.approx(5.0)
    # after enough time the count floors at zero, never negative
    assert strikes.add("rejected_container", T0 + 1000) is False
    assert strikes.count == pytest.approx(1.0)


def test_decay_can_prevent_crossing():
    fast = Strikes(threshold=10, forgive_per_second=1.0)
    slow = Strikes(threshold=10, forgive_per_second=0.0)
    for s in (fast, slow):
        s.add("bad_mce", T0)
    assert fast.add("bad_mce", T0 + 2) is False  # 5 - 2 + 5 = 8
    assert slow.add("bad_mce", T0 + 2) is True  # 10


def test_first_add_with_large_now_is_full_cost():
    # `at` starts at 0; a large first `now` must not forgive the new strikes
    strikes = Strikes(threshold=5)
    assert strikes.add("bad_mce", 1e9) is True
    assert strikes.count == 5


def test_by_reason_counts_offences_not_cost():
    strikes = Strikes(threshold=1000, forgive_per_second=1.0)
    strikes.add("bad_mce", T0)
    strikes.add("bad_mce", T0 + 100)
    strikes.add("rejected_container", T0 + 100, times=7)
    # decay forgives strikes, not the record of what happened
    assert strikes.by_reason == {"bad_mce": 2, "rejected_container": 7}


# -- BanList ----------------------------------------------------------------------------


def test_banned_until_expiry():
    bans = BanList(seconds=60)
    assert not bans.banned("did:hmp:agent:x", T0)
    bans.ban("did:hmp:agent:x", T0)
    assert bans.banned("did:hmp:agent:x", T0)
    assert bans.banned("did:hmp:agent:x", T0 + 59.9)
    assert not bans.banned("did:hmp:agent:x", T0 + 60)  # expiry is exclusive
    assert "did:hmp:agent:x" not in bans.until  # expired entries are dropped when seen
    assert not bans.banned("did:hmp:agent:x", T0 + 30)  # and stay gone


def test_ban_is_per_key():
    bans = BanList(seconds=60)
    bans.ban("192.0.2.1", T0)
    assert bans.banned("192.0.2.1", T0 + 1)
    assert not bans.banned("192.0.2.2", T0 + 1)


def test_rebanning_extends():
    bans = BanList(seconds=60)
    bans.ban("k", T0)
    bans.ban("k", T0 + 50, 60)
    assert bans.banned("k", T0 + 100)
    assert not bans.banned("k", T0 + 110)


def test_a_shorter_ban_never_shortens_a_running_one():
    bans = BanList(seconds=60)
    bans.ban("k", T0)
    bans.ban("k", T0 + 1, 5)
    assert bans.banned("k", T0 + 59)


def test_repeat_offenders_are_banned_longer_up_to_a_limit():
    bans = BanList(seconds=10, max_factor=8)
    lengths = []
    at = T0
    for _ in range(6):
        lengths.append(bans.ban("k", at))
        at += lengths[-1] + 1  # banned again right after the ban ended
        assert not bans.banned("k", at)
    assert lengths == [10, 20, 40, 80, 80, 80]
    # a key that stayed clean for long enough starts again at one ban length
    assert bans.ban("k", at + 4 * 80 + 1) == 10
    assert bans.ban("other", at) == 10  # per key


def test_restored_bans_keep_their_length_and_end():
    bans = BanList(seconds=600)
    assert bans.ban("k", T0, 3) == 3  # as loaded from the store: the rest of the ban
    assert bans.banned("k", T0 + 2.9) and not bans.banned("k", T0 + 3)


def test_none_key_is_never_banned():
    bans = BanList(seconds=60)
    assert bans.banned(None, T0) is False
    bans.ban("k", T0)
    assert bans.banned(None, T0) is False


def test_bounded_size_evicts_oldest_bans():
    bans = BanList(seconds=100, max_entries=3)
    for i, key in enumerate("abcde"):
        bans.ban(key, T0 + i)
    assert len(bans.until) == 3
    assert not bans.banned("a", T0 + 5)
    assert not bans.banned("b", T0 + 5)
    assert all(bans.banned(k, T0 + 5) for k in "cde")


def test_eviction_goes_by_expiry_not_insertion():
    bans = BanList(seconds=100, max_entries=2)
    bans.ban("a", T0)
    bans.ban("b", T0 + 1)
    bans.ban("a", T0 + 2)  # a re-banned: now b expires first
    bans.ban("c", T0 + 3)
    assert set(bans.until) == {"a", "c"}


# -- DidChurn ----------------------------------------------------------------------------


def test_churn_counts_distinct_dids_per_address():
    churn = DidChurn(limit=3, window=60)
    assert [churn.over("192.0.2.1", f"did:x:{i}", T0 + i) for i in range(5)] == [False, False, False, True, True]
    assert not churn.over("192.0.2.2", "did:x:0", T0)  # per address


def test_churn_same_did_again_is_not_new():
    churn = DidChurn(limit=2, window=60)
    for i in range(50):  # one node reconnecting all day
        assert not churn.over("192.0.2.1", "did:x:a", T0 + i)
    assert not churn.over("192.0.2.1", "did:x:b", T0 + 50)
    assert churn.over("192.0.2.1", "did:x:c", T0 + 51)


def test_churn_forgets_dids_older_than_the_window():
    churn = DidChurn(limit=2, window=60)
    churn.note("a", "d1", T0)
    churn.note("a", "d2", T0 + 1)
    assert churn.note("a", "d3", T0 + 60.5) == 2  # d1 left the window (d2 still in)
    assert churn.note("a", "d4", T0 + 200) == 1


def test_churn_is_bounded():
    churn = DidChurn(limit=3, window=1e9, max_addresses=10)
    for i in range(1000):
        churn.note(f"addr{i % 50}", f"did{i}", T0 + i)
    assert len(churn.seen) == 10
    assert all(len(d) <= 4 for d in churn.seen.values())
    assert "addr49" in churn.seen  # the most recently seen addresses stay
