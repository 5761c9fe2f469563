"""Where the writer thread's time goes (issue 15): an in-process Node (synchronous=FULL)
is filled to --stored containers, then --measure more are ingested by --clients
concurrent tasks in batches of 500, and each stage run on the writer thread is timed,
wall clock and thread CPU (time.thread_time): the whole transaction (`_commit_batch`),
`insert_containers`, the full-text `index_rows` and the COMMIT (the fsync). Also
commits, and queued writes per commit (group commit).

    .venv/bin/python scripts/probe_writer.py [--node-code DIR] [--stored N] [--measure N]

`--pragma NAME=VALUE` (repeatable) is run on every connection the store opens (A/B of
settings without a code change); the store's file I/O per container (the process's
write/read calls and bytes, /proc/self/io) is printed too: the WAL frames and checkpoints.
`--store DIR` keeps the filled store in DIR and starts from a copy of it next time (the
fill of 100 000 takes minutes; the copy must come from the same --stored).
`--node-code DIR` imports hmpnode from another checkout (before/after figures). The
figures are per measured container; "busy" is the share of the phase's wall-clock time
the writer spent inside a transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    for _i, _arg in enumerate(sys.argv):
        if _arg == "--node-code" and _i + 1 < len(sys.argv):
            sys.path.insert(0, str(Path(sys.argv[_i + 1]).resolve()))

import orjson  # noqa: E402

import bench_node  # noqa: E402  (scripts/ is on sys.path)
import hmpnode.store.db as dbm  # noqa: E402
import hmpnode.store.records as records  # noqa: E402
import hmpnode.store.search as search_db  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.node import Node  # noqa: E402

STAGES: dict[str, list[float]] = {}  # name -> [wall, cpu, calls]
MEASURING = [False]
SIZES: list[int] = []


def _count(name: str, wall: float, cpu: float) -> None:
    if MEASURING[0]:
        entry = STAGES.setdefault(name, [0.0, 0.0, 0])
        entry[0] += wall
        entry[1] += cpu
        entry[2] += 1


def _timed(owner, attr: str, name: str) -> None:
    real = getattr(owner, attr)

    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            _count(name, time.perf_counter() - wall, time.thread_time() - cpu)

    setattr(owner, attr, timed)


class _Conn:
    """The writer's connection, with its COMMIT timed."""

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql, *args):
        if sql != "COMMIT":
            return self._conn.execute(sql, *args)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._conn.execute(sql, *args)
        finally:
            _count("COMMIT (fsync)", time.perf_counter() - wall, time.thread_time() - cpu)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def _io() -> dict[str, int]:
    """This process's read/write calls and bytes so far (Linux)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _pragmas(pragmas: list[str]) -> None:
    real = dbm._connect

    def connect(*args, **kwargs):
        conn = real(*args, **kwargs)
        for pragma in pragmas:
            conn.execute(f"PRAGMA {pragma}")
        return conn

    dbm._connect = connect


def _instrument() -> None:
    _timed(records, "insert_containers", "insert_containers")
    _timed(search_db, "index_rows", "index_rows (full-text)")
    real_batch = dbm.Database._commit_batch

    def commit_batch(self, conn, batch):
        if MEASURING[0]:
            SIZES.append(len(batch))
        return real_batch(self, conn, batch)

    dbm.Database._commit_batch = commit_batch
    _timed(dbm.Database, "_commit_batch", "transaction (all of it)")
    real_loop = dbm.Database._write_loop
    dbm.Database._write_loop = lambda self, conn: real_loop(self, _Conn(conn))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, default=50_000)
    parser.add_argument("--measure", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--node-code", type=Path)
    parser.add_argument("--writer-cache-mib", type=int, help="store.writer_cache_mib (default: the node's)")
    parser.add_argument("--page-size", type=int, help="store.page_size of a new store (default: the node's)")
    parser.add_argument("--store", type=Path, help="keep the filled store here; start from a copy of it next time")
    parser.add_argument("--pragma", action="append", default=[], help="NAME=VALUE, run on every store connection")
    args = parser.parse_args()
    _instrument()
    _pragmas(args.pragma)
    tmp = Path(tempfile.mkdtemp(prefix="hmpnode-probe-writer-"))
    node_args = {name: value for name, value in (("writer_cache_mib", args.writer_cache_mib),
                                                  ("page_size", args.page_size)) if value is not None}
    reuse = args.store is not None and (args.store / "stored").exists()
    if reuse:
        for f in args.store.iterdir():
            if f.name != "stored":
                shutil.copy2(f, tmp / f.name)
    node = Node(Identity(bytes(32)), tmp, clock=lambda: bench_node.NOW, **node_args)
    await node.start()
    try:
        items = [orjson.loads(bench_node.make(i)) if i >= args.stored or not reuse else None
                 for i in range(args.stored + args.measure)]

        async def feed(todo: list, clients: int) -> None:
            chunks = [todo[i:i + 500] for i in range(0, len(todo), 500)][::-1]

            async def client() -> None:
                while chunks:
                    assert all(r.status == "stored" for r in await node.ingest(chunks.pop()))

            await asyncio.gather(*(client() for _ in range(clients)))

        if not reuse:
            await feed(items[:args.stored], args.clients)
        if hasattr(node, "indexer"):
            await node.indexer.caught_up()
        if args.store is not None and not reuse:
            await node.stop()
            args.store.mkdir(parents=True, exist_ok=True)
            for f in tmp.iterdir():
                shutil.copy2(f, args.store / f.name)
            (args.store / "stored").write_text(str(args.stored))
            node = Node(Identity(bytes(32)), tmp, clock=lambda: bench_node.NOW, **node_args)
            await node.start()
        commits = node.db.commits
        MEASURING[0] = True
        io_before = _io()
        start = time.perf_counter()
        await feed(items[args.stored:], args.clients)
        acked = time.perf_counter() - start
        if hasattr(node, "indexer"):  # the deferred index is part of the writer's work
            await node.indexer.caught_up()
        wall = time.perf_counter() - start
        io = {k: v - io_before[k] for k, v in _io().items()}
        MEASURING[0] = False
        commits = node.db.commits - commits
    finally:
        await node.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    n = args.measure
    print(f"hmpnode from {args.node_code or 'this checkout'}: {args.stored} stored, {n} measured, {args.clients} clients;"
          f" acknowledged in {acked:.2f} s ({n / acked:.0f}/s), indexed in {wall:.2f} s; {commits} commits"
          f" ({commits / n * 1000:.2f} per 1000 containers), {sum(SIZES) / max(1, len(SIZES)):.2f} writes per commit"
          f"{'; ' + ', '.join(args.pragma) if args.pragma else ''}")
    print(f"  file I/O per container: {io['syscw'] / n:.2f} writes, {io['wchar'] / n:.0f} bytes written;"
          f" {io['syscr'] / n:.2f} reads, {io['rchar'] / n:.0f} bytes read")
    for name, (stage_wall, cpu, calls) in STAGES.items():
        print(f"  {name:24s} busy {100 * stage_wall / wall:5.1f} %   wall {1e6 * stage_wall / n:6.1f} us"
              f"   cpu {1e6 * cpu / n:5.1f} us per container   ({calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
