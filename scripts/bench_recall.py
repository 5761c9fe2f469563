"""Recall latency with a large store (issue 5): p50/p95 of one-step recall.

    ./scripts/bench_recall [--stored 100000] [--queries 200]

A node (in this process, synchronous=NORMAL while filling) holds `--stored`
notes of 8-40 words drawn from a 2 000-word vocabulary, from 8 senders, a few
superseded, expired and contested. Then `--queries` recalls with 2-6 word
queries and budgets drawn from (500..4000 tokens, 2 000..16 000 bytes), timed
end to end (`Node.recall`: search, lifecycle, opening payloads, ranking,
packing). Baseline, in the same run: the bare FTS5 BM25 query (top 200, no
lifecycle, no bodies) for the same query texts. Target: recall p95 < 50 ms.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _benchlib import percentile, positive_int  # noqa: E402

from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.memory.index import fts_query, query_terms  # noqa: E402
from hmpnode.node import Node  # noqa: E402

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)




async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stored", type=positive_int, default=100_000)
    parser.add_argument("--queries", type=positive_int, default=200)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    vocabulary = [f"w{i:04d}" for i in range(2000)]
    senders = [Identity(bytes([100 + i]) * 32) for i in range(8)]
    me = Identity(bytes([99]) * 32)
    with tempfile.TemporaryDirectory(prefix="hmpnode-recall-") as tmp:
        node = Node(me, Path(tmp), clock=lambda: NOW + timedelta(days=1), synchronous="normal", batch_max=2000)
        await node.start()
        try:
            t0 = time.perf_counter()
            batch: list[dict] = []
            previous: dict[int, str] = {}
            for i in range(args.stored):
                sender = rng.randrange(len(senders))
                text = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(8, 40)))
                options: dict = {}
                roll = rng.random()
                if roll < 0.02 and sender in previous:
                    options["related"] = {"previous_version": previous[sender]}
                elif roll < 0.04:
                    options["ttl"] = NOW + timedelta(hours=1)
                container = build_container(senders[sender], "note", {"text": text},
                                            now=NOW + timedelta(milliseconds=i), **options)
                previous[sender] = container["hmp_container"]["head"]["container_did"]
                batch.append(container)
                if len(batch) == 2000:
                    await node.ingest(batch)
                    batch = []
            if batch:
                await node.ingest(batch)
            fill_s = time.perf_counter() - t0
            queries = [(" ".join(rng.choice(vocabulary) for _ in range(rng.randint(2, 6))),
                        rng.randint(500, 4000), rng.randint(2000, 16000)) for _ in range(args.queries)]

            def raw(conn, match):
                return conn.execute("SELECT rowid, bm25(search) FROM search WHERE search MATCH ?"
                                    " ORDER BY bm25(search) LIMIT 200", (match,)).fetchall()

            base_ms, recall_ms, selected = [], [], []
            for text, _, _ in queries[:20]:  # warm both paths
                await node.db.read(lambda conn, m=fts_query(query_terms(text)): raw(conn, m))
            for text, max_tokens, max_bytes in queries:
                match = fts_query(query_terms(text))
                t = time.perf_counter()
                await node.db.read(lambda conn, m=match: raw(conn, m))
                base_ms.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                outcome = await node.recall(text, max_tokens=max_tokens, max_bytes=max_bytes)
                recall_ms.append((time.perf_counter() - t) * 1000)
                assert outcome.envelope_json is None or len(outcome.envelope_json) <= max_bytes
                selected.append(len(outcome.selected))
        finally:
            await node.stop()
    result = {
        "stored": args.stored, "queries": args.queries, "fill_s": round(fill_s, 1),
        "recall_ms_p50": round(statistics.median(recall_ms), 2), "recall_ms_p95": round(percentile(recall_ms, 0.95), 2),
        "fts_ms_p50": round(statistics.median(base_ms), 2), "fts_ms_p95": round(percentile(base_ms, 0.95), 2),
        "recall_vs_fts_p50": round(statistics.median(recall_ms) / max(statistics.median(base_ms), 1e-6), 1),
        "selected_mean": round(statistics.mean(selected), 2), "target_p95_ms": 50,
    }
    print(f"filled {args.stored} containers in {result['fill_s']} s")
    print(f"recall   p50 {result['recall_ms_p50']} ms  p95 {result['recall_ms_p95']} ms (target p95 < 50 ms),"
          f" {result['selected_mean']} items per answer")
    print(f"bare FTS p50 {result['fts_ms_p50']} ms  p95 {result['fts_ms_p95']} ms;"
          f" recall / FTS at p50: {result['recall_vs_fts_p50']}")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
