"""Where a read's time goes while the node ingests, in-process (no HTTP): 4 tasks ingest
500-container batches while one task times `Node.get` and a filtered `Node.list`
(class + sender, limit 50) in turn. Per read: the reader thread's CPU and run-queue wait
(/proc schedstat), the rest of its wall time (waiting for the GIL: the pages are cached,
it does no other waiting), and the time outside the reader thread (the event loop busy
with other steps, or waiting for the GIL, before and after). A read the node answers on
the event loop itself ([store] loop_read_rows) is split the same way in the loop thread
("reader" is then the loop; nothing is outside). Alternates verify
threads / 2 verify processes and a 5 ms / 1 ms GIL switch interval. Reads are made as the
API makes them (the stored body spliced in) and serialised as the API does.

    ./scripts/probe_reads_while_ingesting [--rounds 2] [--stored 4000] [--ingest 6000]
        [--procs 0,2] [--switch-us 5000,1000] [--loop-read-rows N,...]  (every combination, in turn)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
import threading
import time
from pathlib import Path

import orjson

from _benchlib import in_process_node, nonnegative_ints, percentile, positive_int, positive_ints  # scripts/ is on sys.path
from bench_node import NOW, SENDERS, make

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hmpnode.store.records import ListQuery  # noqa: E402


def sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds in the run queue) of the calling thread so far."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as fh:
        on_cpu, waiting, _ = fh.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


async def one_run(items: list, stored: int, procs: int, switch: float, loop_rows: int | None) -> tuple[dict[str, list[tuple]], float]:
    sys.setswitchinterval(switch)
    options = {} if loop_rows is None else {"loop_read_rows": loop_rows}
    async with in_process_node(items, stored, lambda: NOW, verify_processes=procs, **options) as node:
        dids = [item["hmp_container"]["head"]["container_did"] for item in items[:stored]]
        run_read, last = node.db._run_read, {}

        def timed_read(fn, snapshot=True):  # in the reader thread
            cpu0, queued0 = sched()
            start = time.perf_counter()
            try:
                return run_read(fn, snapshot)
            finally:
                cpu1, queued1 = sched()
                last["reader"] = (time.perf_counter() - start, cpu1 - cpu0, queued1 - queued0)

        node.db._run_read = timed_read
        batches = [items[i:i + 500] for i in range(stored, len(items), 500)]
        rnd = random.Random(3)
        out: dict[str, list[tuple]] = {"GET": [], "list": []}
        busy = True

        async def importer():
            while batches:
                await node.ingest(batches.pop(0))

        async def reader():
            while busy:
                for kind in out:
                    last.clear()
                    cpu0, queued0 = sched()
                    start = time.perf_counter()
                    if kind == "GET":
                        orjson.dumps(await node.get(rnd.choice(dids), spliced=True))
                    else:
                        page, _ = await node.list(ListQuery(class_="diary_entry", sender=rnd.choice(SENDERS).did,
                                                            limit=50), spliced=True)
                        orjson.dumps(page)
                    took = time.perf_counter() - start
                    if "reader" not in last:  # read on the loop (loop_read_rows): it ran right here, no await
                        cpu1, queued1 = sched()
                        last["reader"] = (took, cpu1 - cpu0, queued1 - queued0)
                    out[kind].append((took, *last["reader"]))
                    await asyncio.sleep(0)  # a read on the loop does not suspend: let the importers run

        reading = asyncio.ensure_future(reader())
        start = time.perf_counter()
        await asyncio.gather(*(importer() for _ in range(4)))
        rate = (len(items) - stored) / (time.perf_counter() - start)
        busy = False
        await reading
        return out, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--stored", type=positive_int, default=4000)
    parser.add_argument("--ingest", type=positive_int, default=6000)
    parser.add_argument("--procs", type=nonnegative_ints, default=[0, 2], help="verify worker processes, e.g. 0,2")
    parser.add_argument("--switch-us", type=positive_ints, default=[5000, 1000], help="GIL switch intervals, e.g. 5000,1000")
    parser.add_argument("--loop-read-rows", type=nonnegative_ints, default=[None],
                        help="the node's [store] loop_read_rows, e.g. 0,1,100 (default: its default)")
    args = parser.parse_args()
    items = [orjson.loads(make(i)) for i in range(args.stored + args.ingest)]
    for _ in range(args.rounds):
        for procs, switch_us, loop_rows in itertools.product(args.procs, args.switch_us, args.loop_read_rows):
            switch = switch_us / 1e6
            reads, rate = asyncio.run(one_run(items, args.stored, procs, switch, loop_rows))
            print(f"ingest {rate:.0f} containers/s while reading", flush=True)
            for kind, rows in reads.items():
                rows.sort()
                slowest = rows[int(len(rows) * 0.95):]

                def ms(j: int) -> float:
                    return sum(r[j] for r in slowest) / len(slowest) * 1e3

                total, wall, cpu, queued = ms(0), ms(1), ms(2), ms(3)
                rows_text = "" if loop_rows is None else f" loop_read_rows {loop_rows:3d}"
                print(f"{'threads' if not procs else f'{procs} processes':11s} switch {switch * 1e3:.1f} ms{rows_text}  "
                      f"{kind:4s} "
                      f"p50 {percentile([r[0] for r in rows], 0.5) * 1e3:5.2f} p99 "
                      f"{percentile([r[0] for r in rows], 0.99) * 1e3:5.1f} ms; slowest 5 % ({len(slowest)}): "
                      f"{total:5.1f} ms = reader CPU {cpu:4.2f} + run queue {queued:4.2f} + GIL {wall - cpu - queued:4.2f}"
                      f" + outside the reader {total - wall:4.1f}   (load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
