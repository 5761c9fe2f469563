"""Consensus at its bound: one proposal with `--votes` votes from as many agents.

    ./scripts/bench_consensus [--votes 4096] [--weighting equal|trust] [--reads 5]

Two nodes in this process (synchronous=NORMAL). The proposer's node holds the
proposal and the votes (ingested as from a peer, 1000 per batch); measured there:
the state read (`Node.consensus`, every vote opened and counted, p50 of `--reads`)
and the closing (`Node.close_due`: count, build, sign, store the consensus_result).
The second node gets the proposal and the votes, then the result: measured is the
result's ingest (its recount runs in the store's writer, inside the transaction)
and a state read with the recount. With `--weighting trust` each voter's trust
figure is read too (one query per voter). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _benchlib import positive_int  # noqa: E402

from hmpnode import consensus as cons  # noqa: E402
from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.node import Node  # noqa: E402

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
PEER = "peer:did:hmp:agent:bench"


async def ingest(node: Node, items: list[dict]) -> None:
    for i in range(0, len(items), 1000):
        results = await node.ingest(items[i:i + 1000], source=PEER)
        assert all(r.status == "stored" for r in results), results[0]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--votes", type=positive_int, default=4096)
    parser.add_argument("--weighting", choices=cons.WEIGHTINGS, default="equal")
    parser.add_argument("--reads", type=positive_int, default=5)
    args = parser.parse_args()
    clock = {"now": NOW}
    proposer, other_id = Identity(bytes([97]) * 32), Identity(bytes([96]) * 32)
    with tempfile.TemporaryDirectory(prefix="hmpnode-consensus-") as tmp:
        node = Node(proposer, Path(tmp) / "a", clock=lambda: clock["now"], synchronous="normal", batch_max=2000,
                    consensus=cons.Policy(close_grace_seconds=0, max_votes=max(args.votes, 1)))
        other = Node(other_id, Path(tmp) / "b", clock=lambda: clock["now"], synchronous="normal", batch_max=2000,
                     consensus=cons.Policy(max_votes=max(args.votes, 1)))
        await node.start()
        await other.start()
        try:
            _, proposal = await node.propose({"text": "bench"}, deadline=NOW + timedelta(hours=1),
                                             rules=cons.Rules(quorum=2, threshold=0.5, weighting=args.weighting))
            did = proposal["hmp_container"]["head"]["container_did"]
            t0 = time.perf_counter()
            votes = [build_container(Identity((i + 1).to_bytes(32, "big")), "vote",
                                     {"target_did": did, "vote_value": 1 if i % 4 else -1},
                                     now=NOW + timedelta(seconds=1 + i % 3000), related={"in_reply_to": [did]})
                     for i in range(args.votes)]
            build_s = time.perf_counter() - t0
            clock["now"] = NOW + timedelta(minutes=55)
            await ingest(node, votes)
            reads = []
            for _ in range(args.reads):
                t = time.perf_counter()
                state = await node.consensus(did)
                reads.append((time.perf_counter() - t) * 1000)
            assert len(state["counted"]) == args.votes, len(state["counted"])
            clock["now"] = NOW + timedelta(hours=1, seconds=1)
            t = time.perf_counter()
            (result_did,) = await node.close_due()
            close_ms = (time.perf_counter() - t) * 1000
            result = await node.get(result_did)
            size = len(json.dumps(result["container"]))
            await ingest(other, [proposal, *votes])
            t = time.perf_counter()
            await ingest(other, [result["container"]])
            recount_ingest_ms = (time.perf_counter() - t) * 1000
            t = time.perf_counter()
            seen = await other.consensus(did)
            recount_read_ms = (time.perf_counter() - t) * 1000
            assert seen["results"][0]["recount"]["status"] == "match", seen["results"][0]
        finally:
            await node.stop()
            await other.stop()
    out = {
        "votes": args.votes, "weighting": args.weighting, "build_votes_s": round(build_s, 1),
        "state_read_ms_p50": round(statistics.median(reads), 1), "close_ms": round(close_ms, 1),
        "result_bytes": size, "result_ingest_with_recount_ms": round(recount_ingest_ms, 1),
        "state_read_with_recount_ms": round(recount_read_ms, 1), "state": seen["state"],
    }
    print(f"{args.votes} votes ({args.weighting}): state read p50 {out['state_read_ms_p50']} ms, close "
          f"{out['close_ms']} ms, result {size} bytes; at a peer: ingest with recount "
          f"{out['result_ingest_with_recount_ms']} ms, state read with recount {out['state_read_with_recount_ms']} ms")
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
