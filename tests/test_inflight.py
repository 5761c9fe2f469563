"""The decompression budget rules (hmpnode.container.inflight), without sockets."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

from hmpnode.container.build import build_container
from hmpnode.container.inflight import DECOMPRESSED_TOO_LARGE, OVER_BUDGET, ByteBudget, decompressed_cost, plan_batch
from hmpnode.identity import Identity

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
ID = Identity.generate()


def _note(payload, **options):
    return build_container(ID, "note", payload, now=NOW, **options)


def test_cost_is_the_declared_size_of_a_zstd_or_gzip_payload():
    payload = {"text": "a" * 5_000_000}
    from hmpnode.container.canonical import canonical_json

    opened = len(canonical_json(payload))
    for algo in ("zstd", "gzip"):
        c = _note(payload, compression=algo)
        assert decompressed_cost(c, 1 << 30) == opened
        assert decompressed_cost(c["hmp_container"], 1 << 30) == opened  # the bare form too


def test_cost_of_what_verification_does_not_decompress_is_zero():
    assert decompressed_cost(_note({"text": "plain"}), 100) == 0
    other = _note({"text": "x"}, compression="zstd")
    other["hmp_container"]["head"]["payload_type"] = "lz4+json"
    assert decompressed_cost(other, 100) == 0  # stored and forwarded unopened
    broken = _note({"text": "x"}, compression="zstd")
    broken["hmp_container"]["payload"] = "!!"
    assert decompressed_cost(broken, 100) == 0  # refused by verification before opening
    assert decompressed_cost({"head": 1}, 100) == 0
    assert decompressed_cost(b"[1, 2]", 100) == 0


def test_cost_of_unparsed_object_text_is_the_limit():
    assert decompressed_cost(b' {"head": {}}', 100) == 100
    assert decompressed_cost('{"head": {}}', 100) == 100


def test_plan_refuses_items_over_their_limit_and_past_the_batch_budget_in_order():
    assert plan_batch([0, 10, 50, 0, 30, 20, 5], item_limit=40, batch_budget=45) == [
        None, None, DECOMPRESSED_TOO_LARGE, None, None, OVER_BUDGET, OVER_BUDGET]
    # once the budget is spent, later items with a cost are refused even if they would fit
    assert plan_batch([30, 20, 1, 0], item_limit=40, batch_budget=40) == [None, OVER_BUDGET, OVER_BUDGET, None]
    assert plan_batch([], item_limit=1, batch_budget=1) == []


def test_byte_budget_makes_a_holder_wait_and_records_the_peak():
    budget = ByteBudget(100)
    budget.acquire(60)
    done = threading.Event()

    def second():
        budget.acquire(60)
        done.set()
        budget.release(60)

    t = threading.Thread(target=second)
    t.start()
    deadline = time.monotonic() + 30  # bounded: it must still be waiting (a loaded machine starts threads late)
    while not budget.waits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert budget.waits == 1 and not done.is_set()
    budget.release(60)
    t.join(5)
    assert done.is_set() and budget.used == 0 and budget.peak == 60


def test_byte_budget_lets_one_oversized_holder_in_alone():
    budget = ByteBudget(10)
    budget.acquire(50)  # nothing else held: it goes (it cannot be split, and must not wait forever)
    assert budget.used == 50
    budget.release(50)
    assert budget.stats() == {"capacity": 10, "used": 0, "peak": 50, "waits": 0}
