"""Crash safety: the node is SIGKILLed while it ingests thousands of containers
through the API. After a restart every container whose import was acknowledged
is present and intact, and the database passes SQLite's integrity check."""

from __future__ import annotations

import asyncio
import random
import shutil
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path

import aiohttp
import nacl.utils
import orjson

from hmpnode.client import Client
from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.verify import encode_wire
from hmpnode.identity import Identity

TOTAL = 3000
BATCH = 50
WORKERS = 4
KILL_AFTER = 1000  # acknowledged containers before the SIGKILL
DB_FILE = "hmpnode.sqlite3"




def _containers() -> list[tuple[str, bytes, bytes]]:
    """(did, wire bytes, canonical hmp_container) of TOTAL distinct containers."""
    sender = Identity(bytes([7]) * 32)
    now = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=30)
    out = []
    for i in range(TOTAL):
        container = build_container(
            sender, "note", {"text": f"durable item {i}", "n": i, "pad": "x" * (i % 200)},
            now=now, rng=nacl.utils.random, tags=["durability", f"n{i % 10}"],
            compression="zstd" if i % 3 == 0 else None,
        )
        out.append((container["hmp_container"]["head"]["container_did"], encode_wire(container),
                    canonical_json(container["hmp_container"])))
    return out


def _integrity(db: Path) -> tuple[str, int]:
    conn = sqlite3.connect(db)
    try:
        verdict = conn.execute("PRAGMA integrity_check").fetchall()
        count = conn.execute("SELECT COUNT(*) FROM containers").fetchone()[0]
    finally:
        conn.close()
    return "\n".join(row[0] for row in verdict), count


def _unindexed(db: Path) -> int:
    """Held containers without a full-text index row (indexed after the commit, issue 15)."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT COUNT(*) FROM containers c WHERE c.conflict = 0"
                            " AND NOT EXISTS (SELECT 1 FROM search WHERE rowid = c.seq)").fetchone()[0]
    finally:
        conn.close()


async def _ingest_until_killed(url: str, token: str, containers, node) -> tuple[set[str], int]:
    """WORKERS tasks import batches concurrently; a separate task SIGKILLs the node
    once KILL_AFTER containers are acknowledged. Returns (acknowledged DIDs,
    batches that failed)."""
    batches = [containers[i:i + BATCH] for i in range(0, len(containers), BATCH)]
    work: asyncio.Queue = asyncio.Queue()
    for batch in batches:
        work.put_nowait(batch)
    acked: set[str] = set()
    enough = asyncio.Event()
    failed = 0
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal failed
        while not work.empty():
            batch = work.get_nowait()
            body = b'{"containers":[' + b",".join(wire for _, wire, _ in batch) + b"]}"
            try:
                async with session.post(url + "/v1/containers/import", data=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = orjson.loads(await resp.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError):
                failed += 1  # the node died under this request: nothing in it was acknowledged
                continue
            results = answer["results"]
            assert len(results) == len(batch)
            for (did, _, _), result in zip(batch, results, strict=True):
                assert result["did"] == did, result
                assert result["status"] in ("stored", "duplicate"), result
                acked.add(did)
            if len(acked) >= KILL_AFTER:
                enough.set()

    async def killer() -> None:
        await enough.wait()
        # a little later, at a random moment: mid-verify, mid-commit or mid-answer
        await asyncio.sleep(random.uniform(0, 0.05))
        node.kill()  # SIGKILL, no warning

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        kill_task = asyncio.ensure_future(killer())
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(session) for _ in range(WORKERS))), timeout=45)
        finally:
            if not kill_task.done():
                kill_task.cancel()
    return acked, failed


async def _check_present(url: str, token: str, expected: dict[str, bytes], dids) -> list[str]:
    """DIDs among `dids` that the node does not return byte-identical."""
    bad: list[str] = []
    limit = asyncio.Semaphore(16)
    headers = {"Authorization": f"Bearer {token}"}

    async def one(session: aiohttp.ClientSession, did: str) -> None:
        async with limit, session.get(f"{url}/v1/containers/{did}", headers=headers) as resp:
            if resp.status != 200:
                bad.append(f"{did}: HTTP {resp.status} {await resp.text()}")
                return
            got = orjson.loads(await resp.read())
        if canonical_json(got["container"]["hmp_container"]) != expected[did]:
            bad.append(f"{did}: content differs")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.wait_for(asyncio.gather(*(one(session, did) for did in dids)), timeout=40)
    return bad


async def _listed(url: str, token: str) -> dict[str, bytes]:
    """Every stored container of the test, by DID, via the list API (following cursors)."""
    async with Client(url, token) as client:
        return {item["did"]: canonical_json(item["container"]["hmp_container"])
                async for item in client.iterate(tag="durability", limit=1000)}


def test_sigkill_during_ingest_loses_nothing_acknowledged(nodes, tmp_path):
    containers = _containers()
    expected = {did: canon for did, _, canon in containers}
    data = tmp_path / "node"

    node = nodes(data)
    info = node.wait_ready()
    token = (data / "api.token").read_text().strip()
    acked, failed = asyncio.run(_ingest_until_killed(info["api"]["url"], token, containers, node))
    node.wait(timeout=10)
    assert node.proc.returncode == -9, node.log()
    assert len(acked) >= KILL_AFTER
    assert failed > 0 and len(acked) < TOTAL, "the node finished before the kill; the test proved nothing"

    # The database as the crash left it (a copy, so that opening it changes nothing).
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal"):
        if (data / (DB_FILE + suffix)).exists():
            shutil.copy2(data / (DB_FILE + suffix), crashed / (DB_FILE + suffix))
    verdict, count = _integrity(crashed / DB_FILE)
    assert verdict == "ok"
    assert count >= len(acked)
    print(f"acknowledged {len(acked)} of {TOTAL}, {failed} batches cut off, {count} rows after the crash,"
          f" {_unindexed(crashed / DB_FILE)} of them not in the full-text index yet")

    # Restart on the same data dir (the stale node.json must not matter).
    again = nodes(data)
    info2 = again.wait_ready()
    assert info2["did"] == info["did"]
    bad = asyncio.run(_check_present(info2["api"]["url"], token, expected, sorted(acked)))
    assert not bad, f"{len(bad)} acknowledged containers lost or damaged, e.g. {bad[:5]}"
    # and what was stored without being acknowledged (committed, answer cut off) is intact too
    listed = asyncio.run(_listed(info2["api"]["url"], token))
    assert acked <= set(listed) and len(listed) == count
    assert all(canon == expected[did] for did, canon in listed.items())
    assert again.stop() == 0, again.log()

    verdict, count = _integrity(data / DB_FILE)
    assert verdict == "ok"
    assert count >= len(acked)
    assert _unindexed(data / DB_FILE) == 0  # the restart indexed what the crash left unindexed
