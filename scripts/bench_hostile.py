"""Hostile-network benchmark (issue 10, lines 1-4): attacks against real `hmpnode run`
processes, each on a fresh node, with the node's memory and API latency measured.

    ./scripts/bench_hostile [--attacks 1a,1b,2,2b,3,4] [--full] [sizes ...]

1a  one authenticated peer sends ONE `containers` frame of N broadcast zstd
    containers (each ~15 MB once decompressed, each under the 16 MiB limit); a
    second node connected to the target shows what forwarding costs it.
1b  the agent API imports N such containers in one POST /v1/containers/import.
2   an authenticated peer streams MCE `container_index` messages whose zstd
    payload opens to ~15.8 MB, while /v1/health is timed.
2b  an authenticated peer offers made-up containers without pause: `container_index`
    messages whose zstd payload opens to just under the MCE limit (peer.max_frame_bytes,
    4 MiB: 4 800 DIDs each), each followed by an empty `container_response` (nothing
    is coming: the node has room to ask again), at most --offers-ahead of them not
    answered yet. /v1/health p50/p99 and the node's loop-lag gauge, sampled from
    /v1/status, during the attack against the same probes in a quiet window before it
    (same run, same node; --load-processes CPU burners in both when asked).
3   from ONE address, S sessions with fresh throwaway DIDs (each costs only the
    announce's proof of work); then an honest newcomer from ANOTHER address
    connects. Namespaces (tests/netns.py) give the two their own addresses; the
    node's /v1/peers says which address holds which session.
4   a LAN neighbour (its own namespace) broadcasts discovery announces naming an
    off-subnet host (192.0.2.2, a TEST-NET address in a namespace behind the
    neighbour, which routes to it) and a host name that resolves to it inside the
    node's namespace; listeners there count the connections the node makes
    (protocol.md 20.6: never). An announce naming the neighbour itself shows the
    node does take announces. Then M announces with distinct DIDs, from many
    source addresses of the neighbour within the LAN rate limits: peers table size.

Every attack: RSS growth of the node (peak from sampling and the kernel's VmHWM,
reset before the attack), /v1/health latency during it (probes one after another
from a thread of their own), and the node's refusal counters. A node over
--rss-ceiling-mb is killed and its attack marked "exceeded" (the machine is
shared). The last line is one JSON object with the targets and pass/fail.

Needs root for 3 and 4 (network namespaces); without it they are skipped
(3 can run from loopback addresses instead: --slots-from loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from _benchlib import positive_int
from _hostilelib import (
    MB,
    ConnectionCounter,
    HealthProbe,
    LoopLagSampler,
    LoopThread,
    Peer,
    Refused,
    RssWatch,
    Tally,
    announce_datagram,
    authenticate,
    bomb_containers,
    index_bombs,
    kill_group,
    offer_messages,
    utc_now,
)

from hmpnode.client import ApiError, Client, ClientError
from hmpnode.identity import Identity
from hmpnode.net.mce import build_mce
from tests.nodeproc import NodeProcess, node_env

TARGETS = {
    "1a_rss_growth_mb": ("<", 300),
    "1b_rss_growth_mb": ("<", 300),
    "2_health_p99_ms": ("<", 200),
    "2b_health_p99_ms": ("<=", 20),
    "3_slots_one_address": ("<=", 8),
    "3_honest_connects": ("==", True),
    "4_off_rule_dials": ("==", 0),
    "4_peers_table_bounded": ("==", True),
}

FULL = {"frame_containers": 150, "import_containers": 400, "index_seconds": 30, "offer_seconds": 30, "sybils": 63,
        "announces": 3000}
DEFAULT = {"frame_containers": 150, "import_containers": 150, "index_seconds": 10, "offer_seconds": 10, "sybils": 63,
           "announces": 3000}


def log(msg: str) -> None:
    print(msg, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.base = Path(tempfile.mkdtemp(prefix="hmpnode-hostile-"))
        self.procs: list[NodeProcess] = []
        self.rss = RssWatch(args.rss_ceiling_mb * 1024)
        self.log_problems: dict[str, dict[str, Any]] = {}

    def start_node(self, name: str, env: dict[str, str], prefix: list[str] | None = None) -> NodeProcess:
        if self.args.node_code:
            env = dict(env, PYTHONPATH=str(self.args.node_code))
        proc = NodeProcess(self.base / name, env=env, prefix=prefix or ())
        self.procs.append(proc)
        proc.start()
        proc.info = proc.wait_ready(timeout=60)
        self.rss.watch(name, proc.pid, lambda pid=proc.pid: kill_group(pid))
        return proc

    def stop_node(self, name: str, proc: NodeProcess) -> None:
        self.rss.unwatch(name)
        proc.cleanup()
        self.check_log(name, proc)

    def check_log(self, name: str, proc: NodeProcess) -> None:
        """Tracebacks, errors and unhandled frames in a node's log: a well-formed attack
        refused as malformed (a bug) is not a defence."""
        if name in self.log_problems:
            return
        lines = [line for line in proc.log().splitlines()
                 if "Traceback" in line or " ERROR " in line or "not handled" in line]
        if lines:
            self.log_problems[name] = {"lines": len(lines), "first": lines[0][:300]}

    def loopback_env(self, **extra: str) -> dict[str, str]:
        return node_env(HMPNODE_PEER_DISCOVERY_INTERVAL_MS="500",
                        HMPNODE_PEER_DISCOVERY_PORT=str(43000 + os.getpid() % 15000), **extra)

    def close(self) -> None:
        for proc in self.procs:
            proc.cleanup()
        self.rss.close()
        if not self.args.keep:
            shutil.rmtree(self.base, ignore_errors=True)


async def _status(client: Client, timeout: float = 10.0) -> dict[str, Any] | None:
    """/v1/status, or None when the node does not answer in time (or is gone)."""
    try:
        return await asyncio.wait_for(client.status(), timeout)
    except (asyncio.TimeoutError, ClientError, aiohttp.ClientError, OSError):
        return None


def _ingested(status: dict[str, Any] | None) -> dict[str, int]:
    ingest = (status or {}).get("ingest", {})
    return {k[len("ingest_"):]: v for k, v in ingest.items() if k.startswith("ingest_")}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _refused(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int]:
    """Refusal counters (Node.refuse) and mesh counters that moved during the attack."""
    out: dict[str, int] = {}
    if after is None:
        return out
    b = before or {}
    for key, value in after.get("refused", {}).items():
        if value - b.get("refused", {}).get(key, 0):
            out[key] = value - b.get("refused", {}).get(key, 0)
    bm = (b.get("mesh") or {}).get("counters", {})
    for key, value in ((after.get("mesh") or {}).get("counters", {})).items():
        if value - bm.get(key, 0) and (key.startswith(("refused", "strike", "banned", "budget", "evict"))):
            out[f"mesh:{key}"] = value - bm.get(key, 0)
    return out


def _store_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.glob("*.db*") if p.is_file()) + \
        sum(p.stat().st_size for p in data_dir.glob("*.sqlite*") if p.is_file())


# -- line 1a: one containers frame of decompression bombs ---------------------------------------


async def attack_frame(bench: Bench) -> dict[str, Any]:
    a = bench.args
    env = bench.loopback_env()
    target = bench.start_node("1a-target", env)
    neighbour = bench.start_node("1a-neighbour", env)
    tc, nc = Client.from_data_dir(target.data_dir), Client.from_data_dir(neighbour.data_dir)
    probe = HealthProbe(target.data_dir)
    out: dict[str, Any] = {"containers": a.frame_containers, "decompressed_mb_each": a.bomb_mb}
    try:
        ndid = (await nc.status())["did"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(p["did"] == ndid and p["connected"] for p in (await tc.peers())["peers"]):
                break
            await asyncio.sleep(0.2)
        else:
            out["note"] = "the neighbour never connected: forwarding not measured"
        t = time.monotonic()
        bombs = bomb_containers(Identity.generate(), a.frame_containers, int(a.bomb_mb * 1e6))
        frame = orjson.dumps({"type": "containers", "items": bombs})
        out["frame_kb"] = round(len(frame) / 1024, 1)
        out["build_s"] = round(time.monotonic() - t, 2)
        del bombs
        before_t, before_n = await _status(tc), await _status(nc)
        async with aiohttp.ClientSession() as http:
            peer = await authenticate(http, "127.0.0.1", target.info["peer"]["port"], Identity.generate())
            if isinstance(peer, Refused):
                out["attacker_refused"] = peer.kind
                return out
            bench.rss.reset("1a-target")
            bench.rss.reset("1a-neighbour")
            t0 = probe.mark()
            sent = await peer.send(frame)
            replies: list[tuple[str, Any]] = []
            answered_at = None
            deadline = t0 + a.settle
            caught_up = False
            while time.monotonic() < deadline and not bench.rss.exceeded("1a-target"):
                replies += await peer.drain(0.5)
                if answered_at is None and (peer.closed or any(k in ("container_ack", "error") for k, _ in replies)):
                    answered_at = time.monotonic()
                if answered_at is not None:
                    st_t, st_n = await _status(tc, 5), await _status(nc, 5)
                    stored_t = _delta(_ingested(st_t), _ingested(before_t)).get("stored", 0)
                    stored_n = _delta(_ingested(st_n), _ingested(before_n)).get("stored", 0)
                    if bench.rss.exceeded("1a-neighbour") or stored_n >= stored_t:
                        caught_up = True
                    if caught_up and time.monotonic() - answered_at > 2:
                        break
            t1 = time.monotonic()
            out["frame_sent"] = sent
            out["answer_s"] = round(answered_at - t0, 2) if answered_at else None
            acks = [v for k, v in replies if k == "container_ack"]
            out["acked"] = sum(len(v.get("acknowledged", [])) for v in acks)
            out["rejected_reasons"] = sorted({r.get("reason") for v in acks for r in v.get("rejected", [])
                                              if isinstance(r, dict)})
            out["error_frames"] = [v for k, v in replies if k == "error"][:5]
            await peer.close()
        after_t, after_n = await _status(tc), await _status(nc)
        out["stored_at_target"] = _delta(_ingested(after_t), _ingested(before_t)).get("stored")
        out["stored_at_neighbour"] = _delta(_ingested(after_n), _ingested(before_n)).get("stored")
        out["target"] = bench.rss.report("1a-target")
        out["neighbour"] = bench.rss.report("1a-neighbour")
        out["seconds"] = round(t1 - t0, 1)
        out["health"] = probe.window(t0, t1)
        out["refused"] = _refused(before_t, after_t)
        return out
    finally:
        probe.close()
        await tc.close()
        await nc.close()
        bench.stop_node("1a-target", target)
        bench.stop_node("1a-neighbour", neighbour)


# -- line 1b: an agent-API import of decompression bombs ---------------------------------------


async def attack_import(bench: Bench) -> dict[str, Any]:
    a = bench.args
    target = bench.start_node("1b-target", bench.loopback_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false"))
    probe = HealthProbe(target.data_dir)
    client = Client.from_data_dir(target.data_dir, timeout=a.settle + 60)
    out: dict[str, Any] = {"containers": a.import_containers, "decompressed_mb_each": a.bomb_mb}
    try:
        bombs = bomb_containers(Identity.generate(), a.import_containers, int(a.bomb_mb * 1e6))
        body = orjson.dumps({"containers": bombs})
        out["body_kb"] = round(len(body) / 1024, 1)
        del bombs
        before = await _status(client)
        store0 = _store_bytes(target.data_dir)
        bench.rss.reset("1b-target")
        t0 = probe.mark()
        task = asyncio.ensure_future(client.request("POST", "/v1/containers/import", raw_body=body))
        while not task.done() and not bench.rss.exceeded("1b-target") and time.monotonic() - t0 < a.settle + 60:
            await asyncio.wait({task}, timeout=0.5)
        t1 = time.monotonic()
        if task.done() and not task.cancelled() and task.exception() is None:
            answer = task.result()
            out["answer"] = {k: answer.get(k) for k in ("stored", "duplicate", "conflict", "rejected")}
            reasons = sorted({r.get("reason") for r in answer.get("results", []) if r.get("reason")})
            out["rejected_reasons"] = reasons
        elif task.done() and not task.cancelled() and not bench.rss.exceeded("1b-target"):
            exc = task.exception()
            out["answer"] = f"{exc.status} {exc.reason}" if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}"
        else:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            out["answer"] = "no answer (node killed at the RSS ceiling)" if bench.rss.exceeded("1b-target") \
                else "no answer in time"
        out["seconds"] = round(t1 - t0, 1)
        out["target"] = bench.rss.report("1b-target")
        out["store_growth_mb"] = round((_store_bytes(target.data_dir) - store0) / MB, 1)
        out["health"] = probe.window(t0, t1)
        out["refused"] = _refused(before, await _status(client))
        return out
    finally:
        probe.close()
        await client.close()
        bench.stop_node("1b-target", target)


# -- line 2: a stream of zstd container_index messages ----------------------------------------


async def attack_index(bench: Bench) -> dict[str, Any]:
    a = bench.args
    target = bench.start_node("2-target", bench.loopback_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false"))
    probe = HealthProbe(target.data_dir)
    client = Client.from_data_dir(target.data_dir)
    count = max(1, round(a.index_rate * a.index_seconds))
    out: dict[str, Any] = {"rate_per_s": a.index_rate, "seconds": a.index_seconds,
                           "decompressed_mb_each": a.index_mb}
    tally = Tally()
    try:
        node_did = (await client.status())["did"]
        ident = Identity.generate()
        t = time.monotonic()
        msgs = index_bombs(ident, node_did, count, int(a.index_mb * 1e6))
        out["message_kb"] = round(len(orjson.dumps(msgs[0])) / 1024, 1)
        out["build_s"] = round(time.monotonic() - t, 2)
        await asyncio.sleep(2.0)
        quiet = probe.window(probe.mark() - 2.0)
        out["health_quiet"] = {k: quiet.get(k) for k in ("p50_ms", "p99_ms")}
        before = await _status(client)
        replies: list[tuple[str, Any]] = []
        sent = reconnects = 0
        async with aiohttp.ClientSession() as http:
            peer = await authenticate(http, "127.0.0.1", target.info["peer"]["port"], ident)
            tally.add(peer)
            bench.rss.reset("2-target")
            t0 = probe.mark()
            pending = list(msgs)
            for i in range(count):
                due = t0 + i / a.index_rate
                while time.monotonic() < due:
                    if isinstance(peer, Peer):
                        replies += await peer.drain(min(0.2, max(0.0, due - time.monotonic())))
                    else:
                        await asyncio.sleep(max(0.0, due - time.monotonic()))
                if isinstance(peer, Refused) or peer.closed:
                    # cut off (or refused): come back as a fresh DID, as an attacker would;
                    # its messages are built one at a time as they are due (signed for that DID)
                    reconnects += 1
                    ident, pending = Identity.generate(), []
                    peer = await authenticate(http, "127.0.0.1", target.info["peer"]["port"], ident)
                    tally.add(peer)
                    if isinstance(peer, Refused):
                        continue
                if not pending:
                    pending = await asyncio.to_thread(index_bombs, ident, node_did, 1, int(a.index_mb * 1e6), first=i)
                if await peer.send({"type": "mce", "container": pending.pop(0)}):
                    sent += 1
            t1 = time.monotonic()
            if isinstance(peer, Peer):
                replies += await peer.drain(0.5)
                await peer.close()
        out.update({"messages_sent": sent, "reconnects": reconnects, "connections": tally.counts,
                    "error_frames": dict(sorted({r: sum(1 for k, v in replies if k == "error" and v == r)
                                                 for k, r in replies if k == "error"}.items()))})
        out["health"] = probe.window(t0, t1)
        out["target"] = bench.rss.report("2-target")
        out["refused"] = _refused(before, await _status(client))
        return out
    finally:
        probe.close()
        await client.close()
        bench.stop_node("2-target", target)


# -- line 2b: a stream of offers of made-up containers, each just under the MCE limit ------------


def _burners(count: int) -> list[Any]:
    """`count` processes that spin on a core each (a loaded machine); kill_group them."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(count)]


