"""NAT benchmark: real nodes in the NAT lab (tests/natlab.py), every pair exchanging mail.

    ./scripts/bench_nat [--delay-ms 5] [--timeout 60] [--upgrade-wait 30] [--runs 1] [--keep DIR]

The lab: an internet segment whose switch delays every frame by --delay-ms, with two
public hosts (`relay`: roles relay + circuit; `boot`: the DHT bootstrap node) and one
home of each kind a..f (tests/natlab.py KINDS: port-preserving masquerade, the same with a
filter, symmetric, double NAT, 1:1 NAT, container). Every node bootstraps its DHT from
`boot`; every home node has the relay as a static peer. Settings this build does not know
yet (peer.static, the circuit role) are left out and said so in "features".

Then every node sends a directed note to every other (both directions of each pair at
once) and, polling each node's agent API through a small agent process inside its
namespace, measures per pair: delivered each way; the session between the two
(`/v1/peers` "via": the relay's DID for a relayed session, null for a direct one; a build
without the field counts as direct), the time from the sends (the first dial) to the first
session and to the first relayed one, and from relayed to direct (waiting up to
--upgrade-wait); the relay's CPU seconds and bytes on its links during the exchange; the
reachability verdict of every node (`/v1/status` reachability.verdict: the public hosts
and the 1:1 host should say public, the others private).

The hole-punch counters of all nodes are summed (started, direct, direct on attempt 1..3,
failed by reason). `--runs N` repeats everything on fresh labs and pools the figures (the
issue's "100 attempts" of punching: each run punches every pair that needs it once).

Every wait is bounded; Ctrl-C or any failure tears the lab down (processes, namespaces,
temp dirs). Needs root, nft and ethtool. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.natlab import INTERNET

PEER_PORT = 7946
DHT_PORT = 7947
AGENT_TIMEOUT = 15.0
POLL_S = 0.25
PUBLIC_REACH = ("public", "e")  # kinds whose own address can be dialled from the internet


# -- the agent: one per node, inside the node's namespace ------------------------------------

def agent(data_dir: str) -> int:
    """Answer JSON-line requests about the node on `data_dir` through its agent API (the
    API listens on the namespace's loopback, where only a process inside can reach it)."""
    from hmpnode.client import ApiError, Client

    async def handle(client: Client, req: dict) -> Any:
        op = req["op"]
        if op == "status":
            return await client.status()
        if op == "peers":
            return (await client.peers())["peers"]
        if op == "send":
            made = await client.create("note", {"text": req["text"]}, recipients=[req["to"]])
            return made["did"]
        if op == "holds":
            held = []
            for did in req["dids"]:
                try:
                    await client.get(did)
                    held.append(did)
                except ApiError as exc:
                    if exc.status != 404:
                        raise
            return held
        raise ValueError(f"unknown op {op!r}")

    loop = asyncio.new_event_loop()
    client = Client.from_data_dir(data_dir)
    try:
        for line in sys.stdin:
            try:
                answer = {"ok": True, "result": loop.run_until_complete(handle(client, json.loads(line)))}
            except Exception as exc:  # noqa: BLE001 - reported to the bench, which decides
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    return 0


class Agent:
    """The bench's end of one agent process: requests go out at once, answers are read
    with a deadline, so that all nodes are asked in parallel."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc
        self.buffer = b""

    def ask(self, **req: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def answer(self, timeout: float = AGENT_TIMEOUT) -> Any:
        """The next answer's result; None if the node answered with an error."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.proc.args[-1]} gave no answer within {timeout} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"agent {self.proc.args[-1]} exited")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        reply = json.loads(line)
        return reply["result"] if reply["ok"] else None

    def call(self, **req: Any) -> Any:
        self.ask(**req)
        return self.answer()


def ask_all(agents: dict[str, Agent], requests: dict[str, dict]) -> dict[str, Any]:
    for name, req in requests.items():
        agents[name].ask(**req)
    return {name: agents[name].answer() for name in requests}


# -- the bench ----------------------------------------------------------------------------------

def features(tmp: Path) -> dict[str, bool]:
    """Which of the settings the bench wants this build accepts (others helpers add them)."""
    from hmpnode.config import ConfigError, load_settings
    from hmpnode.identity import Identity

    def accepts(text: str) -> bool:
        path = tmp / "probe.toml"
        path.write_text(text)
        try:
            load_settings(data_dir=tmp, config_file=path, env={}, overrides={})
            return True
        except ConfigError:
            return False

    did = Identity.generate().did
    return {"static": accepts(f'[peer]\nstatic = ["{did}@tcp://198.18.0.10:{PEER_PORT}"]\n'),
            "circuit": accepts('[node]\nroles = ["relay", "circuit"]\n')}


def config(*, roles: list[str], bootstrap: list[str], static: list[str]) -> str:
    lines = ["[node]", f"roles = {json.dumps(roles)}", "", "[peer]", 'host = "0.0.0.0"', f"port = {PEER_PORT}",
             f"dht_port = {DHT_PORT}", f"bootstrap = {json.dumps(bootstrap)}", "lan_discovery = false",
             # the lab's internet uses documentation ranges, which the dial rule takes for private
             f"dial_allow = {json.dumps(list(INTERNET))}"]
    if static:
        lines.append(f"static = {json.dumps(static)}")
    return "\n".join(lines) + "\n"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def link_bytes(lab: Any, host: Any) -> int:
    """Bytes received + sent on the host's interfaces (loopback aside)."""
    out = lab.run(host, ["ip", "-s", "-j", "link"], timeout=10)
    total = 0
    for link in json.loads(out.stdout):
        if link.get("ifname") != "lo":
            stats = link.get("stats64", {})
            total += stats.get("rx", {}).get("bytes", 0) + stats.get("tx", {}).get("bytes", 0)
    return total


def reachability(status: dict | None) -> dict | None:
    """`reachability` of a /v1/status answer, wherever this build puts it (None: absent)."""
    if not status:
        return None
    for where in (status, status.get("mesh") or {}, status.get("status") or {}):
        if isinstance(where.get("reachability"), dict):
            return where["reachability"]
    return None


def punch_counters(statuses: Any) -> dict[str, int]:
    """The hole-punch counters (`punch_*` in /v1/status mesh.counters) summed over the nodes."""
    total: dict[str, int] = {}
    for status in statuses:
        counters = ((status or {}).get("mesh") or {}).get("counters") or {}
        for key, value in counters.items():
            if key.startswith("punch_") and isinstance(value, int):
                total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def expect_direct(kind_x: str, kind_y: str) -> bool:
    """A pair that can end direct: neither side symmetric, or the other dialable from outside."""
    if "c" not in (kind_x, kind_y):
        return True
    other = kind_y if kind_x == "c" else kind_x
    return other in PUBLIC_REACH


def exchange(agents: dict[str, Agent], dids: dict[str, str], kinds: dict[str, str], timeout: float,
             upgrade_wait: float, payload_bytes: int) -> dict:
    """Every node sends a note to every other; watch deliveries and sessions until all is
    delivered and every pair that can be direct is (or the time is up)."""
    names = list(agents)
    pairs = list(itertools.combinations(names, 2))
    t0 = time.monotonic()
    order = list(itertools.permutations(names, 2))
    for x, y in order:  # all asked first: the nodes send in parallel, each its own in turn
        agents[x].ask(op="send", to=dids[y], text=f"bench_nat {x}->{y} ".ljust(payload_bytes, "."))
    sent = {(x, y): agents[x].answer() for x, y in order}
    if any(v is None for v in sent.values()):
        raise RuntimeError(f"a node refused a send: {[k for k, v in sent.items() if v is None]}")
    delivered: dict[tuple[str, str], float] = {}
    state = {p: {"first_session_ms": None, "first_relayed_ms": None, "direct_ms": None, "session": "none"}
             for p in pairs}
    deadline, upgrade_deadline = t0 + timeout, None
    polls: list[float] = []
    while time.monotonic() < (upgrade_deadline or deadline):
        now_ms = round((time.monotonic() - t0) * 1000, 1)
        polls.append(now_ms)
        waiting: dict[str, list[str]] = {}
        for (x, y), did in sent.items():
            if (x, y) not in delivered:
                waiting.setdefault(y, []).append(did)
        answers = ask_all(agents, {name: {"op": "peers"} for name in names})
        held = ask_all(agents, {y: {"op": "holds", "dids": these} for y, these in waiting.items()})
        for (x, y), did in sent.items():
            if (x, y) not in delivered and did in (held.get(y) or ()):
                delivered[(x, y)] = now_ms
        for (x, y), s in state.items():
            entry = next((p for p in answers[x] or () if p.get("did") == dids[y] and p.get("connected")), None)
            if entry is None:
                s["session"] = "none"
                continue
            via = entry.get("via")  # absent in a build without circuits: a direct session
            s["session"] = "relayed" if via else "direct"
            if s["first_session_ms"] is None:
                s["first_session_ms"] = now_ms
            if via and s["first_relayed_ms"] is None:
                s["first_relayed_ms"] = now_ms
            if not via and s["first_relayed_ms"] is not None and s["direct_ms"] is None:
                s["direct_ms"] = now_ms
        if len(delivered) == len(sent):
            if all(s["session"] == "direct" for (x, y), s in state.items() if expect_direct(kinds[x], kinds[y])):
                break
            if upgrade_deadline is None:
                upgrade_deadline = min(deadline, time.monotonic() + upgrade_wait)
        time.sleep(POLL_S)
    for (x, y), s in state.items():
        s["delivered"] = {f"{a}->{b}": delivered.get((a, b)) for a, b in ((x, y), (y, x))}
    # the times above are those of the poll that first saw a thing: this is their resolution
    gaps = [b - a for a, b in zip(polls, polls[1:])]
    return {"elapsed_s": round(time.monotonic() - t0, 2), "pairs": state, "sends": len(sent),
            "poll_interval_ms": percentiles(gaps)}


def percentiles(values: list[float]) -> dict[str, float] | None:
    from _benchlib import p50_p95

    return p50_p95(values) if values else None


def run(args: argparse.Namespace) -> dict:
    from tests.natlab import NatLab, lab_env, natlab_unavailable

    why = natlab_unavailable()
    if why:
        raise SystemExit(f"bench_nat: {why}")
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hmpnode-nat-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        have = features(base)
        with NatLab(delay_ms=args.delay_ms) as lab:
            relay_host, boot_host = lab.public("relay"), lab.public("boot")
            homes = {kind: lab.home(kind, kind) for kind in "abcdef"}
            hosts = {"relay": relay_host, "boot": boot_host, **homes}
            bootstrap = [f"{boot_host.ip}:{DHT_PORT}"]

            def start(name: str, roles: list[str], static: list[str]) -> Any:
                data = base / name
                data.mkdir(mode=0o700, exist_ok=True)
                (data / "hmpnode.toml").write_text(config(roles=roles, bootstrap=bootstrap if name != "boot" else [],
                                                          static=static if have["static"] else []))
                return lab.node(hosts[name], data, env=lab_env())

            started = time.monotonic()
            procs = {"boot": start("boot", [], [])}
            procs["relay"] = start("relay", ["relay", "circuit"] if have["circuit"] else ["relay"], [])
            infos = {name: proc.wait_ready(timeout=60) for name, proc in procs.items()}
            static = [f"{infos['relay']['did']}@tcp://{relay_host.ip}:{PEER_PORT}"]
            for kind in homes:
                procs[kind] = start(kind, [], static)
            infos.update({kind: procs[kind].wait_ready(timeout=60) for kind in homes})
            dids = {name: info["did"] for name, info in infos.items()}
            kinds = {name: host.kind for name, host in hosts.items()}
            me = str(Path(__file__).resolve())
            agents = {name: Agent(lab.popen(host, [sys.executable, me, "--agent", str(base / name)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=lab_env()))
                      for name, host in hosts.items()}
            if args.settle > 0:
                time.sleep(args.settle)  # static peers and the DHT get going before the first send

            cpu0, bytes0 = cpu_seconds(procs["relay"].pid), link_bytes(lab, relay_host)
            result = exchange(agents, dids, kinds, args.timeout, args.upgrade_wait, args.payload_bytes)
            relay_cpu = cpu_seconds(procs["relay"].pid) - cpu0
            relay_bytes = link_bytes(lab, relay_host) - bytes0
            # a verdict needs its dial-backs' deadline (20 s after the ask): wait, bounded,
            # until no node says unknown (the time since the nodes started is reported)
            verdict_deadline = time.monotonic() + args.verdict_wait
            while True:
                statuses = ask_all(agents, {name: {"op": "status"} for name in hosts})
                pending = [n for n in hosts if (reachability(statuses[n]) or {}).get("verdict") in (None, "unknown")]
                if not pending or time.monotonic() >= verdict_deadline:
                    break
                time.sleep(1.0)
            verdicts_s = round(time.monotonic() - started, 1)
            relay_status = statuses["relay"] or {}
            nodes = {}
            for name in hosts:
                reach = reachability(statuses[name])
                expected = "public" if kinds[name] in PUBLIC_REACH else "private"
                nodes[name] = {"kind": kinds[name], "ip": hosts[name].ip, "public_ip": hosts[name].public_ip,
                               "verdict": reach.get("verdict") if reach else None, "expected": expected}
            circuits = relay_status.get("circuits") or (relay_status.get("mesh") or {}).get("circuits")
            punches = punch_counters(statuses.values())
        switch = lab.switch_counts
        out = summarise(args, have, kinds, nodes, result, relay_cpu, relay_bytes, circuits, switch)
        out["punches"] = punches
        out["figures"]["verdicts_after_s"] = verdicts_s
        # each node's own measure: from a dial through the relay to the admitted session
        out["relayed_dial_ms"] = [ms for st in statuses.values() for ms in
                                  (((st or {}).get("mesh") or {}).get("circuits") or {}).get("relayed_dial_ms", [])]
        out["figures"]["relayed_dial_ms"] = percentiles(out["relayed_dial_ms"])
        return out
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def summarise(args, have, kinds, nodes, result, relay_cpu, relay_bytes, circuits, switch) -> dict:
    pairs = result["pairs"]
    rows = []
    for (x, y), s in pairs.items():
        rows.append({"pair": f"{x}-{y}", "kinds": f"{kinds[x]}x{kinds[y]}", "expect_direct": expect_direct(kinds[x], kinds[y]),
                     "delivered": s["delivered"], "session": s["session"],
                     "first_session_ms": s["first_session_ms"], "first_relayed_ms": s["first_relayed_ms"],
                     "relayed_to_direct_ms": (round(s["direct_ms"] - s["first_relayed_ms"], 1)
                                              if s["direct_ms"] is not None else None)})
    punchable = [r for r in rows if r["expect_direct"]]
    figures = {
        "delivered": f"{sum(ms is not None for r in rows for ms in r['delivered'].values())}/{2 * len(rows)}",
        "pairs_direct_where_expected": f"{sum(r['session'] == 'direct' for r in punchable)}/{len(punchable)}",
        "pairs_relayed": sum(r["session"] == "relayed" for r in rows),
        "pairs_without_session": sum(r["session"] == "none" for r in rows),
        "first_session_ms": percentiles([r["first_session_ms"] for r in rows if r["first_session_ms"] is not None]),
        "first_relayed_session_ms": percentiles([r["first_relayed_ms"] for r in rows if r["first_relayed_ms"] is not None]),
        "relayed_to_direct_ms": percentiles([r["relayed_to_direct_ms"] for r in rows
                                             if r["relayed_to_direct_ms"] is not None]),
        "delivery_ms": percentiles([ms for r in rows for ms in r["delivered"].values() if ms is not None]),
        "relay_cpu_s": round(relay_cpu, 3), "relay_link_bytes": relay_bytes,
        "relay_link_bytes_per_payload_byte": round(relay_bytes / (args.payload_bytes * result["sends"]), 2),
        "verdicts_correct": f"{sum(n['verdict'] == n['expected'] for n in nodes.values())}/{len(nodes)}",
    }
    figures["poll_interval_ms"] = result["poll_interval_ms"]
    return {"delay_ms": args.delay_ms, "features": have, "elapsed_s": result["elapsed_s"], "figures": figures,
            "nodes": nodes, "pairs": rows, "relay_circuits": circuits, "switch": switch}


def show(out: dict) -> None:
    print(f"bench_nat: one-way delay {out['delay_ms']} ms; this build accepts: "
          + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in out["features"].items()))
    print(f"\n{'node':<6} {'kind':<7} {'ip':<15} {'public ip':<15} {'verdict':<9} expected")
    for name, n in out["nodes"].items():
        print(f"{name:<6} {n['kind']:<7} {n['ip']:<15} {n['public_ip']:<15} {n['verdict']!s:<9} {n['expected']}")
    print(f"\n{'pair':<12} {'kinds':<14} {'delivered':<9} {'session':<8} {'direct?':<8} "
          f"{'session ms':>10} {'relayed ms':>10} {'->direct ms':>11}")
    for r in out["pairs"]:
        print(f"{r['pair']:<12} {r['kinds']:<14} {sum(ms is not None for ms in r['delivered'].values())}/2{'':<6} {r['session']:<8} "
              f"{'expected' if r['expect_direct'] else 'no':<8} {r['first_session_ms']!s:>10} "
              f"{r['first_relayed_ms']!s:>10} {r['relayed_to_direct_ms']!s:>11}")
    print()
    for key, value in out["figures"].items():
        print(f"{key:<30} {value}")
    print(f"{'punches (all nodes)':<30} {out['punches']}")
    print(json.dumps(out, sort_keys=True))


def show_pooled(outs: list[dict]) -> None:
    """Figures over all runs: every pair of every run counted, samples pooled."""
    rows = [r for out in outs for r in out["pairs"]]
    punchable = [r for r in rows if r["expect_direct"]]
    punches: dict[str, int] = {}
    for out in outs:
        for key, value in out["punches"].items():
            punches[key] = punches.get(key, 0) + value
    pooled = {
        "runs": len(outs),
        "delivered": f"{sum(ms is not None for r in rows for ms in r['delivered'].values())}/{2 * len(rows)}",
        "pairs_direct_where_expected": f"{sum(r['session'] == 'direct' for r in punchable)}/{len(punchable)}",
        "pairs_never_connected": sum(r["first_session_ms"] is None for r in rows),
        "first_relayed_session_ms": percentiles([r["first_relayed_ms"] for r in rows if r["first_relayed_ms"] is not None]),
        "relayed_to_direct_ms": percentiles([r["relayed_to_direct_ms"] for r in rows
                                             if r["relayed_to_direct_ms"] is not None]),
        "relayed_dial_ms": percentiles([ms for o in outs for ms in o.get("relayed_dial_ms", [])]),
        "verdicts_correct": f"{sum(n['verdict'] == n['expected'] for o in outs for n in o['nodes'].values())}"
                            f"/{sum(len(o['nodes']) for o in outs)}",
        "punches": punches,
    }
    print(f"\npooled over {len(outs)} runs")
    for key, value in pooled.items():
        print(f"{key:<30} {value}")
    print(json.dumps({"pooled": pooled}, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    from _benchlib import positive_int

    parser = argparse.ArgumentParser(description="NAT lab benchmark (see the module docstring)")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay of the lab's internet (default 5)")
    parser.add_argument("--timeout", type=positive_int, default=60,
                        help="seconds the exchange may take at most (default 60)")
    parser.add_argument("--upgrade-wait", type=float, default=30.0,
                        help="seconds to wait, once all is delivered, for relayed sessions to turn direct (default 30)")
    parser.add_argument("--verdict-wait", type=float, default=60.0,
                        help="seconds to wait after the exchange for every reachability verdict (default 60)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between the nodes being ready and the first send (default 3)")
    parser.add_argument("--payload-bytes", type=positive_int, default=1024,
                        help="size of each note's text (default 1024)")
    parser.add_argument("--runs", type=positive_int, default=1,
                        help="whole runs, each on a fresh lab and fresh nodes; figures pooled at the end (default 1)")
    parser.add_argument("--keep", metavar="DIR", help="keep the nodes' data dirs and logs in DIR")
    parser.add_argument("--agent", metavar="DATA_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agent:
        return agent(args.agent)
    if args.delay_ms < 0 or args.upgrade_wait < 0 or args.settle < 0:
        parser.error("--delay-ms, --upgrade-wait and --settle must be >= 0")

    def interrupted(_signum, _frame):
        # once: a second Ctrl-C must not cut the teardown short (it ignores signals meanwhile)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)  # also when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        outs = []
        for _ in range(args.runs):
            outs.append(run(args))
            show(outs[-1])
        if args.runs > 1:
            show_pooled(outs)
    except KeyboardInterrupt:
        print("bench_nat: interrupted; the lab is torn down", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
