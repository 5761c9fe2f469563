"""Catch-up cost between two real nodes on loopback: bytes on the wire, round trips, seconds.

Two `hmpnode run` processes share `--n` broadcast containers and differ by D (half
held only by one node, half only by the other) for each D in `--diffs`, in two cases:

- first contact: the nodes never met (no peers-table row, no cursor);
- reconnect: they were connected (and in sync) before; then apart, each received its
  own D/2 containers (and, with `--common C`, both the same C others), then they
  connect again.

The containers are built and signed offline once (hmpnode.container.build), imported
into a template pair of nodes via POST /v1/containers/import while the nodes cannot see
each other (LAN discovery on a port of their own, no DHT, no bootstrap), and the template
data directories are copied for every case. Nodes meet by LAN discovery on loopback
(the first node is restarted on the second's discovery port).

Bytes: the kernel's counters of the TCP connection between the two nodes (`ss -ti`
bytes_sent + bytes_received of one end: both directions, headers of TCP/IP excluded,
WebSocket upgrade and handshake included); the line "baseline" is the same for two
empty nodes (upgrade, handshake and an empty reconciliation). Round trips: the
initiating node's reconciliation messages that were answered (the slower of its two
sets), plus one for the transfer (`want` -> containers; pushes travel with the next
message) when anything differed. Seconds: from the first byte of the connection to the
last (both nodes then hold the union), polled every ~0.05 s; reconcile_bytes: the
`reconcile` frames both nodes sent (JSON, base64 included: reconciliation and `want`),
the rest is the containers, their acks and the handshake; reconcile_seconds: the
initiator's own time from its start (snapshot included) to the end of the global set.
Differences are spread over the time span of the shared containers. Prints one line
per case, then one JSON object as the last line.

The RSS of a node with 200 idle peers (issue 11) is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hmpnode.client import Client  # noqa: E402
from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity.keys import Identity  # noqa: E402
from tests.nodeproc import NodeProcess, node_env  # noqa: E402
from _benchlib import nonnegative_ints  # noqa: E402  (scripts/ is on sys.path)

T0 = datetime(2026, 10, 1, tzinfo=timezone.utc)



def build(identity: Identity, tag: str, count: int, step: float = 1.0) -> list[dict]:
    """`count` signed broadcast notes, `step` seconds apart from T0 (distinct DIDs per tag)."""
    return [build_container(identity, "note", {"text": f"{tag} note {i}"}, now=T0 + timedelta(seconds=i * step),
                            broadcast=True) for i in range(count)]


class Pair:
    """Two nodes in `base` (a, b), started apart or together."""

    def __init__(self, base: Path, port_a: int, port_b: int, extra_env: dict[str, str] | None = None):
        self.base = base
        self.ports = {"a": port_a, "b": port_b}
        self.extra = extra_env or {}
        self.procs: dict[str, NodeProcess] = {}
        self.clients: dict[str, Client] = {}

    def env(self, discovery_port: int) -> dict[str, str]:
        return node_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_DISCOVERY_PORT=str(discovery_port),
                        HMPNODE_PEER_DISCOVERY_INTERVAL_MS="300", **self.extra)

    def start(self, name: str, discovery_port: int) -> Client:
        proc = NodeProcess(self.base / name, env=self.env(discovery_port)).start()
        self.procs[name] = proc
        proc.wait_ready(timeout=120)
        self.clients[name] = client = Client.from_data_dir(proc.data_dir)
        return client

    async def stop(self, name: str) -> None:
        client = self.clients.pop(name, None)
        if client is not None:
            await client.close()
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.stop(timeout=60)

    async def close(self) -> None:
        for name in list(self.procs):
            await self.stop(name)

    def kill(self) -> None:
        for proc in self.procs.values():
            proc.cleanup()


async def import_all(client: Client, containers: list[dict], batch: int = 1000) -> None:
    for i in range(0, len(containers), batch):
        answer = await client.import_containers(containers[i:i + batch])
        if answer["rejected"]:
            raise SystemExit(f"import rejected {answer['rejected']} containers: {answer['results'][:2]}")


async def held(client: Client) -> int:
    return (await client.status())["store"]["containers"]


def peer_port(client_status: dict) -> int:
    return client_status["mesh"]["peer_port"]


_SS_LINE = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)")


def wire_bytes(pid: int, ports: set[int]) -> tuple[int, int]:
    """(bytes sent, bytes received) over the process's established TCP connections whose
    local or remote port is one of `ports` (the nodes' peer ports), from the kernel."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                         timeout=10).stdout
    sent = received = 0
    lines = out.splitlines()
    for i, line in enumerate(lines):
        m = _SS_LINE.search(line)
        if not m or f"pid={pid}," not in line:
            continue
        local, remote = int(m.group(2)), int(m.group(4))
        if local not in ports and remote not in ports:
            continue
        detail = line + " " + (lines[i + 1] if i + 1 < len(lines) else "")
        s = re.search(r"bytes_sent:(\d+)", detail)
        r = re.search(r"bytes_received:(\d+)", detail)
        sent += int(s.group(1)) if s else 0
        received += int(r.group(1)) if r else 0
    return sent, received


async def connect_and_measure(pair: Pair, shared_port: int, want_total: int, timeout: float) -> dict:
    """Start a on b's discovery port; wait until both hold `want_total` and the connection
    is quiet (no byte moved for 2 s); read the counters."""
    b = pair.clients["b"]
    a = pair.start("a", shared_port)
    status_a, status_b = await a.status(), await b.status()
    ports = {peer_port(status_a), peer_port(status_b)}
    pid = pair.procs["a"].pid
    deadline = time.monotonic() + timeout
    first = last_change = None
    last = (0, 0)
    while True:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout} s waiting for both nodes to hold {want_total}")
        now, counts = time.monotonic(), wire_bytes(pid, ports)
        if counts != last:
            first = first if first is not None else now
            last, last_change = counts, now
        if first is not None and now - last_change >= 2.0 and await held(a) >= want_total \
                and await held(b) >= want_total:
            break
        await asyncio.sleep(0.05)
    sent, received = last
    counters = [(await c.status())["mesh"]["counters"] for c in (a, b)]
    rounds = max(max(c.get("sync_round_trips_global", 0), c.get("sync_round_trips_scoped", 0)) for c in counters)
    moved = sum(c.get("sync_wanted", 0) + c.get("sync_pushed", 0) for c in counters)
    return {"bytes": sent + received, "bytes_a_to_b": sent, "bytes_b_to_a": received,
            "round_trips": rounds + (1 if moved else 0), "reconcile_round_trips": rounds,
            "seconds": round(last_change - first, 2),
            "reconcile_seconds": max(c.get("sync_ms_global", 0) for c in counters) / 1000, "moved": moved,
            "reconcile_bytes": sum(c.get("sync_bytes_sent", 0) for c in counters),
            "containers_sent": sum(c.get("containers_sent", 0) for c in counters),
            "held": await held(a)}


