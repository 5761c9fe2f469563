"""When the shared reconciliation snapshot is kept, extended or rebuilt
(hmpnode.net.catchup.refresh), sans-IO on states built from made-up rows."""

from __future__ import annotations

from hmpnode.net.catchup import refresh
from hmpnode.net.syncset import MARGIN_US, MAX_OVERLAY, SyncRow, build_state, extend_state

T0 = 1_800_000_000 * 1_000_000
MIN_AGE = 30 * 1e6


def rows(first: int, n: int, ttl_us: int | None = None) -> list[SyncRow]:
    return [SyncRow(i, f"did:x{i}", T0, ttl_us, "") for i in range(first, first + n)]


def test_no_snapshot_is_built():
    assert refresh(None, now_us=T0, last_seq=0, min_age_us=MIN_AGE) == "build"


def test_unchanged_store_keeps_and_new_rows_extend():
    state = build_state(rows(1, 3), now_us=T0, margin_us=MARGIN_US, last_seq=3)
    assert refresh(state, now_us=T0 + 1, last_seq=3, min_age_us=MIN_AGE) == "keep"
    assert refresh(state, now_us=T0 + 1, last_seq=4, min_age_us=MIN_AGE) == "extend"
    # old, but nothing nears its ttl and the overlay is small: still only extended
    assert refresh(state, now_us=T0 + 3600 * 10**6, last_seq=4, min_age_us=MIN_AGE) == "extend"


def test_an_item_nearing_its_ttl_rebuilds_but_not_before_min_age():
    ttl = T0 + 2 * MARGIN_US + 60 * 10**6
    state = build_state(rows(1, 2, ttl), now_us=T0, margin_us=MARGIN_US, last_seq=2)
    stale = state.stale_at_us
    assert refresh(state, now_us=stale - 1, last_seq=2, min_age_us=MIN_AGE) == "keep"
    assert refresh(state, now_us=stale, last_seq=2, min_age_us=MIN_AGE) == "build"
    # a young snapshot is not rebuilt yet, whatever is stale in it
    assert refresh(state, now_us=stale, last_seq=2, min_age_us=stale - T0 + 1) == "keep"


def test_an_overlay_past_its_bound_rebuilds_once_old():
    state = build_state(rows(1, 1), now_us=T0, margin_us=MARGIN_US, last_seq=1)
    big = extend_state(state, rows(2, MAX_OVERLAY + 1), now_us=T0, margin_us=MARGIN_US, last_seq=MAX_OVERLAY + 2)
    assert len(big.overlay) > MAX_OVERLAY
    assert refresh(big, now_us=T0 + 1, last_seq=MAX_OVERLAY + 2, min_age_us=MIN_AGE) == "keep"
    assert refresh(big, now_us=T0 + int(MIN_AGE), last_seq=MAX_OVERLAY + 2, min_age_us=MIN_AGE) == "build"
