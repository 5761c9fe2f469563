"""Per-peer clock offset estimates (hmpnode.net.skew)."""

from __future__ import annotations

from hmpnode.net.skew import SkewEstimates


def test_skew_estimate_is_the_median_of_recent_readings_and_bounded():
    skew = SkewEstimates(samples=3, max_peers=2)
    assert skew.of("did:a") is None and skew.max_abs() == 0.0 and skew.view() == {}
    for offset in (-3600.2, -3600.0, 5.0, -3599.9):  # one delayed reading does not move it
        skew.add("did:a", offset)
    assert skew.of("did:a") == -3599.9
    skew.add("did:b", 0.25)
    assert skew.max_abs() == abs(skew.of("did:a"))
    skew.add("did:c", 1.0)  # a third peer: the least recently heard from (a) falls off
    assert set(skew.view()) == {"did:b", "did:c"} and skew.max_abs() == 1.0
