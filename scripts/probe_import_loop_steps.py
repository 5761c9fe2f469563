"""The event loop's steps while clients import: every API read waits for the loop, so the
longest steps an import makes bound a read's wait. In-process: 4 tasks post 500-container
bodies through the API's import handler (`import_containers`, mocked requests: no HTTP,
built before timing), the node verifying in 2 worker processes. Each loop callback is
timed by the loop thread's CPU (load-independent: run-queue and GIL waits excluded) and
by wall time; steps over 1 ms of CPU are attributed to where the task suspended next.

    ./scripts/probe_import_loop_steps [--stored 2000] [--ingest 6000] [--switch-us 5000,500]
        [--rounds 2] [--node-code DIR]   (DIR: another checkout, for before/after figures)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path

from _benchlib import in_process_node, percentile, positive_int, positive_ints  # scripts/ is on sys.path


def where(handle: asyncio.Handle) -> str:
    """Where the task a loop callback stepped is suspended now (its innermost awaits)."""
    task = getattr(handle._callback, "__self__", None)
    if not isinstance(task, asyncio.Task):
        return getattr(handle._callback, "__qualname__", repr(handle._callback))[:60]
    chain, coro = [], task.get_coro()
    for _ in range(50):  # bounded walk down the await chain
        if coro is None or getattr(coro, "cr_frame", None) is None:
            break
        chain.append(f"{coro.cr_code.co_name}:{coro.cr_frame.f_lineno}")
        coro = coro.cr_await
    return " > ".join(chain[-3:]) or "done"


async def one_run(items: list[bytes], stored: int, switch_us: int) -> None:
    from aiohttp.test_utils import make_mocked_request

    from hmpnode.api import app as api

    sys.setswitchinterval(switch_us / 1e6)
    from bench_node import NOW

    async with in_process_node(items, stored, lambda: NOW, verify_processes=2) as node:
        app = api.create_app(node, token="t")

        def request(body: bytes):
            req = make_mocked_request("POST", "/v1/containers/import", headers={"Content-Type": "application/json"},
                                      app=app)

            async def read() -> bytes:
                return body

            req.read = read
            return req

        todo = [request(b'{"containers":[' + b",".join(items[i:i + 500]) + b"]}")
                for i in range(stored, len(items), 500)]

        async def importer() -> None:
            while todo:
                response = await api.import_containers(todo.pop(0))
                assert response.status == 200, response.status

        steps: list[tuple[float, float]] = []
        long: Counter[str] = Counter()
        run = asyncio.events.Handle._run

        def timed(handle: asyncio.Handle) -> None:
            cpu, wall = time.thread_time(), time.perf_counter()
            run(handle)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            steps.append((cpu, wall))
            if cpu > 1e-3:
                long[where(handle)] += 1

        asyncio.events.Handle._run = timed
        try:
            start, cpu0 = time.perf_counter(), time.thread_time()
            await asyncio.gather(*(importer() for _ in range(4)))
            took, cpu = time.perf_counter() - start, time.thread_time() - cpu0
        finally:
            asyncio.events.Handle._run = run
        n = len(items) - stored
        cpus, walls = [s[0] * 1e3 for s in steps], [s[1] * 1e3 for s in steps]
        print(f"switch {switch_us} us: {n / took:.0f}/s; loop CPU {cpu / n * 1e6:.1f} us per container; {len(steps)} steps; "
              f"step CPU p50 {percentile(cpus, .5):.3f} p99 {percentile(cpus, .99):.2f} max {max(cpus):.2f} ms, "
              f"{sum(c > 1 for c in cpus)} over 1 ms; step wall p99 {percentile(walls, .99):.2f} "
              f"max {max(walls):.2f} ms; load {os.getloadavg()[0]:.1f}", flush=True)
        for place, count in long.most_common(4):
            print(f"    {count:3d} steps > 1 ms CPU, then suspended at {place}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=positive_int, default=2000)
    parser.add_argument("--ingest", type=positive_int, default=6000)
    parser.add_argument("--switch-us", type=positive_ints, default=[5000])
    parser.add_argument("--rounds", type=positive_int, default=1)
    parser.add_argument("--node-code", type=Path, help="import hmpnode from this checkout")
    args = parser.parse_args()
    code = (args.node_code or Path(__file__).resolve().parents[1]).resolve()
    if not (code / "hmpnode" / "__init__.py").is_file():
        parser.error(f"--node-code: no hmpnode package in {code}")
    sys.path.insert(0, str(code))  # before bench_node imports hmpnode
    from bench_node import make
    import hmpnode

    print(f"hmpnode from {Path(hmpnode.__file__).parents[1]}")
    items = [make(i) for i in range(args.stored + args.ingest)]
    for _ in range(args.rounds):
        for switch_us in args.switch_us:
            asyncio.run(one_run(items, args.stored, switch_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
