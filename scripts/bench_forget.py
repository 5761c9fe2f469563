"""Forget and scoped recall with a large store (issue 12, part B).

    ./scripts/bench_forget [--stored 100000] [--forgets 20] [--queries 100] [--scrub true|false]

A node (in this process, synchronous=NORMAL) holds `--stored` of the agent's notes of
8-40 words drawn from a 2 000-word vocabulary; every 10th is in the scope `task:bench`,
every 100th has the source `doc:<n % 20>` (labels written in one transaction after the
fill, by the functions `Node.create` uses). Measured:

- forget of one DID (`--forgets` times) and of one source (~`stored / 2000` notes),
  with the store's `forget_scrub` as given (default true: FTS5 optimize + WAL
  truncate), end to end (`Node.forget`);
- one-step recall (budget 4 000 tokens / 16 000 bytes) without a scope and with the
  scope, for the same `--queries` query texts.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _benchlib import p50_p95 as _ms, positive_int  # noqa: E402

from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.node import Node  # noqa: E402
from hmpnode.store import forget as forget_db  # noqa: E402
from hmpnode.store import search as search_db  # noqa: E402

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
SCOPE = "task:bench"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stored", type=positive_int, default=100_000)
    parser.add_argument("--forgets", type=positive_int, default=20)
    parser.add_argument("--queries", type=positive_int, default=100)
    parser.add_argument("--scrub", choices=("true", "false"), default="true")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    vocabulary = [f"w{i:04d}" for i in range(2000)]
    me = Identity(bytes([98]) * 32)
    with tempfile.TemporaryDirectory(prefix="hmpnode-forget-") as tmp:
        node = Node(me, Path(tmp), clock=lambda: NOW + timedelta(days=1), synchronous="normal", batch_max=2000,
                    forget_scrub=args.scrub == "true")
        await node.start()
        try:
            t0 = time.perf_counter()
            dids: list[str] = []
            batch: list[dict] = []
            for i in range(args.stored):
                text = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(8, 40)))
                batch.append(build_container(me, "note", {"text": text}, now=NOW + timedelta(milliseconds=i)))
                if len(batch) == 2000 or i == args.stored - 1:
                    dids += [r.did for r in await node.ingest(batch)]
                    batch = []
            seqs = await node.db.read(lambda conn: dict(conn.execute("SELECT did, seq FROM containers")))
            in_scope = {seqs[d] for i, d in enumerate(dids) if i % 10 == 0}

            def label(conn):  # as Node.create with Keep writes them, for the whole store at once
                forget_db.join_scope(conn, SCOPE, sorted(in_scope))
                forget_db.label(conn, [(seqs[d], f"doc:{i // 100 % 20}") for i, d in enumerate(dids) if i % 100 == 0])

            await node.db.write(label)
            fill_s = time.perf_counter() - t0
            queries = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(2, 6))) for _ in range(args.queries)]
            plain_ms, scoped_ms = [], []
            for text in queries[:10]:  # warm
                await node.recall(text, max_tokens=4000, max_bytes=16000)
            for text in queries:
                t = time.perf_counter()
                await node.recall(text, max_tokens=4000, max_bytes=16000)
                plain_ms.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                outcome = await node.recall(text, max_tokens=4000, max_bytes=16000,
                                            query=search_db.SearchQuery(match="", scope=SCOPE))
                scoped_ms.append((time.perf_counter() - t) * 1000)
                assert all(c.seq in in_scope for c in outcome.selected), "an item outside the scope"
            forget_ms = []
            for did in rng.sample([d for i, d in enumerate(dids) if i % 100], args.forgets):
                t = time.perf_counter()
                assert (await node.forget(did=did))["forgotten"] == 1
                forget_ms.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            by_source = (await node.forget(source="doc:7"))["forgotten"]
            source_ms = (time.perf_counter() - t) * 1000
        finally:
            await node.stop()
    result = {
        "stored": args.stored, "scrub": args.scrub == "true", "fill_s": round(fill_s, 1),
        "forget_did_ms": _ms(forget_ms), "forget_source_ms": round(source_ms, 1), "forget_source_count": by_source,
        "recall_ms": _ms(plain_ms), "recall_scoped_ms": _ms(scoped_ms),
    }
    print(f"filled {args.stored} notes in {result['fill_s']} s (scrub {result['scrub']})")
    print(f"forget one DID p50 {result['forget_did_ms']['p50']} ms p95 {result['forget_did_ms']['p95']} ms;"
          f" forget a source of {by_source} in {result['forget_source_ms']} ms")
    print(f"recall p50 {result['recall_ms']['p50']} ms p95 {result['recall_ms']['p95']} ms;"
          f" with a scope (1 in 10) p50 {result['recall_scoped_ms']['p50']} ms p95 {result['recall_scoped_ms']['p95']} ms")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
