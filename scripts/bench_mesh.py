"""Mesh benchmark on one machine: N local nodes (default N = 20 and 50).

    ./scripts/bench_mesh [--nodes 20,50] [--broadcasts 20] [--lookups 5]

For each N it starts N `hmpnode run` processes on 127.0.0.1 with no
configuration beyond loopback (LAN discovery on lo finds them, LAN peers
bootstrap the DHT) and measures:

- broadcast: time from the sender storing a container to the last node
  storing it (from each node's own `received` time; one clock), median and
  p95 over the broadcasts, and the share of nodes reached;
- duplicates: copies a node received of a broadcast it already held, per node
  per broadcast (mean, and the worst node), against the fan-out; over all
  broadcasts, and over those after the first `--warmup` (the eager links form a
  tree from the prunes of the first broadcasts: docs/protocol.md 23.2);
- DHT: `find_peer` of random other agents from every node (the
  `/v1/dht/peers/{did}` route; its `elapsed_ms` is the lookup alone), success
  rate, median and p95 latency;
- memory of each idle node: RSS, and PSS (shared library pages divided among
  the processes that map them), against a baseline measured in the same run:
  an idle Python process that imported what the node imports (asyncio,
  aiohttp, PyNaCl, zstandard, orjson, sqlite3) and nothing else.

Targets (issue "the mesh"): 100% delivery, duplicates per node <= fan-out
(issue 22: <= 0.5 once the tree has formed), DHT success 100%, idle RSS <= 40 MB.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime

from _benchlib import percentile, positive_int, positive_ints
from _meshlib import LocalMesh

FANOUT = 4  # the default of peer.fanout




def baseline_rss_kib() -> dict[str, int]:
    code = ("import asyncio, aiohttp, aiohttp.web, nacl.bindings, zstandard, orjson, sqlite3, sys, time;"
            "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        time.sleep(0.5)
        out = {}
        with open(f"/proc/{proc.pid}/status") as fh:
            out["rss"] = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        with open(f"/proc/{proc.pid}/smaps_rollup") as fh:
            out["pss"] = next(int(line.split()[1]) for line in fh if line.startswith("Pss:"))
        return out
    finally:
        proc.kill()
        proc.wait()


def _received(item: dict) -> datetime:
    return datetime.fromisoformat(item["received"].replace("Z", "+00:00"))


async def run(n: int, broadcasts: int, lookups: int, rng: random.Random, warmup: int = 3) -> dict:
    mesh = LocalMesh(n, interval_ms=1000)
    try:
        t0 = time.monotonic()
        mesh.start()
        started = time.monotonic() - t0
        discovered = await mesh.wait_discovered(timeout=120)
        # let the DHT settle: every node has published its peer record
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            statuses = await asyncio.gather(*(c.status() for c in mesh.clients))
            if all(s["mesh"]["counters"].get("dht_published", 0) >= 1 for s in statuses):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)  # idle

        memory = [mesh.rss_kib(i) for i in range(n)]

        before = await asyncio.gather(*(c.status() for c in mesh.clients))
        formed = before if warmup == 0 else None
        latencies, reached = [], []
        for b in range(broadcasts):
            sender = rng.randrange(n)
            did = (await mesh.clients[sender].create("note", {"bench": b}, broadcast=True))["did"]
            deadline = time.monotonic() + 30
            holders: dict[int, dict] = {}
            while time.monotonic() < deadline and len(holders) < n:
                missing = [i for i in range(n) if i not in holders]
                results = await asyncio.gather(*(mesh.clients[i].get(did) for i in missing), return_exceptions=True)
                for i, result in zip(missing, results, strict=True):
                    if isinstance(result, dict):
                        holders[i] = result
                if len(holders) < n:
                    await asyncio.sleep(0.01)
            reached.append(len(holders) / n)
            if len(holders) == n:
                origin = _received(holders[sender])
                latencies.append(max((_received(h) - origin).total_seconds() for h in holders.values()) * 1000)
            if b == warmup - 1:
                formed = await asyncio.gather(*(c.status() for c in mesh.clients))
        after = await asyncio.gather(*(c.status() for c in mesh.clients))
        def duplicates(start: list[dict], count: int) -> list[float]:
            return [(a["ingest"].get("ingest_duplicate", 0) - b["ingest"].get("ingest_duplicate", 0)) / count
                    for a, b in zip(after, start, strict=True)]

        dups = duplicates(before, broadcasts)
        dups_formed = duplicates(formed, broadcasts - warmup) if formed is not None and broadcasts > warmup else None

        found, lookup_ms = 0, []
        attempts = 0
        for i in range(n):
            others = [j for j in range(n) if j != i]
            for j in rng.sample(others, min(lookups, len(others))):
                attempts += 1
                try:
                    answer = await mesh.clients[i].request("GET", f"/v1/dht/peers/{mesh.dids[j]}")
                except Exception:
                    continue
                if answer.get("did") == mesh.dids[j] and answer.get("addresses"):
                    found += 1
                    lookup_ms.append(answer["elapsed_ms"])

        return {
            "nodes": n,
            "start_s": round(started, 2),
            "discovery_s": round(discovered, 2),
            "broadcasts": broadcasts,
            "delivery": round(statistics.mean(reached), 4),
            "broadcast_ms_median": round(statistics.median(latencies), 1) if latencies else None,
            "broadcast_ms_p95": round(percentile(latencies, 0.95), 1) if latencies else None,
            "duplicates_per_node_per_broadcast_mean": round(statistics.mean(dups), 3),
            "duplicates_per_node_per_broadcast_max": round(max(dups), 3),
            "warmup": warmup,
            "duplicates_after_warmup_mean": round(statistics.mean(dups_formed), 3) if dups_formed else None,
            "duplicates_after_warmup_max": round(max(dups_formed), 3) if dups_formed else None,
            "fanout": FANOUT,
            "dht_lookups": attempts,
            "dht_success": round(found / attempts, 4) if attempts else None,
            "dht_ms_median": round(statistics.median(lookup_ms), 2) if lookup_ms else None,
            "dht_ms_p95": round(percentile(lookup_ms, 0.95), 2) if lookup_ms else None,
            "rss_mb_median": round(statistics.median(m["rss"] for m in memory) / 1024, 1),
            "rss_mb_max": round(max(m["rss"] for m in memory) / 1024, 1),
            "pss_mb_median": round(statistics.median(m.get("pss", 0) for m in memory) / 1024, 1),
        }
    finally:
        await mesh.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=positive_ints, default=[20, 50],
                        help="comma-separated node counts (default 20,50)")
    parser.add_argument("--broadcasts", type=positive_int, default=20)
    parser.add_argument("--lookups", type=positive_int, default=5, help="DHT lookups per node")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3,
                        help="broadcasts after which duplicates are counted again (the tree has formed; default 3)")
    args = parser.parse_args()
    if min(args.nodes) < 2:
        parser.error("--nodes: a mesh has at least 2 nodes")
    if not 0 <= args.warmup < args.broadcasts:
        parser.error("--warmup: from 0 to fewer than --broadcasts")
    rng = random.Random(args.seed)
    base = baseline_rss_kib()
    print(f"baseline: idle Python with the node's imports: RSS {base['rss'] / 1024:.1f} MB, PSS {base['pss'] / 1024:.1f} MB")
    results = {"baseline_rss_mb": round(base["rss"] / 1024, 1), "baseline_pss_mb": round(base["pss"] / 1024, 1)}
    for n in args.nodes:
        r = await run(n, args.broadcasts, args.lookups, rng, args.warmup)
        r["rss_vs_baseline"] = round(r["rss_mb_median"] / results["baseline_rss_mb"], 2)
        results[f"n{n}"] = r
        print(f"N={n}: started in {r['start_s']} s, all discovered in {r['discovery_s']} s")
        print(f"  broadcast: delivery {r['delivery']:.2%}, time to all nodes median {r['broadcast_ms_median']} ms,"
              f" p95 {r['broadcast_ms_p95']} ms")
        print(f"  duplicates per node per broadcast: mean {r['duplicates_per_node_per_broadcast_mean']},"
              f" worst node {r['duplicates_per_node_per_broadcast_max']} (fan-out {FANOUT});"
              f" after the first {r['warmup']}: mean {r['duplicates_after_warmup_mean']},"
              f" worst node {r['duplicates_after_warmup_max']}")
        print(f"  DHT find_peer: {r['dht_success']:.2%} of {r['dht_lookups']}, median {r['dht_ms_median']} ms,"
              f" p95 {r['dht_ms_p95']} ms")
        print(f"  idle node memory: RSS median {r['rss_mb_median']} MB (max {r['rss_mb_max']}),"
              f" PSS median {r['pss_mb_median']} MB; RSS / baseline {r['rss_vs_baseline']}")
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
