"""The outbox's retry schedule (hmpnode.net.core.retry_at), sans-IO: exponential
back-off with jitter, capped, from a seeded RNG."""

from __future__ import annotations

import random

from hmpnode.net.core import retry_at


class Fixed(random.Random):
    """An RNG whose random() is always `value` (the jitter's bounds)."""

    def __init__(self, value: float):
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_retry_doubles_per_try_within_jitter_bounds():
    now = 1_000_000_000
    for tries in range(6):
        delay_us = 2.0 * 2 ** tries * 1e6
        assert retry_at(now, tries, base=2.0, cap=1e9, rng=Fixed(0.0)) == now + int(delay_us * 0.5)
        assert retry_at(now, tries, base=2.0, cap=1e9, rng=Fixed(0.5)) == now + int(delay_us)
        at = retry_at(now, tries, base=2.0, cap=1e9, rng=random.Random(tries))
        assert now + delay_us * 0.5 <= at <= now + delay_us * 1.5


def test_retry_is_capped_and_huge_try_counts_do_not_overflow():
    now = 5
    assert retry_at(now, 7, base=2.0, cap=60.0, rng=Fixed(0.5)) == now + 60_000_000
    assert retry_at(now, 10**9, base=2.0, cap=60.0, rng=Fixed(0.5)) == now + 60_000_000
    # the exponent stops at 20 even when the cap is larger
    assert retry_at(now, 25, base=1.0, cap=1e12, rng=Fixed(0.5)) == now + 2**20 * 1_000_000
