"""A local mesh for the demo and the benchmark: N `hmpnode run` processes on
127.0.0.1 (peer port, DHT and LAN discovery on loopback only), each in its own
data directory, all killed at the end (tests.nodeproc does the process work)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hmpnode.client import ApiError, Client  # noqa: E402
from tests.nodeproc import Nodes, node_env  # noqa: E402


class LocalMesh:
    def __init__(self, count: int, *, roles: dict[int, str] | None = None, interval_ms: int = 1000,
                 keep: Path | None = None):
        self.count = count
        self.roles = roles or {}
        self.base = keep or Path(tempfile.mkdtemp(prefix="hmpnode-mesh-"))
        self.keep = keep is not None
        # a discovery port of our own: other meshes on this host stay apart
        self.env = node_env(HMPNODE_PEER_DISCOVERY_INTERVAL_MS=str(interval_ms),
                            HMPNODE_PEER_DISCOVERY_PORT=str(41000 + os.getpid() % 20000))
        self.nodes = Nodes()
        self.procs: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.clients: list[Client] = []

    def start(self, indexes: list[int] | None = None) -> None:
        started = []
        for i in indexes if indexes is not None else range(self.count):
            args = ("--roles", self.roles[i]) if i in self.roles else ()
            proc = self.nodes(self.base / f"node{i:02d}", *args, env=self.env)
            started.append((i, proc))
        for i, proc in started:
            info = proc.wait_ready(timeout=60)
            while len(self.procs) <= i:
                self.procs.append(None)
                self.infos.append({})
                self.clients.append(None)  # type: ignore[arg-type]
            self.procs[i], self.infos[i] = proc, info
            self.clients[i] = Client.from_data_dir(proc.data_dir)

    async def stop_node(self, i: int) -> None:
        await self.clients[i].close()
        self.procs[i].stop()

    async def close(self) -> None:
        for client in self.clients:
            if client is not None:
                await client.close()
        self.nodes.cleanup()
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)

    @property
    def dids(self) -> list[str]:
        return [info["did"] for info in self.infos]

    async def holds(self, i: int, did: str) -> bool:
        try:
            await self.clients[i].get(did)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def wait_discovered(self, timeout: float = 60.0) -> float:
        """Until every node knows every other one and has a connection; seconds taken."""
        start = time.monotonic()
        everyone = set(self.dids)
        while time.monotonic() - start < timeout:
            views = await asyncio.gather(*(c.peers() for c in self.clients))
            if all({p["did"] for p in v["peers"]} >= everyone - {self.dids[i]}
                   and any(p["connected"] for p in v["peers"]) for i, v in enumerate(views)):
                return time.monotonic() - start
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the {self.count} nodes did not all find each other within {timeout} s")

    def rss_kib(self, i: int) -> dict[str, int]:
        """RSS, and PSS/USS (shared library pages divided among the processes that map them)."""
        out = {}
        pid = self.procs[i].pid
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    out["rss"] = int(line.split()[1])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                fields = {line.split(":")[0]: int(line.split()[1]) for line in fh if line.rstrip().endswith("kB")}
            out["pss"] = fields.get("Pss", 0)
            out["uss"] = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
        except OSError:
            pass
        return out
