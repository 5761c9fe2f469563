"""Where a node's time goes while 4 clients import: per thread (and per verify worker
process), the share of the wall clock it spent on a CPU, waiting in the run queue
(the machine is busy) and blocked (waiting for the GIL, for I/O or for work), from
/proc/<pid>/task/<tid>/schedstat, and its CPU per container.

Thread names come from `py-spy dump` when py-spy is installed (pip install py-spy);
otherwise thread ids are shown. `--node-env KEY=VALUE` sets the node's settings, e.g.
HMPNODE_NODE_VERIFY_PROCESSES=2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchlib import node_session, positive_int, start_node, stop_node  # scripts/ is on sys.path
from bench_node import import_all, make


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                continue
    return out


def schedstat(pid: int) -> dict[int, tuple[float, float]]:
    """{tid: (seconds on a CPU, seconds waiting in the run queue)} of every thread of
    `pid` and of its child processes (the verify workers; single-threaded)."""
    out = {}
    paths = [(int(t), f"/proc/{pid}/task/{t}/schedstat") for t in os.listdir(f"/proc/{pid}/task")]
    paths += [(c, f"/proc/{c}/schedstat") for c in children(pid)]
    for tid, path in paths:
        try:
            with open(path) as fh:
                on_cpu, waiting, _ = fh.read().split()
        except (OSError, ValueError):
            continue
        out[tid] = (int(on_cpu) / 1e9, int(waiting) / 1e9)
    return out


def thread_names(pid: int) -> dict[int, str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {}
    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'Thread (\d+) \([^)]*\): "([^"]+)"', dump)}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=positive_int, default=20_000)
    parser.add_argument("--batch", type=positive_int, default=500)
    parser.add_argument("--clients", type=positive_int, default=4)
    parser.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    wires = [make(i) for i in range(args.containers + 1000)]
    env = {"HMPNODE_PEER_HOST": "127.0.0.1", "HMPNODE_PEER_DISCOVERY_INTERFACES": "127.0.0.1", **os.environ}
    env.update(item.split("=", 1) for item in args.node_env)
    with tempfile.TemporaryDirectory(prefix="hmpnode-probe-") as tmp:
        proc = start_node(Path(tmp), env)
        try:
            async with node_session(Path(tmp), proc) as (url, session):
                await import_all(session, url, wires[:1000], args.batch, args.clients)  # warm up, start workers
                names = thread_names(proc.pid)
                before = schedstat(proc.pid)
                start = time.perf_counter()
                n, _ = await import_all(session, url, wires[1000:], args.batch, args.clients)
                wall = time.perf_counter() - start
                after = schedstat(proc.pid)
                workers = set(children(proc.pid))
        finally:
            stop_node(proc)
    rows = []
    for tid, (cpu, waited) in after.items():
        cpu0, waited0 = before.get(tid, (0.0, 0.0))
        rows.append((cpu - cpu0, waited - waited0, tid))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"{n} containers in {wall:.2f} s = {n / wall:.0f}/s; node CPU {total / n * 1e6:.0f} us per container "
          f"(threads and worker processes); load average {os.getloadavg()[0]:.1f}")
    print(f"{'thread':28s} {'on CPU':>7s} {'run queue':>10s} {'blocked':>8s} {'CPU/container':>14s}")
    for cpu, waited, tid in rows:
        if cpu < 0.005 * wall:
            continue
        name = names.get(tid) or ("verify worker process" if tid in workers else str(tid))
        print(f"{name:28s} {cpu / wall:7.0%} {waited / wall:10.0%} {1 - (cpu + waited) / wall:8.0%} "
              f"{cpu / n * 1e6:11.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