async def run_case(template: Path, work: Path, kind: str, n: int, d: int, extra_a: list, extra_b: list,
                   ports: tuple[int, int], timeout: float, common: list | None = None) -> dict:
    case = work / f"{kind}-{d}"
    shutil.copytree(template, case)
    pair = Pair(case, *ports)
    common = common or []
    try:
        if kind == "reconnect":  # meet once and sync (until the connection is quiet); then apart
            b = pair.start("b", ports[1])
            await connect_and_measure(pair, ports[1], n, timeout)
            await pair.stop("a")
            await pair.stop("b")
        a = pair.start("a", ports[0])  # apart: each gets its own (and, with --common, the same ones)
        await import_all(a, common + extra_a)
        await pair.stop("a")
        b = pair.start("b", ports[1])
        await import_all(b, common + extra_b)
        result = await connect_and_measure(pair, ports[1], n + len(common) + len(extra_a) + len(extra_b), timeout)
        if common:
            result["common_while_apart"] = len(common)
    finally:
        try:
            await pair.close()
        finally:
            pair.kill()
            shutil.rmtree(case, ignore_errors=True)
    return {"case": kind, "shared": n, "different": d, **result}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="containers both nodes hold")
    ap.add_argument("--diffs", type=nonnegative_ints, default=[0, 10, 1000], help="differences per case")
    ap.add_argument("--cases", default="first,reconnect", help="first,reconnect")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take to converge")
    ap.add_argument("--keep", type=Path, default=None, help="template directory to reuse (built if missing)")
    ap.add_argument("--common", type=int, default=0,
                    help="reconnect: containers both nodes receive (the same ones) while apart")
    ap.add_argument("--idle-peers", type=int, default=200,
                    help="then the RSS of a node with this many idle authenticated peers "
                         "(scripts/probe_peer_memory idle; 0: skip)")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if any(c not in ("first", "reconnect") for c in cases):
        raise SystemExit("--cases: first and/or reconnect")
    work = Path(tempfile.mkdtemp(prefix="hmpnode-bench-sync-"))
    base = 41000 + os.getpid() % 15000
    ports = (base, base + 1)
    ident = Identity.generate()
    t = time.monotonic()
    shared = build(ident, "shared", args.n)
    print(f"built {args.n} containers in {time.monotonic() - t:.1f} s", flush=True)
    template = args.keep or work / "template"
    results = []
    try:
        if not (template / "a").exists():
            t = time.monotonic()
            pair = Pair(template, *ports)
            try:
                for name, port in (("a", ports[0]), ("b", ports[1])):
                    await import_all(pair.start(name, port), shared)
                    await pair.stop(name)
            finally:
                pair.kill()
            print(f"imported {args.n} into two nodes in {time.monotonic() - t:.1f} s", flush=True)
        empty = work / "empty"
        empty.mkdir()
        base_line = await run_case(empty, work, "first", 0, 0, [], [], ports, args.timeout)
        base_line["case"] = "baseline"
        print(json.dumps(base_line), flush=True)
        results.append(base_line)
        for kind in cases:
            for d in args.diffs:
                # the differences spread over the shared containers' time span (offset by half a step)
                na, nb = d // 2 + d % 2, d // 2
                only_a = build(ident, f"a-only-{kind}-{d}", na, args.n / max(na, 1))
                only_b = build(ident, f"b-only-{kind}-{d}", nb, args.n / max(nb, 1))
                common = build(ident, f"common-{d}", args.common, args.n / max(args.common, 1)) \
                    if kind == "reconnect" and args.common else None
                r = await run_case(template, work, kind, args.n, d, only_a, only_b, ports, args.timeout, common)
                r["bytes_per_difference"] = round(r["bytes"] / d) if d else None
                r["reconcile_bytes_per_difference"] = round(r["reconcile_bytes"] / d) if d else None
                print(json.dumps(r), flush=True)
                results.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    idle = idle_peers_rss(args.idle_peers) if args.idle_peers > 0 else None
    print(json.dumps({"bench": "sync", "n": args.n, "results": results, "idle_peers": idle}))


def idle_peers_rss(peers: int) -> dict:
    """The last line of `probe_peer_memory idle --peers N` (one node, N idle authenticated
    peers: RSS over the same node idle), measured by that script, not again here."""
    probe = Path(__file__).with_name("probe_peer_memory.py")
    out = subprocess.run([sys.executable, str(probe), "idle", "--peers", str(peers)], capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{peers} idle peers: +{result['growth_mb']} MB over an idle node", flush=True)
    return result


if __name__ == "__main__":
    asyncio.run(main())
