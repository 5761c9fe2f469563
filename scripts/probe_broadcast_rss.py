"""What agent broadcasts cost a node in memory, for good (issue 11: "100 000 agent
broadcasts leave RSS within 40 MB of an idle node").

One `hmpnode run` on loopback (DHT on, as shipped; `--no-dht` for the comparison
without it). The script reads the node's identity from its data directory, builds
`--count` unscoped broadcasts signed by that identity offline
(`hmpnode.container.build`), posts them in batches to `POST /v1/containers/import`
(source "agent", exactly as the agent API stores them), waits until the node has
handled them (before issue 11: `dht_provided` + `dht_provide_dropped` reach the
count; after: `dht_provide_listed` does; or nothing moved for 10 s), lets it idle
`--settle` (+ `--steady`) seconds and reads VmRSS. The idle figure is the same node's VmRSS
before the first broadcast, after the same idle time.

Prints the RSS growth, the growth per broadcast and the ratio to the idle node, and
the node's DHT gauges (own records held in memory); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import positive_int, rss_kib, start_node, stop_node, wait_ready  # noqa: E402  (scripts/ is on sys.path: the script's own folder)

from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.container.verify import encode_wire  # noqa: E402
from hmpnode.identity.keystore import load_keystore  # noqa: E402




async def status(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/v1/status") as resp:
        return await resp.json()


def provide_work(st: dict) -> int:
    """Broadcasts the node's provider work has dealt with: published or dropped from
    its in-memory queue (before issue 11), or listed on disk (after)."""
    c = (st.get("mesh") or {}).get("counters") or {}
    return max(c.get("dht_provided", 0) + c.get("dht_provide_dropped", 0), c.get("dht_provide_listed", 0))


def dht_gauges(st: dict) -> dict:
    mesh = st.get("mesh") or {}
    dht = mesh.get("dht") or {}
    keep = ("own_records", "stored_own", "stored_records", "stored_bytes", "stored_keys", "provider_records_signed")
    out = {k: dht[k] for k in keep if k in dht}
    out.update({k: v for k, v in (mesh.get("counters") or {}).items() if k.startswith("dht_provide")})
    return out


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="hmpnode-bcast-") as tmp:
        data_dir = Path(tmp) / "node"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HMPNODE_")}
        env.update({"HMPNODE_PEER_HOST": "127.0.0.1", "HMPNODE_PEER_DISCOVERY_INTERFACES": "127.0.0.1",
                    "HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false" if args.no_dht else "true"})
        proc = start_node(data_dir, env)
        try:
            info = await wait_ready(data_dir, proc, time.monotonic() + 60)
            url = info["api"]["url"].rstrip("/")
            token = (data_dir / "api.token").read_text().strip()
            identity = load_keystore(data_dir / "identity.json")
            now = datetime.now(timezone.utc).replace(microsecond=0)
            t0 = time.perf_counter()
            wires = [encode_wire(build_container(identity, "diary_entry",
                                                 {"title": f"entry {i}", "content": f"broadcast number {i}"},
                                                 now=now, broadcast=True, tags=["probe"]))
                     for i in range(args.count)]
            build_s = time.perf_counter() - t0
            await asyncio.sleep(args.settle)
            idle = rss_kib(proc.pid)
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}, timeout=timeout) as s:
                t0 = time.perf_counter()
                stored = 0
                for i in range(0, len(wires), args.batch):
                    body = b'{"containers":[' + b",".join(wires[i:i + args.batch]) + b"]}"
                    async with s.post(url + "/v1/containers/import", data=body,
                                      headers={"Content-Type": "application/json"}) as resp:
                        out = await resp.json()
                        assert resp.status == 200, out
                        stored += out["stored"]
                post_s = time.perf_counter() - t0
                del wires
                # the provider work is done (or stuck: nothing moved for 10 s)
                last, moved = -1, time.monotonic()
                while not args.no_dht:
                    done = provide_work(await status(s, url))
                    if done >= stored:
                        break
                    if done != last:
                        last, moved = done, time.monotonic()
                    elif time.monotonic() - moved > 10:
                        break
                    await asyncio.sleep(0.5)
                drain_s = time.perf_counter() - t0 - post_s
                await asyncio.sleep(args.settle + args.steady)
                after = rss_kib(proc.pid)
                st = await status(s, url)
        finally:
            stop_node(proc)
    growth = after - idle
    return {
        "count": args.count, "stored": stored, "dht": not args.no_dht,
        "idle_rss_mb": round(idle / 1024, 1), "after_rss_mb": round(after / 1024, 1),
        "growth_mb": round(growth / 1024, 1), "bytes_per_broadcast": round(growth * 1024 / max(1, stored)),
        "ratio_to_idle": round(after / idle, 2), "build_s": round(build_s, 1), "post_s": round(post_s, 1),
        "provide_drain_s": round(drain_s, 1), "steady_s": args.steady, "dht_gauges": dht_gauges(st),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=positive_int, default=10_000, help="broadcasts to post (default 10000)")
    parser.add_argument("--batch", type=positive_int, default=1000, help="containers per import request (max 1000)")
    parser.add_argument("--settle", type=float, default=5.0, help="idle seconds before each RSS reading (default 5)")
    parser.add_argument("--steady", type=float, default=0.0,
                        help="extra seconds before the last reading, e.g. 560: the node has then published all of "
                             "its provider records (1024 at 2/s)")
    parser.add_argument("--no-dht", action="store_true", help="run the node with peer.dht = false")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"{result['count']} broadcasts (dht {'on' if result['dht'] else 'off'}): idle {result['idle_rss_mb']} MB, "
          f"after {result['after_rss_mb']} MB, growth {result['growth_mb']} MB "
          f"({result['bytes_per_broadcast']} B/broadcast, x{result['ratio_to_idle']} of idle); "
          f"posted in {result['post_s']} s, provider work {result['provide_drain_s']} s", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
