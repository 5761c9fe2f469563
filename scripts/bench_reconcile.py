"""Set reconciliation cost in memory (no network): bytes and round trips per case.

Two item sets share `--n` items and differ by D (half only on the initiator,
half only on the responder) for each D in `--diffs`; optionally one side empty.
Prints one line per case, then one JSON object as the last line. Deterministic
(seeded); the seconds are CPU time of both sides in one process, for scale only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from hmpnode.net.reconcile import Reconciler, SortedItems

from _benchlib import nonnegative_ints, positive_int  # scripts/ is on sys.path: the script's own folder

T0 = 1_764_000_000



def run(a: SortedItems, b: SortedItems, **kw) -> dict:
    ini, res = Reconciler(a, **kw), Reconciler(b, **kw)
    started = time.process_time()
    msg = ini.initiate()
    up = down = rounds = biggest = 0
    while msg is not None:
        up += len(msg)
        reply, _, _ = res.reconcile(msg)
        down += len(reply)
        biggest = max(biggest, len(msg), len(reply))
        rounds += 1
        msg, _, _ = ini.reconcile(reply)
    return {
        "round_trips": rounds,
        "bytes_initiator_to_responder": up,
        "bytes_responder_to_initiator": down,
        "bytes_total": up + down,
        "largest_message": biggest,
        "have": len(ini.have_ids),
        "need": len(ini.need_ids),
        "cpu_seconds": round(time.process_time() - started, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=100_000, help="shared items (default 100000)")
    ap.add_argument("--diffs", type=nonnegative_ints, default=[0, 10, 1000], help="differences, comma-separated")
    ap.add_argument("--per-second", type=positive_int, default=3, help="items sharing one timestamp")
    ap.add_argument("--buckets", type=positive_int, default=8)
    ap.add_argument("--idlist-threshold", type=positive_int, default=8)
    ap.add_argument("--frame-size-limit", type=positive_int, default=65536)
    ap.add_argument("--empty", action="store_true", help="also: one side holds nothing (each way)")
    args = ap.parse_args()
    kw = {
        "buckets": args.buckets,
        "idlist_threshold": args.idlist_threshold,
        "frame_size_limit": args.frame_size_limit,
    }
    try:
        Reconciler(SortedItems(), **kw)
    except ValueError as e:
        ap.error(str(e))
    rng = random.Random(20261201)
    extra = max(args.diffs) if args.diffs else 0
    items = [(T0 + k // args.per_second, rng.randbytes(32)) for k in range(args.n + extra)]
    cases = []
    for d in args.diffs:
        pool = items[: args.n + d]  # n shared + d that differ
        picked = rng.sample(range(len(pool)), d)
        only_a, only_b = set(picked[: (d + 1) // 2]), set(picked[(d + 1) // 2 :])
        a = SortedItems(x for k, x in enumerate(pool) if k not in only_b)
        b = SortedItems(x for k, x in enumerate(pool) if k not in only_a)
        r = run(a, b, **kw)
        assert r["have"] == len(only_a) and r["need"] == len(only_b), r
        r.update(case=f"{args.n} shared, {d} different", shared=args.n, differences=d)
        r["bytes_per_difference"] = round(r["bytes_total"] / d, 1) if d else None
        cases.append(r)
    if args.empty:
        full, empty = SortedItems(items[: args.n]), SortedItems()
        for label, a, b in (("initiator", full, empty), ("responder", empty, full)):
            r = run(a, b, **kw)
            assert r["have"] + r["need"] == args.n, r
            r.update(case=f"{args.n} held by the {label} only", shared=0, differences=args.n)
            r["bytes_per_difference"] = round(r["bytes_total"] / args.n, 1)
            cases.append(r)
    for r in cases:
        per = f", {r['bytes_per_difference']} B/difference" if r["bytes_per_difference"] else ""
        print(
            f"{r['case']}: round trips {r['round_trips']}, {r['bytes_total']} bytes "
            f"({r['bytes_initiator_to_responder']} up, {r['bytes_responder_to_initiator']} down{per}), "
            f"largest message {r['largest_message']}, cpu {r['cpu_seconds']} s"
        )
    print(json.dumps({"params": kw, "cases": cases}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
