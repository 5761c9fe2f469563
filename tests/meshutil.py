"""Helpers for multi-node tests: start real `hmpnode run` processes on loopback
and wait, with deadlines, for what they report through their agent API."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from hmpnode.client import ApiError, Client
from tests.nodeproc import NodeProcess, Nodes, node_env


def mesh_env(**extra: str) -> dict[str, str]:
    """Loopback-only nodes that announce every 0.5 s (tests wait less)."""
    return node_env(HMPNODE_PEER_DISCOVERY_INTERVAL_MS="500", **extra)


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float, what: str, every: float = 0.1) -> Any:
    """Poll `check` until it returns something true; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r:.300})")


class MeshNode:
    """A node process and an API client for it."""

    def __init__(self, proc: NodeProcess):
        self.proc = proc
        self.info = proc.wait_ready()
        self.did: str = self.info["did"]
        self.public_key: str = self.info["public_key"]
        self.client = Client.from_data_dir(proc.data_dir)

    async def holds(self, did: str) -> bool:
        try:
            await self.client.get(did)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def peers(self) -> list[dict[str, Any]]:
        return (await self.client.peers())["peers"]

    async def connected(self) -> set[str]:
        return {p["did"] for p in await self.peers() if p["connected"]}

    async def known(self) -> set[str]:
        return {p["did"] for p in await self.peers()}

    async def wait_for_mailman(self, recipient: MeshNode, relay: MeshNode, timeout: float = 30) -> None:
        """Until this node knows `relay` as a mailman of `recipient` (from its announce)."""
        async def known():
            return any(p["did"] == recipient.did and relay.did in p.get("mailman", []) for p in await self.peers())

        await wait_for(known, timeout, "the sender to learn the recipient's mailman")

    async def close(self) -> None:
        await self.client.close()


#: an announce time no real announce reaches (2100-01-01): see `seed_peer`
OUTRANKS_ANNOUNCES_US = 4_102_444_800_000_000


def seed_peer(data_dir: Path, did: str, address: str, *, roles: tuple[str, ...] = (), held: bool = False) -> None:
    """A row of a stopped node's peers table: `did` at `address`, as if from an earlier run.

    `held`: the row claims an announce from 2100 and a past contact, so it stays as
    written: a peer's own announce (in its handshake) never replaces an entry from a
    newer one (hmpnode.store.mesh.upsert_peer, peers.remember), and a contacted peer
    is never forgotten for failed dials. A node then dials `did` only at `address`
    (a proxy), never at the address the peer announces."""
    from hmpnode.store import mesh as ms

    now_us = int(time.time() * 1e6)
    row = ms.PeerRow(did, None, [address], list(roles), [], OUTRANKS_ANNOUNCES_US if held else 0, "test", now_us,
                     now_us if held else None)
    db = sqlite3.connect(Path(data_dir) / "hmpnode.sqlite3")
    try:
        with db:
            ms.upsert_peer(db, row)
    finally:
        db.close()


def start_nodes(nodes: Nodes, base: Path, count: int, *args: str, env: dict[str, str] | None = None,
                prefix: str = "n") -> list[MeshNode]:
    procs = [nodes(base / f"{prefix}{i}", *args, env=env or mesh_env()) for i in range(count)]
    return [MeshNode(p) for p in procs]


def dht_trio(nodes: Nodes, base: Path, **author_env: str) -> tuple[MeshNode, MeshNode, MeshNode]:
    """A DHT seed, an author (with `author_env`) and a reader bootstrapped from it: no LAN
    discovery and no dialling of their own, so they meet only through DHT records."""
    quiet = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_TARGET_PEERS": "0"}
    seed = MeshNode(nodes(base / "seed", env=mesh_env(**quiet)))
    boot = f"127.0.0.1:{seed.info['peer']['dht_port']}"
    author = MeshNode(nodes(base / "author", env=mesh_env(HMPNODE_PEER_BOOTSTRAP=boot, **author_env, **quiet)))
    reader = MeshNode(nodes(base / "reader", env=mesh_env(HMPNODE_PEER_BOOTSTRAP=boot, **quiet)))
    return seed, author, reader


async def start_seeded(nodes: Nodes, path: Path, env: dict[str, str], seeds=()) -> MeshNode:
    """A node whose peers table holds `seeds` (did, address) when it starts dialling: a first
    run makes the store, the rows go in while it is stopped, the second run dials them."""
    if seeds:
        first = nodes(path, env=env)
        first.wait_ready()
        await asyncio.to_thread(first.stop)
        for did, address in seeds:
            seed_peer(path, did, address, held=True)
    return MeshNode(nodes(path, env=env))
