"""What one answer to a peer's index request costs (docs/protocol.md 31).

    ./scripts/bench_index [--stored 20000] [--repeat 20]

A node (in this process, synchronous=NORMAL) holds `--stored` broadcast notes of its agent
with meta (created_by, abstraction path, axes) and a previous_version link to the note
before, every 100th also tagged `rare`. Measured with the read the mesh makes
(`mesh.read_index_page`, the peer's eligibility through a real PeerSession over loopback,
default limits: index_page 500, index_scan 2000):

- everything (no selection): a full page of 500 entries;
- a selection that matches 1 in 100 with no SQL narrowing (two selections are OR-ed, so
  every one of the 2 000 rows read is matched in Python): the worst case per answer;
- the versions query (related_to one DID, relation previous_version): narrowed in SQL;
- the JSON size of one entry and of the page's `container_index` payload.

Wall time (what the asker waits for the read) and the read's CPU time (what the
mesh charges the asking peer's verification budget), p50 and p95 of `--repeat` reads.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _benchlib import p50_p95 as _ms, positive_int  # noqa: E402

import orjson  # noqa: E402

from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.net import index as IX  # noqa: E402
from hmpnode.net.ledger import Ledger  # noqa: E402
from hmpnode.net.indexquery import read_index_page  # noqa: E402
from hmpnode.net.scope import Channel  # noqa: E402
from hmpnode.net.session import PeerSession  # noqa: E402
from hmpnode.node import Node  # noqa: E402

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stored", type=positive_int, default=20_000)
    parser.add_argument("--repeat", type=positive_int, default=20)
    args = parser.parse_args()
    me, peer = Identity(bytes([97]) * 32), Identity(bytes([96]) * 32)
    meta = {"created_by": "AGENT", "agents_class": "Knowledge Genome",
            "abstraction": {"path": {"L1": "did:hmp:container:abstraction-40af1c"}},
            "axes": {"did:hmp:container:axis-40aa1c": 512, "did:hmp:container:axis-40ab1c": 321}}
    session = PeerSession(me, peer.did, "127.0.0.1", Channel.LOOPBACK, book=Ledger().open(), counters=Counter())
    with tempfile.TemporaryDirectory(prefix="hmpnode-index-") as tmp:
        node = Node(me, Path(tmp), clock=lambda: NOW + timedelta(days=1), synchronous="normal", batch_max=2000)
        await node.start()
        try:
            t0 = time.perf_counter()
            batch, previous, dids = [], None, []
            for i in range(args.stored):
                c = build_container(me, "note", {"text": f"note {i}"}, now=NOW + timedelta(milliseconds=i),
                                    broadcast=True, meta=meta, tags=["rare"] if i % 100 == 0 else ["common"],
                                    related={"previous_version": previous} if previous else None)
                previous = c["hmp_container"]["head"]["container_did"]
                dids.append(previous)
                batch.append(c)
                if len(batch) == 2000 or i == args.stored - 1:
                    await node.ingest(batch)
                    batch = []
            fill_s = time.perf_counter() - t0
            now = NOW + timedelta(days=1)
            cases = {
                "all": IX.parse_query({}),
                "rare_unnarrowed": IX.parse_query({"request_container_selection": [
                    {"tags": ["rare"], "class": "note"}, {"tags": ["rare"], "class": "goal"}]}),
                "versions": IX.parse_query({"request_container_selection": [
                    {"related_to": dids[len(dids) // 2], "relation": "previous_version"}]}),
            }
            timings: dict[str, list[float]] = {name: [] for name in cases}
            cpu: dict[str, list[float]] = {name: [] for name in cases}
            pages: dict[str, IX.Page] = {}

            def read(conn, query):  # its CPU time is what the mesh charges the peer
                started = time.thread_time()
                return read_index_page(conn, session, query, now), (time.thread_time() - started) * 1000

            for name, query in cases.items():
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    pages[name], spent = await node.db.read(lambda conn, q=query: read(conn, q))
                    timings[name].append((time.perf_counter() - t) * 1000)
                    cpu[name].append(spent)
        finally:
            await node.stop()
    full = pages["all"]
    payload_bytes = len(orjson.dumps(full.entries))
    result = {
        "stored": args.stored, "fill_s": round(fill_s, 1),
        "entries": {name: len(p.entries) for name, p in pages.items()},
        "complete": {name: p.complete for name, p in pages.items()},
        "ms": {name: _ms(values) for name, values in timings.items()},
        "cpu_ms": {name: _ms(values) for name, values in cpu.items()},
        "entry_bytes": round(payload_bytes / max(len(full.entries), 1)), "page_bytes": payload_bytes,
    }
    for name, values in result["ms"].items():
        print(f"{name}: {result['entries'][name]} entries, p50 {values['p50']} ms p95 {values['p95']} ms"
              f" (CPU p50 {result['cpu_ms'][name]['p50']} ms)")
    print(f"one entry ~{result['entry_bytes']} bytes of JSON; a page of {len(full.entries)}: {payload_bytes} bytes")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