async def attack_offers(bench: Bench) -> dict[str, Any]:
    a = bench.args
    target = bench.start_node("2b-target", bench.loopback_env(HMPNODE_PEER_LAN_DISCOVERY="false",
                                                              HMPNODE_PEER_DHT="false"))
    probe = HealthProbe(target.data_dir)
    client = Client.from_data_dir(target.data_dir)
    lag = LoopLagSampler(client)
    burners = _burners(a.load_processes)
    out: dict[str, Any] = {"seconds": a.offer_seconds, "dids_each": a.offer_dids, "load_processes": a.load_processes,
                           "payload_bytes_each": a.offer_payload_bytes}
    try:
        node_did, ident = target.info["did"], Identity.generate()
        t = time.monotonic()
        prebuilt = max(1, round(10 * a.offer_seconds))  # ~10/s: more than the node takes (8-9/s on 2 cores)
        frames = await asyncio.to_thread(offer_messages, ident, node_did, prebuilt, dids=a.offer_dids,
                                         payload_bytes=a.offer_payload_bytes)
        out.update(message_kb=round(len(frames[0]) / 1024, 1), build_s=round(time.monotonic() - t, 1))
        await asyncio.sleep(1.0)
        q0 = probe.mark()
        await asyncio.sleep(a.quiet_seconds)
        q1 = probe.mark()
        out["quiet"] = {"health": probe.window(q0, q1), "loop_lag": lag.window(q0, q1)}
        before = await _status(client)
        asked, errors = 0, Counter()
        async with aiohttp.ClientSession() as http:
            peer = await authenticate(http, "127.0.0.1", target.info["peer"]["port"], ident)
            if isinstance(peer, Refused):
                out["error"] = f"refused: {peer.kind} {peer.detail}"
                return out

            async def read() -> None:
                nonlocal asked
                while not peer.closed:
                    for kind, value in await peer.drain(0.2):
                        if kind == "container_request":
                            asked += len(value.get("request_container", []))
                        elif kind == "error":
                            errors[str(value)] += 1

            reader = asyncio.ensure_future(read())

            def answered() -> int:  # offers the node asked for in full (or refused)
                return asked // a.offer_dids + sum(errors.values())

            sent = stalls = 0
            t0 = probe.mark()
            end = t0 + a.offer_seconds
            while time.monotonic() < end and not peer.closed:
                waited = time.monotonic()
                while sent - answered() >= a.offers_ahead and time.monotonic() < min(end, waited + 5.0):
                    await asyncio.sleep(0.005)
                if time.monotonic() >= end:
                    break
                stalls += sent - answered() >= a.offers_ahead  # no answer in 5 s: sent anyway
                frame = frames[sent] if sent < len(frames) else (await asyncio.to_thread(
                    offer_messages, ident, node_did, 1, dids=a.offer_dids, payload_bytes=a.offer_payload_bytes,
                    first=sent))[0]
                nothing = build_mce(ident, "container_response", {"available": [], "n": sent}, peer_did=node_did,
                                    now=utc_now())
                if not (await peer.send(frame) and await peer.send({"type": "mce", "container": nothing})):
                    break
                sent += 1
            t1 = time.monotonic()
            out["loadavg_1min"] = round(os.getloadavg()[0], 2)  # the machine's, other work included
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            out.update(offers_sent=sent, offers_answered=answered(), stalls=stalls, closed=peer.closed,
                       offers_per_s=round(answered() / (t1 - t0), 1), errors=dict(errors))
            await peer.close()
        out["attack"] = {"health": probe.window(t0, t1), "loop_lag": lag.window(t0, t1)}
        out["health"] = out["attack"]["health"]
        qp99, ap99 = out["quiet"]["health"].get("p99_ms"), out["health"].get("p99_ms")
        out["health_p99_ratio"] = round(ap99 / qp99, 2) if qp99 and ap99 else None
        out["target"] = bench.rss.report("2b-target")
        out["refused"] = _refused(before, await _status(client))
        return out
    finally:
        for proc in burners:
            kill_group(proc.pid)
            proc.wait(5)
        await lag.close()
        probe.close()
        await client.close()
        bench.stop_node("2b-target", target)


