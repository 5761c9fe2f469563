"""`./scripts/sim`: run the simulator from the command line (docs/simulation.md).

    ./scripts/sim mesh --nodes 1000 --seed 7 --broadcasts 100 --churn 0.3 [--json]

Prints the run's figures, its trace digest and the invariants it broke; exits 1 when
one was broken, naming the seed and the command that replays the run; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from hmpnode.sim.scenario import LOSSES, Scenario, raw_verify_seconds, replay_command, run

__all__ = ["main"]


def add_mesh(sub) -> None:
    """The `mesh` subcommand (also in scripts/sim.py beside `dht`)."""
    p = sub.add_parser("mesh", help="the mesh: nodes, broadcasts, directed mail through relays, faults")
    p.set_defaults(run=run_mesh)
    for f in dataclasses.fields(Scenario):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        elif isinstance(default, tuple):
            p.add_argument(flag, default=",".join(str(v) for v in default),
                           help=f"comma-separated (losses: {', '.join(LOSSES)})" if f.name == "lose" else
                           "comma-separated")
        else:
            p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.add_argument("--delays", action="store_true", help="with --json: every propagation delay (for a CDF)")


def _scenario(args: argparse.Namespace) -> Scenario:
    values = {}
    for f in dataclasses.fields(Scenario):
        value = getattr(args, f.name)
        if isinstance(f.default, tuple):
            items = [v for v in str(value).split(",") if v]
            value = tuple(items) if f.name == "lose" else tuple(float(v) for v in items)
        values[f.name] = value
    return Scenario(**values)  # ValueError when the scenario cannot run


def run_mesh(args: argparse.Namespace) -> int:
    scenario = _scenario(args)
    report = run(scenario)
    figures = dict(report.figures)
    if getattr(args, "delays", False):
        figures["delays"] = [round(d, 4) for d in report.delays]
    if figures.get("cpu_s") and figures.get("deliveries"):
        unit = raw_verify_seconds()
        figures["raw_ed25519_verify_us"] = round(unit * 1e6, 1)
        figures["cpu_per_delivery_in_verifies"] = round(figures["cpu_s"] / figures["deliveries"] / unit, 1)
    if args.json:
        print(json.dumps({"scenario": dataclasses.asdict(scenario), "digest": report.digest, "figures": figures,
                          "violations": report.violations}))
    else:
        for key, value in figures.items():
            print(f"{key}: {value}")
        print(f"digest: {report.digest}")
        for v in report.violations:
            print(f"VIOLATION: {v}")
    if report.violations:
        print(f"FAILED: seed {scenario.seed}; replay: {replay_command(scenario)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None, *, adders=(add_mesh,), prog: str = "sim") -> int:
    """Parse and run one simulation; `adders` add the subcommands (./scripts/sim adds `dht`
    beside `mesh`). Exit 2 on arguments or a scenario the simulation refuses."""
    parser = argparse.ArgumentParser(prog=prog, description="deterministic simulations of hmpnode")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in adders:
        add(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as exc:  # a scenario the simulation refuses
        print(f"{prog} {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
