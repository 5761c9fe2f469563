"""What peers cost a node in memory (issue 11: "200 idle authenticated peers cost at
most 40 MB over an idle node; one hostile connection can make the node hold at most
2 MB on its behalf").

One `hmpnode run` on loopback (LAN discovery and DHT off; peer.max_peers and the
loopback/address/subnet/DID-churn caps raised to admit `--peers` loopback peers;
peer.min_difficulty as shipped: 3 hex digits cost a fresh identity milliseconds). Two modes:

- `idle` (default): VmRSS of the idle node, then `--peers` made-up peers with fresh
  identities pass today's handshake (tests.peerclient.authenticate) and stay idle
  (their frames are read and dropped); after `--settle` seconds, VmRSS again: the
  total over idle and the MB per idle peer.
- `hostile`: one made-up peer makes the node remember as much as it can on its
  behalf: rounds of `container_index` offers of made-up DIDs (as many as
  peer.max_requested lets it have outstanding), each round closed by an empty
  `container_response` (nothing is coming: the node stops waiting and has room
  again), with every MCE message a fresh one (the replay memory). VmRSS before it
  connects, after its last round while still connected, and after it leaves.

Prints the figures; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _benchlib import positive_int, report, rss_kib, start_node, stop_node, wait_ready  # noqa: E402

from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.net.mce import build_mce, index_entry  # noqa: E402
from tests.peerclient import authenticate  # noqa: E402



async def status(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/v1/status") as resp:
        return await resp.json()


async def drain(ws: aiohttp.ClientWebSocketResponse, errors: list[str] | None = None) -> None:
    """Read and drop what the node sends (an idle peer that does not answer); the
    reasons of its error frames go to `errors`."""
    with contextlib.suppress(Exception):
        async for msg in ws:
            if errors is not None and msg.type == aiohttp.WSMsgType.TEXT and '"error"' in msg.data[:40]:
                value = orjson.loads(msg.data)
                errors.append(f"{value.get('reason')}: {value.get('detail', '')[:80]}")


async def idle_mode(args, port: int, pid: int) -> dict:
    idle = rss_kib(pid)
    sockets, readers = [], []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        refused: dict[str, int] = {}
        for _ in range(args.peers):
            ws = await authenticate(http, port, Identity.generate())
            if isinstance(ws, (int, str)) or not hasattr(ws, "send_str"):
                refused[str(ws)] = refused.get(str(ws), 0) + 1
                continue
            sockets.append(ws)
            readers.append(asyncio.ensure_future(drain(ws)))
        await asyncio.sleep(args.settle)
        open_ = sum(1 for ws in sockets if not ws.closed)
        after = rss_kib(pid)
        for ws in sockets:
            with contextlib.suppress(Exception):
                await ws.close()
        for task in readers:
            task.cancel()
    growth = after - idle
    return {"mode": "idle", "peers": args.peers, "connected": open_, "refused": refused,
            "idle_rss_mb": round(idle / 1024, 1), "after_rss_mb": round(after / 1024, 1),
            "growth_mb": round(growth / 1024, 1), "mb_per_peer": round(growth / 1024 / max(1, open_), 3)}


async def hostile_mode(args, port: int, pid: int, node_did: str, url: str, token: str) -> dict:
    idle = rss_kib(pid)
    me = Identity.generate()
    now = datetime.now(timezone.utc).replace(microsecond=0)
    entry = index_entry(build_container(me, "note", {"text": "x"}, now=now)["hmp_container"])
    sent_messages = 0

    async with aiohttp.ClientSession() as http:
        ws = await authenticate(http, port, me)
        assert hasattr(ws, "send_str"), ws
        errors: list[str] = []
        reader = asyncio.ensure_future(drain(ws, errors))

        async def send_mce(class_: str, payload: dict) -> None:
            nonlocal sent_messages
            message = build_mce(me, class_, payload, peer_did=node_did,
                                now=datetime.now(timezone.utc).replace(microsecond=0))
            if ws.closed:
                raise RuntimeError(f"the node closed the connection: {errors}")
            await ws.send_str(orjson.dumps({"type": "mce", "container": message}).decode())
            sent_messages += 1
            await asyncio.sleep(1 / 150)  # under peer.frames_per_second (200)

        offered = 0
        for round_ in range(args.rounds):
            for i in range(0, args.per_round, args.per_frame):
                dids = [f"did:hmp:container:{round_:04x}{j:08x}" + "f" * 52
                        for j in range(i, min(i + args.per_frame, args.per_round))]
                await send_mce("container_index", {d: entry for d in dids})
                offered += len(dids)
            await send_mce("container_response", {"available": [], "n": sent_messages})
        for _ in range(args.messages):  # fresh MCE messages (their DIDs differ): the replay memory
            await send_mce("container_response", {"available": [], "n": sent_messages})
        await asyncio.sleep(args.settle)
        connected = rss_kib(pid)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as api:
            st = await status(api, url)
        still_open = not ws.closed
        await ws.close()
        reader.cancel()
    await asyncio.sleep(args.settle)
    left = rss_kib(pid)
    mesh = st.get("mesh") or {}
    counters = mesh.get("counters") or {}
    return {"mode": "hostile", "offered": offered, "messages": sent_messages, "still_open": still_open, "errors": errors,
            "offers_refused": counters.get("offers_refused", 0),
            "idle_rss_mb": round(idle / 1024, 1), "connected_rss_mb": round(connected / 1024, 1),
            "growth_mb": round((connected - idle) / 1024, 1), "after_leaving_mb": round((left - idle) / 1024, 1),
            "ledger": mesh.get("ledger")}


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="hmpnode-peermem-") as tmp:
        data_dir = Path(tmp) / "node"
        cap = str(max(256, args.peers + 8))
        env = {k: v for k, v in os.environ.items() if not k.startswith("HMPNODE_")}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        env.update({"HMPNODE_PEER_HOST": "127.0.0.1", "HMPNODE_PEER_DISCOVERY_INTERFACES": "127.0.0.1",
                    "HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false",
                    "HMPNODE_PEER_MAX_PEERS": cap, "HMPNODE_PEER_MAX_LOOPBACK_PEERS": cap,
                    "HMPNODE_PEER_MAX_PER_ADDRESS": cap, "HMPNODE_PEER_MAX_PER_SUBNET": cap,
                    "HMPNODE_PEER_MAX_DIDS_PER_ADDRESS": str(10 * int(cap)),
                    "HMPNODE_NODE_IDLE_CONNECTION_SECONDS": "3600"})
        proc = start_node(data_dir, env)
        try:
            info = await wait_ready(data_dir, proc, time.monotonic() + 60)
            await asyncio.sleep(args.settle)
            port = info["peer"]["port"]
            if args.mode == "idle":
                return await idle_mode(args, port, proc.pid)
            token = (data_dir / "api.token").read_text().strip()
            return await hostile_mode(args, port, proc.pid, info["did"], info["api"]["url"].rstrip("/"), token)
        finally:
            stop_node(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("idle", "hostile"), default="idle")
    parser.add_argument("--peers", type=positive_int, default=200, help="idle mode: made-up peers (200)")
    parser.add_argument("--settle", type=positive_int, default=5, help="seconds to wait before reading RSS (5)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="hostile: offer rounds (5)")
    parser.add_argument("--per-round", type=positive_int, default=20_000,
                        help="hostile: made-up DIDs offered per round (20000 = peer.max_requested)")
    parser.add_argument("--per-frame", type=positive_int, default=500, help="hostile: DIDs per index (500)")
    parser.add_argument("--messages", type=positive_int, default=2000, help="hostile: extra small MCE messages (2000)")
    args = parser.parse_args()
    return report(asyncio.run(run(args)))


if __name__ == "__main__":
    sys.exit(main())