# -- line 3: one address takes the peer slots ------------------------------------------------


async def _open_sybils(host: str, port: int, count: int, addr: str, local: str | None) -> dict[str, Any]:
    """In the attacker's namespace: `count` sessions, each with a fresh DID; held open."""
    connector = aiohttp.TCPConnector(limit=0, local_addr=(local, 0) if local else None)
    http = aiohttp.ClientSession(connector=connector)
    tally, peers = Tally(), []
    t0 = time.monotonic()
    refused_in_a_row = 0
    for _ in range(count):
        # a busy answer (503: handshakes in progress) is retried twice, as an attacker
        # would; after 8 refusals in a row the node clearly refuses this address: no retries
        for attempt in range(3):
            outcome = await authenticate(http, host, port, Identity.generate(), addresses=[addr])
            tally.add(outcome)
            if isinstance(outcome, Peer):
                peers.append(outcome)
                refused_in_a_row = 0
                break
            refused_in_a_row += 1
            if outcome.kind != "http_503" or refused_in_a_row >= 8:
                break
            await asyncio.sleep(0.2)
    elapsed = time.monotonic() - t0
    keep = asyncio.get_running_loop()

    async def hold(p: Peer) -> None:  # read (answers pings) until closed
        while not p.closed:
            await p.drain(5)

    holders = [keep.create_task(hold(p)) for p in peers]
    _SYBILS[id(keep)] = (http, peers, holders)
    return {"outcomes": tally.counts, "seconds": round(elapsed, 2)}


