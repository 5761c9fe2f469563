"""Directed delivery through a relay under faults, on real nodes (issue 21).

    ./scripts/fault_delivery [--scenario faults|relay_restart] [--seed 21] [--count 1000]
                             [--seconds 60] [--restarts 3] [--tail 5] [--down 30] [--wait 300] [--keep DIR]

A sender S, a relay R and a recipient B as `hmpnode run` processes on 127.0.0.1,
every peer link behind a fault proxy (tests/faultmesh.py, tests/faultproxy.py).

- faults: S's agent sends --count containers to B over --seconds s while a plan
  drawn from --seed runs on both links (latency, stalls, resets, partitions,
  flipped bits) and R and B are each SIGKILLed and restarted --restarts times,
  then both links are partitioned for --tail s; then every fault stops.
- relay_restart: B offline; S sends half, R is SIGKILLed while S pushes them, S
  sends the rest; R is back --down s after the kill, then B comes online.

From then on it measures, for up to --wait s after the links were back: when each
link had a session again, when S's outbox was empty, when B's agent (its event
stream, read across its restarts) had seen every container; what waited in S's
outbox when the S-R link was back and by when its own retry times made the last
of it due; and exactly-once (none lost, none seen twice, all stored at B).
Exit status 1 when it did not converge within --wait s or broke exactly-once,
2 on a usage error. The last line is one JSON object; figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _benchlib import positive_int  # noqa: E402
from tests.faultmesh import AgentStream, Report, Trio, faults_then_heal, relay_restart  # noqa: E402
from tests.nodeproc import Nodes  # noqa: E402


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


async def run(args: argparse.Namespace, base: Path) -> Report:
    nodes = Nodes()
    trio = Trio(nodes, base, rng=random.Random(args.seed))
    stream = None
    try:
        await trio.start()
        stream = AgentStream(trio.dir("b"))
        await stream.start()
        if args.scenario == "relay_restart":
            report = await relay_restart(trio, stream, args.count, down=args.down, wait=args.wait)
            report.seed = args.seed
            return report
        return await faults_then_heal(trio, stream, args.count, seed=args.seed, seconds=args.seconds,
                                      restarts=args.restarts, tail=args.tail, wait=args.wait)
    finally:
        if stream is not None:
            await stream.close()
        await trio.close()
        nodes.cleanup()


def summary(r: Report) -> str:
    def t(value):
        return "never" if value is None else f"{value:.1f} s"

    links = ", ".join(f"{k}-R {t(v)}" for k, v in sorted(r.link_up.items()))
    flips = f" (ended their connection: {r.flips_ended}, at most {t(r.flip_to_end_max)} after)" if r.flips else ""
    return "\n".join([
        f"{r.scenario}: seed {r.seed}, {r.sent} containers S -> B via R; faults {r.faults or '-'}; "
        f"restarts {r.restarts}; flips {r.flips}{flips}",
        f"after the faults stopped: links back {links}; S's outbox empty {t(r.outbox_empty)} "
        f"({t(r.outbox_after_link)} after S-R was back); B's agent had all {t(r.delivered)} "
        f"({t(r.delivered_after_links)} after both links were back)",
        f"S's outbox when S-R was back: {r.waiting_at_link} entries, the last due by its retry time in "
        f"{r.last_due_after_link} s; still waiting after 5/10/20 s: {r.waiting_after}",
        f"exactly once: not seen {r.missing}, seen twice {r.repeated}, stored at B {r.stored_at_b}/{r.sent}; "
        f"held at R {r.relay_held}; went around the proxies: {r.bypassed or 'nothing'}",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("faults", "relay_restart"), default="faults")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--count", type=positive_int, default=1000, help="containers S sends to B")
    parser.add_argument("--seconds", type=positive_float, default=60.0, help="faults: how long they run")
    parser.add_argument("--restarts", type=positive_int, default=3, help="faults: SIGKILLs of R and of B each")
    parser.add_argument("--tail", type=positive_float, default=5.0,
                        help="faults: then both links partitioned this long")
    parser.add_argument("--down", type=positive_float, default=30.0, help="relay_restart: R down this long")
    parser.add_argument("--wait", type=positive_float, default=300.0,
                        help="give up this long after the links were back")
    parser.add_argument("--keep", type=Path, help="keep the nodes' directories (and logs) here")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="hmpnode-faults-"))
    try:
        report = asyncio.run(run(args, base))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(summary(report))
    print(json.dumps(report.as_dict()))
    ok = (report.delivered is not None and report.outbox_empty is not None and not report.missing
          and not report.repeated and report.stored_at_b == report.sent and not report.bypassed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
