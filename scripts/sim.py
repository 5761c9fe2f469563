"""The simulator's command line: one subcommand per simulation (docs/simulation.md).

    ./scripts/sim dht --nodes 1000 --seed 1 --churn 0.3
    ./scripts/sim mesh --nodes 1000 --seed 1 --broadcasts 100 --churn 0.3   (hmpnode/sim/cli.py)

Exit codes: 0 the run met its targets, 1 it did not (the seed and the command that
replays it are printed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from _benchlib import percentile, positive_int

from hmpnode.sim.cli import add_mesh
from hmpnode.sim.cli import main as cli_main
from hmpnode.sim.dht import DhtSimConfig, DhtSimResult, run_dht_sim


def dht_report(r: DhtSimResult) -> str:
    c = r.config
    rounds, lat = r.rounds or [0], r.latencies or [0.0]
    return "\n".join([
        f"dht sim: nodes {c.nodes}, seed {c.seed}, churn {c.churn:.0%} ({r.churned} nodes left and came back, "
        f"at most {r.down_peak} down at once), links {c.latency[0] * 1000:.0f}-{c.latency[1] * 1000:.0f} ms, "
        f"loss {c.loss:.0%}",
        f"lookups: {r.found} / {r.lookups} found ({r.success:.2%})",
        f"hops (FIND_VALUE rounds per lookup): p50 {percentile(rounds, 0.5)}, p99 {percentile(rounds, 0.99)}, "
        f"max {rounds[-1]}",
        f"lookup latency (simulated): p50 {percentile(lat, 0.5) * 1000:.0f} ms, "
        f"p99 {percentile(lat, 0.99) * 1000:.0f} ms",
        f"datagrams {r.datagrams}, simulated {r.sim_seconds:.0f} s, wall {r.wall_seconds:.1f} s, "
        f"peak RSS {r.peak_rss_mb:.0f} MB",
        f"seed {c.seed} digest {r.digest}",
    ])


def _dht(args: argparse.Namespace) -> int:
    config = DhtSimConfig(nodes=args.nodes, seed=args.seed, churn=args.churn, lookups=args.lookups,
                          providers=args.providers, loss=args.loss)
    result = run_dht_sim(config)
    print(dht_report(result))
    if result.success < args.min_success:
        replay = ["./scripts/sim", "dht", "--nodes", str(args.nodes), "--seed", str(args.seed), "--churn",
                  str(args.churn), "--lookups", str(args.lookups), "--providers", str(args.providers),
                  "--loss", str(args.loss)]
        print(f"FAILED: success {result.success:.2%} < {args.min_success:.2%} (seed {args.seed}); replay: "
              f"{shlex.join(replay)}")
        return 1
    return 0


def add_dht(sub) -> None:
    dht = sub.add_parser("dht", help="the node's Kademlia DHT with churn: lookup success and hops")
    dht.add_argument("--nodes", type=positive_int, default=1000)
    dht.add_argument("--seed", type=int, default=1)
    dht.add_argument("--churn", type=float, default=0.3, help="share of nodes that leave and come back")
    dht.add_argument("--lookups", type=positive_int, default=1000)
    dht.add_argument("--providers", type=int, default=1, help="provider records each node publishes")
    dht.add_argument("--loss", type=float, default=0.0, help="datagram loss probability")
    dht.add_argument("--min-success", type=float, default=0.99, help="exit 1 below this lookup success")
    dht.set_defaults(run=_dht)


def main(argv: list[str] | None = None) -> int:
    return cli_main(argv, adders=(add_dht, add_mesh), prog="scripts/sim")


if __name__ == "__main__":
    sys.exit(main())