_SYBILS: dict[int, Any] = {}


async def _sybils_open() -> int:
    http, peers, _ = _SYBILS[id(asyncio.get_running_loop())]
    return sum(1 for p in peers if not p.closed)


async def _sybils_close() -> None:
    http, peers, holders = _SYBILS.pop(id(asyncio.get_running_loop()))
    for h in holders:
        h.cancel()
    for p in peers:
        await p.close()
    await http.close()


async def _honest(host: str, port: int, addr: str, local: str | None, count: int) -> dict[str, Any]:
    """`count` honest newcomers from another address, one after the other, each kept
    open while the next tries (the issue: "honest newcomers got 503")."""
    connector = aiohttp.TCPConnector(limit=0, local_addr=(local, 0) if local else None)
    async with aiohttp.ClientSession(connector=connector) as http:
        outcomes, peers = [], []
        for _ in range(count):
            outcome = await authenticate(http, host, port, Identity.generate(), addresses=[addr])
            if isinstance(outcome, Peer):
                peers.append(outcome)
                await outcome.drain(0.5)
                outcomes.append("connected" if not outcome.closed else "closed soon after")
            else:
                outcomes.append(outcome.kind)
        for p in peers:
            await p.close()
    return {"connected": all(o == "connected" for o in outcomes), "outcomes": outcomes}


