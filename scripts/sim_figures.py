"""The simulator's figures for docs/simulation.md, each run seeded and replayable.

    ./scripts/sim_figures [--nodes 1000] [--big 10000] [--broadcasts 100] [--out docs/sim]

Runs (links 20-80 ms, `--broadcasts` broadcasts from random origins):

- `quiet`: `--nodes` nodes, no faults, real crypto: delivery, propagation p50/p99 and its
  CDF (PNG), duplicate deliveries and control frames and bytes per node per broadcast,
  CPU per delivered broadcast per node against one raw Ed25519 verify measured now;
- `churn`: the same with 30 % of the nodes leaving and coming back: eventual delivery
  and the time to repair what a node missed;
- `relays`: directed mail through 10 relays, 20 % of them crashing and restarting, 20 %
  of the recipients offline when their mail is sent: exactly once, none lost;
- `big`: `--big` nodes, no faults, the cheap crypto stand-in (hmpnode.sim.standin):
  wall time and peak memory of the whole run.

Each run's report is written to OUT/<name>.json; the CDF to OUT/propagation-cdf.png.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(name: str, out: Path, **scenario) -> dict:
    """One run in its own process (its peak memory is its own), the report as JSON."""
    args = [sys.executable, "-m", "hmpnode.sim.cli", "mesh", "--json", "--delays"]
    for key, value in scenario.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, ",".join(map(str, value)) if isinstance(value, tuple) else
                                              str(value)]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"{name}: the run failed:\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["name"], report["process_wall_s"] = name, round(wall, 1)
    report["command"] = "./scripts/sim mesh " + " ".join(args[6:])
    delays = report["figures"].pop("delays", [])
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{name}: {len(report['violations'])} violations, "
          + ", ".join(f"{k}={v}" for k, v in report["figures"].items() if not isinstance(v, dict)), flush=True)
    report["delays"] = delays
    return report


def cdf(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for report in reports:
        delays = sorted(report["delays"])
        if not delays:
            continue
        ys = [(i + 1) / len(delays) for i in range(len(delays))]
        f = report["figures"]
        ax.plot([1000 * d for d in delays], ys, label=f"{f['nodes']} nodes ({f['crypto']} crypto)")
    ax.set_xlabel("propagation delay, simulated ms (publish -> stored at a node)")
    ax.set_ylabel("fraction of (broadcast, node) deliveries")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Broadcast propagation, links 20-80 ms, fanout 4")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--big", type=int, default=10000, help="0: no big run")
    p.add_argument("--broadcasts", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "sim")
    p.add_argument("--only", default="", help="comma-separated run names")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, a.only.split(",")))
    common = dict(seed=a.seed, broadcasts=a.broadcasts, active=60.0, settle=30.0)
    runs = {
        "quiet": dict(nodes=a.nodes, **common),
        "churn": dict(nodes=a.nodes, churn=0.3, **common),
        "relays": dict(nodes=a.nodes, relays=10, directed=200, offline=0.2, relay_crashes=0.2, **common),
    }
    if a.big:
        runs["big"] = dict(nodes=a.big, crypto="plain", **common)
    reports = [run(name, a.out, **scenario) for name, scenario in runs.items() if not only or name in only]
    curves = [r for r in reports if r["name"] in ("quiet", "big")]
    if curves:
        cdf(curves, a.out / "propagation-cdf.png")
        print(f"wrote {a.out / 'propagation-cdf.png'}")
    print(f"peak memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")


if __name__ == "__main__":
    main()
