"""What a circuit relay costs and how fast a relayed session comes up (docs/protocol.md 34.3).

Two `hmpnode run` on loopback: a relay R (role circuit, caps raised so that the
figures are not cut by them) and a node N that finds R by LAN discovery on a port of
its own and reserves there (circuit_reserve "always"). Then, from this process:

1. **First dial to a working session**: `--dials` made-up peers (fresh identities)
   each open `/hmp/v2/circuit?to=<N>` on R and run the v2 handshake to N's admission
   (tests.peerclient.authenticate); baseline: as many dial N's own peer port directly,
   interleaved. p50/p95 milliseconds and the ratio of the p50s.
2. **Relay CPU and bytes per relayed MiB**: a made-up reserving peer F holds a
   reservation; a circuit to F carries `--megabytes` MiB in 64 KiB messages from this
   process to itself through R. R's CPU (utime+stime of its process) per MiB and the
   bytes it counted as carried (its status `bytes`; on the wire each byte comes in once
   and goes out once, plus 10 bytes of WebSocket header per message and direction);
   baseline: the CPU this process spent sending and receiving the same bytes (the two
   circuit ends, which over a real session would also encrypt and decrypt them).
3. **Memory per reservation and per circuit**: `--count` made-up peers connect to R
   (VmRSS), reserve (VmRSS), then each gets one idle open circuit (VmRSS): KiB per
   reservation and per circuit are the differences over `--count`.

Prints the figures; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _benchlib import node_session, p50_p95, positive_int, report, rss_kib, start_node, stop_node  # noqa: E402

from hmpnode.identity import Identity  # noqa: E402
from hmpnode.net.connections import CIRCUIT_PATH  # noqa: E402
from hmpnode.net.transport import HANDSHAKE_VERSIONS  # noqa: E402
from tests.peerclient import PeerSocket, authenticate  # noqa: E402

MIB = 1024 * 1024
CHUNK = 64 * 1024


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(discovery_port: int, cap: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HMPNODE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env.update({"HMPNODE_PEER_HOST": "127.0.0.1", "HMPNODE_PEER_DISCOVERY_INTERFACES": "127.0.0.1",
                "HMPNODE_PEER_DISCOVERY_PORT": str(discovery_port), "HMPNODE_PEER_DISCOVERY_INTERVAL_MS": "300",
                "HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_MAX_PEERS": str(cap),
                "HMPNODE_PEER_MAX_LOOPBACK_PEERS": str(cap), "HMPNODE_PEER_MAX_PER_ADDRESS": str(cap),
                "HMPNODE_PEER_MAX_DIDS_PER_ADDRESS": str(10 * cap), "HMPNODE_NODE_IDLE_CONNECTION_SECONDS": "3600"})
    env.update(extra)
    return env


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _nat(ps: PeerSocket, op: str) -> dict:
    while True:
        msg = await ps.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"session ended: {msg.type}")
        frame = orjson.loads(msg.data)
        if frame.get("type") == "nat" and frame.get("op") == op:
            return frame


async def _reserving_peer(http: aiohttp.ClientSession, port: int, seed: int) -> tuple[PeerSocket, str]:
    ident = Identity(seed.to_bytes(4, "big") * 8)
    ps = await authenticate(http, port, ident, versions=HANDSHAKE_VERSIONS)
    if not isinstance(ps, PeerSocket):
        raise RuntimeError(f"relay refused a peer: {ps}")
    await ps.send_json({"type": "nat", "op": "reserve", "id": 1})
    answer = await _nat(ps, "reserved")
    if not answer.get("ok"):
        raise RuntimeError(f"reservation refused: {answer}")
    return ps, ident.did


async def _circuit(http: aiohttp.ClientSession, port: int, peer: PeerSocket, did: str):
    base = f"http://127.0.0.1:{port}{CIRCUIT_PATH}"
    dialer = asyncio.ensure_future(http.ws_connect(f"{base}?to={did}", max_msg_size=8 * MIB))
    token = (await _nat(peer, "connect"))["circuit"]
    accepted = await http.ws_connect(f"{base}?accept={token}", max_msg_size=8 * MIB)
    return await dialer, accepted


async def first_dials(http, r_port: int, n_port: int, n_did: str, count: int) -> dict:
    relayed, direct = [], []
    for i in range(count):
        for kind, port, path, out in (("relayed", r_port, f"{CIRCUIT_PATH}?to={n_did}", relayed),
                                      ("direct", n_port, "/hmp/v2/peer", direct)):
            ident = Identity(bytes([7, kind == "direct", i % 256, i // 256]) * 8)
            start = time.perf_counter()
            ps = await authenticate(http, port, ident, path=path)
            if not isinstance(ps, PeerSocket):
                raise RuntimeError(f"{kind} dial refused: {ps}")
            out.append((time.perf_counter() - start) * 1000)
            await ps.close()
            await asyncio.sleep(0.05)
    r, d = p50_p95(relayed), p50_p95(direct)
    return {"relayed_ms": r, "direct_ms": d, "ratio_p50": round(r["p50"] / d["p50"], 2)}


async def _carried(r_api: aiohttp.ClientSession, r_url: str) -> int:
    async with r_api.get(r_url + "/v1/status") as resp:
        return (await resp.json())["mesh"]["circuits"]["relay"]["bytes"]


async def transfer(http, r_api, r_url: str, r_pid: int, r_port: int, megabytes: int) -> dict:
    peer, did = await _reserving_peer(http, r_port, 1)
    a, b = await _circuit(http, r_port, peer, did)
    chunk = os.urandom(CHUNK)
    total = megabytes * MIB

    async def receive() -> int:
        got = 0
        while got < total:
            msg = await b.receive()
            if msg.type != aiohttp.WSMsgType.BINARY:
                break
            got += len(msg.data)
        return got

    carried0 = await _carried(r_api, r_url)
    cpu0, own0, wall0 = _cpu_seconds(r_pid), time.process_time(), time.perf_counter()
    reader = asyncio.ensure_future(receive())
    for _ in range(total // CHUNK):
        await a.send_bytes(chunk)
    got = await reader
    cpu1, own1, wall1 = _cpu_seconds(r_pid), time.process_time(), time.perf_counter()
    carried = await _carried(r_api, r_url) - carried0
    await a.close()
    await b.close()
    await peer.close()
    mib = got / MIB
    relay_ms = (cpu1 - cpu0) * 1000 / mib
    ends_ms = (own1 - own0) * 1000 / mib
    return {"mib": round(mib, 1), "relay_cpu_ms_per_mib": round(relay_ms, 2),
            "relay_counted_bytes_per_mib": round(carried / mib), "ends_cpu_ms_per_mib": round(ends_ms, 2),
            "relay_to_ends_cpu": round(relay_ms / ends_ms, 2) if ends_ms else None,
            "throughput_mib_s": round(mib / (wall1 - wall0), 1)}


async def memory(http, r_pid: int, r_port: int, count: int, settle: float) -> dict:
    idents = [Identity((1000 + i).to_bytes(4, "big") * 8) for i in range(count)]
    await asyncio.sleep(settle)
    rss0 = rss_kib(r_pid)
    peers = []
    for ident in idents:
        ps = await authenticate(http, r_port, ident, versions=HANDSHAKE_VERSIONS)
        if not isinstance(ps, PeerSocket):
            raise RuntimeError(f"relay refused a peer: {ps}")
        peers.append(ps)
    await asyncio.sleep(settle)
    rss1 = rss_kib(r_pid)
    for ps in peers:
        await ps.send_json({"type": "nat", "op": "reserve", "id": 1})
    for ps in peers:
        if not (await _nat(ps, "reserved")).get("ok"):
            raise RuntimeError("reservation refused")
    await asyncio.sleep(settle)
    rss2 = rss_kib(r_pid)
    circuits = [await _circuit(http, r_port, ps, ident.did) for ps, ident in zip(peers, idents)]
    await asyncio.sleep(settle)
    rss3 = rss_kib(r_pid)
    for a, b in circuits:
        await a.close()
        await b.close()
    for ps in peers:
        await ps.close()
    return {"count": count, "rss_idle_kib": rss0, "kib_per_session": round((rss1 - rss0) / count, 1),
            "kib_per_reservation": round((rss2 - rss1) / count, 2), "kib_per_circuit": round((rss3 - rss2) / count, 1)}


async def run(args: argparse.Namespace) -> dict:
    cap = max(256, 2 * args.count + 8)
    disc = _free_udp_port()
    with tempfile.TemporaryDirectory(prefix="hmpnode-circuit-") as tmp:
        r_dir, n_dir = Path(tmp) / "r", Path(tmp) / "n"
        r_proc = start_node(r_dir, _env(disc, cap, HMPNODE_NODE_ROLES="circuit", HMPNODE_PEER_TARGET_PEERS="0",
                                        HMPNODE_PEER_CIRCUIT_RESERVATIONS=str(cap),
                                        HMPNODE_PEER_CIRCUIT_RESERVATIONS_PER_IP=str(cap),
                                        HMPNODE_PEER_CIRCUIT_MAX=str(cap)))
        n_proc = start_node(n_dir, _env(disc, cap, HMPNODE_PEER_CIRCUIT_RESERVE="always"))
        try:
            async with node_session(r_dir, r_proc) as (r_url, r_api), node_session(n_dir, n_proc) as (n_url, n_api):
                r_info = json.loads((r_dir / "node.json").read_text())
                n_info = json.loads((n_dir / "node.json").read_text())
                deadline = time.monotonic() + 60
                while True:
                    async with n_api.get(n_url + "/v1/status") as resp:
                        if (await resp.json())["mesh"]["circuits"]["relayed_addresses"]:
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError("N did not reserve on R")
                    await asyncio.sleep(0.2)
                r_port, n_port = r_info["peer"]["port"], n_info["peer"]["port"]
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                    return {"first_dial": await first_dials(http, r_port, n_port, n_info["did"], args.dials),
                            "transfer": await transfer(http, r_api, r_url, r_proc.pid, r_port, args.megabytes),
                            "memory": await memory(http, r_proc.pid, r_port, args.count, args.settle)}
        finally:
            stop_node(n_proc)
            stop_node(r_proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dials", type=positive_int, default=20, help="first dials of each kind (20)")
    parser.add_argument("--megabytes", type=positive_int, default=64, help="MiB carried through one circuit (64)")
    parser.add_argument("--count", type=positive_int, default=100, help="reservations and circuits (100)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before each RSS reading (2)")
    args = parser.parse_args()
    return report(asyncio.run(run(args)))


if __name__ == "__main__":
    sys.exit(main())