async def _peers_by_ip(data_dir: Path) -> dict[str, Any]:
    async with Client.from_data_dir(data_dir) as client:
        view = await client.peers()
        status = await client.status()
    by_ip: dict[str, int] = {}
    for p in view["peers"]:
        if p.get("connected"):
            by_ip[p.get("ip", "?")] = by_ip.get(p.get("ip", "?"), 0) + 1
    return {"by_ip": by_ip, "rows": len(view["peers"]), "connected": sum(by_ip.values()), "status": status}


async def attack_slots(bench: Bench) -> dict[str, Any]:
    a = bench.args
    out: dict[str, Any] = {"sybils": a.sybils, "honest_newcomers": a.honest, "max_peers": a.max_peers,
                           "from": a.slots_from}
    lab = None
    threads: list[LoopThread] = []
    probe = None
    try:
        extra = {"HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_MAX_PEERS": str(a.max_peers)}
        if a.slots_from == "netns":
            from tests.netns import NetLab

            lab = NetLab()
            n, s, h = lab.namespace("node"), lab.namespace("sybil"), lab.namespace("honest")
            lab.link(n, "10.89.1.1/24", s, "10.89.1.2/24")
            lab.link(n, "10.89.2.1/24", h, "10.89.2.2/24")
            env = node_env(HMPNODE_PEER_HOST="0.0.0.0", HMPNODE_PEER_DISCOVERY_INTERFACES="",
                           HMPNODE_PEER_DISCOVERY_PORT="47470", **extra)
            node = bench.start_node("3-target", env, prefix=["ip", "netns", "exec", n.name])
            tn, ts, th = LoopThread(n.name, "node"), LoopThread(s.name, "sybil"), LoopThread(h.name, "honest")
            threads += [tn, ts, th]
            host, sybil_ip, honest_ip, local_s, local_h = "10.89.1.1", "10.89.1.2", "10.89.2.2", None, None
            honest_host = "10.89.2.1"
            probe = HealthProbe(node.data_dir, netns=n.name)
        else:
            node = bench.start_node("3-target", bench.loopback_env(HMPNODE_PEER_LAN_DISCOVERY="false", **extra))
            tn = ts = th = LoopThread(None, "loopback")
            threads.append(tn)
            host = honest_host = "127.0.0.1"
            sybil_ip, honest_ip = local_s, local_h = "127.0.0.2", "127.0.0.3"
            probe = HealthProbe(node.data_dir)
        port = node.info["peer"]["port"]
        before = tn.call(_peers_by_ip, node.data_dir)["status"]
        t0 = probe.mark()
        out["attacker"] = ts.call(_open_sybils, host, port, a.sybils, f"tcp://{sybil_ip}:9", local_s)
        await asyncio.sleep(2.0)  # what the node does with them once they are in (eviction, ...)
        view = tn.call(_peers_by_ip, node.data_dir)
        out["attacker_slots"] = view["by_ip"].get(sybil_ip, 0)
        out["attacker_sessions_open"] = ts.call(_sybils_open)
        out["connected_before_honest"] = view["connected"]
        out["honest"] = th.call(_honest, honest_host, port, f"tcp://{honest_ip}:9", local_h, a.honest)
        view = tn.call(_peers_by_ip, node.data_dir)
        out["attacker_slots_after_honest"] = view["by_ip"].get(sybil_ip, 0)
        out["peers_table_rows"] = view["rows"]
        out["share"] = round(max(out["attacker_slots"], out["attacker_slots_after_honest"]) / a.max_peers, 3)
        t1 = time.monotonic()
        ts.call(_sybils_close)
        out["health"] = probe.window(t0, t1)
        out["target"] = bench.rss.report("3-target")
        out["refused"] = _refused(before, view["status"])
        bench.stop_node("3-target", node)
        return out
    finally:
        _namespace_teardown(bench, probe, threads, lab)


# -- line 4: dials the announces name; the peers table -----------------------------------------

HOST_NAME = "offsite.hostile.test"


def _send_datagrams(datagrams: list[tuple[str, bytes]], dest: tuple[str, int], rate: float) -> int:
    """From the LAN neighbour's namespace (this thread): each (source address, datagram)
    as a broadcast to the node's subnet, at most `rate` per second in all."""
    socks: dict[str, socket.socket] = {}
    sent = 0
    t0 = time.monotonic()
    try:
        for i, (src, data) in enumerate(datagrams):
            due = t0 + i / rate
            if due > time.monotonic():
                time.sleep(due - time.monotonic())
            sock = socks.get(src)
            if sock is None:
                sock = socks[src] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
                sock.bind((src, 0))
            sock.sendto(data, dest)
            sent += 1
    finally:
        for sock in socks.values():
            sock.close()
    return sent


async def _in_thread(fn, *args):
    return fn(*args)


async def attack_dial(bench: Bench) -> dict[str, Any]:
    from tests.netns import NetLab, _ip

    a = bench.args
    out: dict[str, Any] = {}
    lab = NetLab()
    etc = None
    threads: list[LoopThread] = []
    probe = None
    disc_port = 47471
    try:
        n, lan, off = lab.namespace("node"), lab.namespace("lan"), lab.namespace("offsite")
        _, lan_if = lab.link(n, "10.88.1.1/24", lan, "10.88.1.2/24")
        lab.link(lan, "192.0.2.1/24", off, "192.0.2.2/24", multicast_route=False)
        _ip("-n", n.name, "route", "add", "192.0.2.0/24", "via", "10.88.1.2")
        _ip("-n", off.name, "route", "add", "10.88.1.0/24", "via", "192.0.2.1")
        lab.run(lan, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        sources = [f"10.88.1.{100 + i}" for i in range(a.lan_sources)]
        for src in sources:
            _ip("-n", lan.name, "addr", "add", f"{src}/24", "dev", lan_if)
        # the host name resolves, inside the node's namespace only, to the off-subnet host
        # (`ip netns exec` bind-mounts /etc/netns/<name>/hosts over /etc/hosts)
        etc = Path("/etc/netns") / n.name
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n192.0.2.2 {HOST_NAME}\n")
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # no DNS leaves the namespace

        tl, to = LoopThread(lan.name, "lan"), LoopThread(off.name, "offsite")
        tn = LoopThread(n.name, "node")
        threads += [tl, to, tn]
        off_counter, lan_counter = ConnectionCounter(), ConnectionCounter()
        p_off, p_name, p_lawful = 7401, 7402, 7403
        to.call(off_counter.listen, "off_subnet", "192.0.2.2", p_off)
        to.call(off_counter.listen, "host_name", "192.0.2.2", p_name)
        tl.call(lan_counter.listen, "lawful", "10.88.1.2", p_lawful)

        env = node_env(HMPNODE_PEER_HOST="0.0.0.0", HMPNODE_PEER_DISCOVERY_INTERFACES="",
                       HMPNODE_PEER_DISCOVERY_PORT=str(disc_port), HMPNODE_PEER_DHT="false")
        node = bench.start_node("4-target", env, prefix=["ip", "netns", "exec", n.name])
        probe = HealthProbe(node.data_dir, netns=n.name)
        await asyncio.sleep(1.0)
        before = tn.call(_peers_by_ip, node.data_dir)["status"]
        dest = ("10.88.1.255", disc_port)

        # 4a: K announces naming only off-rule addresses, one naming the neighbour itself
        off_rule = [("10.88.1.2", announce_datagram(Identity.generate(), [f"tcp://192.0.2.2:{p_off}",
                                                                         f"tcp://{HOST_NAME}:{p_name}"]))
                    for _ in range(a.off_rule_announces)]
        lawful = [("10.88.1.2", announce_datagram(Identity.generate(), [f"tcp://10.88.1.2:{p_lawful}"]))]
        t0 = probe.mark()
        tl.call(_in_thread, _send_datagrams, lawful + off_rule, dest, 50.0)
        await asyncio.sleep(a.dial_window)
        t1 = time.monotonic()
        mid = tn.call(_peers_by_ip, node.data_dir)
        counts = dict(off_counter.counts)
        out["off_rule"] = {
            "announces": a.off_rule_announces, "window_s": a.dial_window,
            "dials_off_subnet": counts.get("off_subnet", 0), "dials_host_name": counts.get("host_name", 0),
            "dials_lawful": lan_counter.counts.get("lawful", 0),
            "lan_announces_taken": ((mid["status"].get("mesh") or {}).get("counters", {}).get("lan_announces", 0)
                                    - ((before.get("mesh") or {}).get("counters", {}).get("lan_announces", 0))),
            "health": probe.window(t0, t1),
        }
        out["off_rule_dials"] = counts.get("off_subnet", 0) + counts.get("host_name", 0)

        # 4b: M announces with distinct DIDs, from many source addresses (each under the
        # per-source LAN rate), each naming its own source address (a closed port)
        t = time.monotonic()
        many = []
        for i in range(a.announces):
            src = sources[i % len(sources)]
            many.append((src, announce_datagram(Identity.generate(), [f"tcp://{src}:9"])))
        build_s = time.monotonic() - t
        rows0 = mid["rows"]
        bench.rss.reset("4-target")
        t2 = probe.mark()
        sent = tl.call(_in_thread, _send_datagrams, many, dest, a.announce_rate, timeout=None)
        t3 = time.monotonic()
        await asyncio.sleep(3.0)
        end = tn.call(_peers_by_ip, node.data_dir)
        mc = (end["status"].get("mesh") or {}).get("counters", {})
        mc0 = (mid["status"].get("mesh") or {}).get("counters", {})
        lan = (end["status"].get("mesh") or {}).get("lan") or {}
        out["peers_table"] = {
            "announces": sent, "distinct_dids": a.announces, "sources": len(sources), "build_s": round(build_s, 1),
            "send_s": round(t3 - t2, 1), "rows_before": rows0, "rows_after": end["rows"],
            "known_peers": (end["status"].get("mesh") or {}).get("known_peers"),
            "lan_announces_taken": mc.get("lan_announces", 0) - mc0.get("lan_announces", 0),
            "lan_ignored": {k: v for k, v in (lan.get("ignored") or {}).items() if v} if isinstance(lan, dict) else None,
            "dial_failed": mc.get("dial_failed", 0) - mc0.get("dial_failed", 0),
            "health": probe.window(t2, t3),
            "target": bench.rss.report("4-target"),
        }
        out["refused"] = _refused(before, end["status"])
        bench.stop_node("4-target", node)
        return out
    finally:
        _namespace_teardown(bench, probe, threads, lab)
        if etc is not None:
            shutil.rmtree(etc, ignore_errors=True)


def _namespace_teardown(bench, probe, threads, lab) -> None:
    """The end of an attack run in namespaces (lines 3 and 4): the health probe, the
    attacker's threads, the nodes, then the namespaces."""
    if probe is not None:
        probe.close()
    for t in threads:
        t.close()
    for proc in bench.procs:
        proc.cleanup()
    if lab is not None:
        lab.close()


def _sweep_etc_netns() -> None:
    """/etc/netns/<name> of lab namespaces whose benchmark process is gone (see attack_dial)."""
    import re

    from hmpnode.client import pid_alive
    from tests.netns import PREFIX

    base = Path("/etc/netns")
    for d in base.glob(f"{PREFIX}*") if base.is_dir() else ():
        m = re.match(rf"{PREFIX}(\d+)-", d.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)


# -- targets ----------------------------------------------------------------------------------


def _check(op: str, value: Any, bound: Any) -> bool | None:
    if value is None:
        return None
    return {"<": lambda: value < bound, "<=": lambda: value <= bound, "==": lambda: value == bound}[op]()


def _growth(r: dict[str, Any] | None, who: str = "target") -> float | None:
    """RSS growth; an attack that hit the ceiling counts as at least the ceiling."""
    if not r or who not in r:
        return None
    return r[who]["rss_growth_mb"]


def targets(results: dict[str, Any], peers_cap: int | None) -> dict[str, Any]:
    values: dict[str, Any] = {
        "1a_rss_growth_mb": _growth(results.get("1a")),
        "1b_rss_growth_mb": _growth(results.get("1b")),
        "2_health_p99_ms": (results.get("2") or {}).get("health", {}).get("p99_ms"),
        "2b_health_p99_ms": (results.get("2b") or {}).get("health", {}).get("p99_ms"),
    }
    r3 = results.get("3")
    if r3 and "attacker_slots" in r3:
        values["3_slots_one_address"] = max(r3["attacker_slots"], r3["attacker_slots_after_honest"])
        values["3_honest_connects"] = r3["honest"]["connected"]
    r4 = results.get("4")
    if r4 and "off_rule_dials" in r4:
        values["4_off_rule_dials"] = r4["off_rule_dials"]
        pt = r4.get("peers_table") or {}
        if pt:
            # bounded: the table did not take (nearly) every DID the node accepted, and
            # stays under the cap when one is given
            growth, taken = pt["rows_after"] - pt["rows_before"], pt["lan_announces_taken"]
            bounded = growth < 0.9 * taken if taken >= 100 else None
            if peers_cap and bounded is not None:
                bounded = bounded and pt["rows_after"] <= peers_cap
            values["4_peers_table_bounded"] = bounded
            values["4_peers_table_rows"] = pt["rows_after"]
    out = {}
    for name, (op, bound) in TARGETS.items():
        value = values.get(name)
        out[name] = {"value": value, "target": f"{op} {bound}", "pass": _check(op, value, bound)}
        attack = name.split("_", 1)[0]
        if (results.get(attack) or {}).get("node_log_problems"):
            out[name]["suspect"] = f"the node logged errors: see attacks.{attack}.node_log_problems"
    if "4_peers_table_rows" in values:
        pt = results["4"]["peers_table"]
        out["4_peers_table_bounded"]["rows"] = values["4_peers_table_rows"]
        out["4_peers_table_bounded"]["target"] = (
            f"growth {pt['rows_after'] - pt['rows_before']} < 0.9 x {pt['lan_announces_taken']} DIDs taken"
            + (f" and rows <= {peers_cap}" if peers_cap else ""))
    return out


ATTACKS = {"1a": attack_frame, "1b": attack_import, "2": attack_index, "2b": attack_offers, "3": attack_slots,
           "4": attack_dial}


def _summary(name: str, r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"{name}: skipped ({r['skipped']})"
    if "error" in r:
        return f"{name}: error {r['error']}"
    h = r.get("health") or {}
    if name == "2b":
        quiet, attack = r.get("quiet") or {}, r.get("attack") or {}
        q, lq, la = quiet.get("health", {}), quiet.get("loop_lag", {}), attack.get("loop_lag", {})
        return (f"2b: health p50/p99 {h.get('p50_ms')}/{h.get('p99_ms')} ms (quiet {q.get('p50_ms')}/"
                f"{q.get('p99_ms')} ms, p99 x{r.get('health_p99_ratio')}); loop lag p99/max {la.get('p99_ms')}/"
                f"{la.get('max_ms')} ms, gauge max {la.get('gauge_max_ms')} (quiet {lq.get('p99_ms')}/"
                f"{lq.get('max_ms')} ms); "
                f"{r.get('offers_answered')} offers of {r.get('dids_each')} DIDs in {r.get('seconds')} s; "
                f"load average {r.get('loadavg_1min')}")
    if name in ("1a", "1b", "2"):
        t = r.get("target", {})
        extra = f", neighbour +{r['neighbour']['rss_growth_mb']} MB" if "neighbour" in r else ""
        return (f"{name}: RSS +{t.get('rss_growth_mb')} MB (peak {t.get('rss_peak_mb')} MB"
                f"{', EXCEEDED the ceiling: killed' if t.get('exceeded') else ''}){extra}; "
                f"health p99 {h.get('p99_ms')} ms, max {h.get('max_ms')} ms; {r.get('seconds')} s")
    if name == "3":
        return (f"3: one address held {r.get('attacker_slots')}/{r['max_peers']} slots "
                f"(after the honest tries {r.get('attacker_slots_after_honest')}); honest newcomers: "
                f"{r.get('honest', {}).get('outcomes')}; health p99 {h.get('p99_ms')} ms")
    o, p = r.get("off_rule", {}), r.get("peers_table", {})
    return (f"4: off-rule dials {r.get('off_rule_dials')} (off-subnet {o.get('dials_off_subnet')}, host name "
            f"{o.get('dials_host_name')}, lawful {o.get('dials_lawful')}) in {o.get('window_s')} s; peers table "
            f"{p.get('rows_before')} -> {p.get('rows_after')} rows after {p.get('announces')} announces")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default="1a,1b,2,2b,3,4", help="which attacks (default all: 1a,1b,2,2b,3,4)")
    parser.add_argument("--full", action="store_true",
                        help="the issue's sizes: " + ", ".join(f"{k}={v}" for k, v in FULL.items()))
    parser.add_argument("--frame-containers", type=positive_int, help=f"1a (default {DEFAULT['frame_containers']})")
    parser.add_argument("--import-containers", type=positive_int, help=f"1b (default {DEFAULT['import_containers']})")
    parser.add_argument("--bomb-mb", type=float, default=15.0, help="decompressed size of each container (MB)")
    parser.add_argument("--index-mb", type=float, default=15.8, help="decompressed size of each index (MB)")
    parser.add_argument("--index-rate", type=float, default=2.0, help="2: index messages per second")
    parser.add_argument("--index-seconds", type=positive_int, help=f"2 (default {DEFAULT['index_seconds']})")
    parser.add_argument("--offer-seconds", type=positive_int, help=f"2b (default {DEFAULT['offer_seconds']})")
    parser.add_argument("--offer-dids", type=positive_int, default=4800, help="2b: made-up DIDs per offer (4800)")
    parser.add_argument("--offer-payload-bytes", type=positive_int, default=4 * MB,
                        help="2b: what each offer's payload opens to, at most (the MCE limit: 4 MiB)")
    parser.add_argument("--offers-ahead", type=positive_int, default=2,
                        help="2b: offers sent and not answered yet, at most (2)")
    parser.add_argument("--quiet-seconds", type=positive_int, default=5,
                        help="2b: the window before the attack the same probes measure (5)")
    parser.add_argument("--load-processes", type=int, default=0,
                        help="2b: processes spinning on a core each, in both windows (0: a quiet machine)")
    parser.add_argument("--sybils", type=positive_int, help=f"3: sessions from one address (default {DEFAULT['sybils']})")
    parser.add_argument("--honest", type=positive_int, default=2,
                        help="3: honest newcomers from another address, one after the other (default 2)")
    parser.add_argument("--max-peers", type=positive_int, default=64, help="3: the node's peer.max_peers")
    parser.add_argument("--slots-from", choices=("netns", "loopback"), default="netns",
                        help="3: attacker and honest peer in namespaces of their own, or on 127.0.0.2/.3")
    parser.add_argument("--off-rule-announces", type=positive_int, default=5, help="4: announces naming off-rule hosts")
    parser.add_argument("--dial-window", type=positive_int, default=20, help="4: seconds to count dials")
    parser.add_argument("--announces", type=positive_int, help=f"4: distinct DIDs announced (default {DEFAULT['announces']})")
    parser.add_argument("--announce-rate", type=float, default=150.0,
                        help="4: announces per second in all (the LAN filter takes 200/s)")
    parser.add_argument("--lan-sources", type=positive_int, default=32, help="4: source addresses of the neighbour")
    parser.add_argument("--peers-cap", type=int, default=None,
                        help="4: the node's peers table cap, if known (bounded = rows <= it)")
    parser.add_argument("--settle", type=positive_int, default=60, help="1a/1b: seconds to wait for the node")
    parser.add_argument("--rss-ceiling-mb", type=positive_int, default=4096,
                        help="a node above this RSS is killed and its attack marked exceeded")
    parser.add_argument("--node-code", type=Path, default=None,
                        help="run the nodes from this checkout's hmpnode (e.g. another branch's worktree); "
                             "the attacker stays this one")
    parser.add_argument("--keep", action="store_true", help="keep the data dirs (and logs)")
    args = parser.parse_args()
    sizes = FULL if args.full else DEFAULT
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    chosen = [x.strip() for x in args.attacks.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in ATTACKS]
    if unknown:
        parser.error(f"--attacks: unknown {unknown}; known: {','.join(ATTACKS)}")
    if min(args.bomb_mb, args.index_mb, args.index_rate, args.announce_rate) <= 0:
        parser.error("sizes and rates must be positive")
    if args.load_processes < 0:
        parser.error("--load-processes must be >= 0")

    if args.node_code:
        # `python -m hmpnode` looks in the working directory first
        args.node_code = args.node_code.resolve()
        if not (args.node_code / "hmpnode" / "__init__.py").is_file():
            parser.error(f"--node-code: no hmpnode package in {args.node_code}")
        os.chdir(args.node_code)
    from tests.netns import netns_unavailable, sweep_stale

    why = netns_unavailable()
    if why is None:
        sweep_stale()
        _sweep_etc_netns()
    # a plain `kill` of the benchmark still runs the clean-up (nodes, namespaces)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench(args)
    results: dict[str, Any] = {}
    t_all = time.monotonic()
    try:
        for name in chosen:
            if why and (name == "4" or (name == "3" and args.slots_from == "netns")):
                results[name] = {"skipped": why}
            else:
                log(f"attack {name} ...")
                t = time.monotonic()
                try:
                    results[name] = await ATTACKS[name](bench)
                except Exception as exc:  # noqa: BLE001 - one attack failing does not lose the others
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                results[name]["wall_s"] = round(time.monotonic() - t, 1)
                for proc in bench.procs:  # nodes the attack stopped in its own clean-up
                    bench.check_log(proc.data_dir.name, proc)
                problems = {k: v for k, v in bench.log_problems.items() if k.startswith(f"{name}-")}
                if problems:
                    results[name]["node_log_problems"] = problems
            log("  " + _summary(name, results[name]))
            for node, problem in results[name].get("node_log_problems", {}).items():
                log(f"  WARNING {node} logged {problem['lines']} problem line(s), first: {problem['first']}")
    finally:
        bench.close()
    report = {
        "node_code": str(args.node_code or Path(__file__).resolve().parents[1]),
        "sizes": {k: getattr(args, k) for k in (*DEFAULT, "bomb_mb", "index_mb", "index_rate", "offer_dids",
                                                  "offer_payload_bytes", "offers_ahead", "quiet_seconds",
                                                  "load_processes", "max_peers", "honest",
                                                  "off_rule_announces", "dial_window", "rss_ceiling_mb",
                                                  "slots_from")},
        "attacks": results,
        "targets": targets(results, args.peers_cap),
        "wall_s": round(time.monotonic() - t_all, 1),
    }
    report["pass"] = all(t["pass"] and "suspect" not in t for t in report["targets"].values()
                         if t["pass"] is not None)
    for name, t in report["targets"].items():
        log(f"target {name}: {t['value']} (want {t['target']}): "
            f"{'pass' if t['pass'] else 'FAIL' if t['pass'] is not None else 'not measured'}"
            f"{' (SUSPECT: ' + t['suspect'] + ')' if 'suspect' in t else ''}")
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
