"""The node's DHT provider records (issue 11): an in-process Node with its Mesh (DHT
on 127.0.0.1, no LAN, no peers) on a clock the test moves, so that the republish
schedule kept on disk can be watched without waiting 30 minutes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from datetime import timedelta

from hmpnode.identity.keys import Identity
from hmpnode.net.dhtrecords import key_id, provider_key
from hmpnode.net.dialing import DialLimits
from hmpnode.net.lan import LanSettings
from hmpnode.net.mesh import Mesh
from hmpnode.net.settings import MeshSettings
from hmpnode.net.provide import should_publish
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

from .conftest import NOW, Clock, running_node

ME = Identity(bytes([77]) * 32)
SETTINGS = MeshSettings(host="127.0.0.1", port=0, lan=LanSettings(enabled=False), dialing=DialLimits(target_peers=0))


async def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    """`predicate()` (or what it returns, if awaitable) true within `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (await result if inspect.isawaitable(result := predicate()) else result):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _next_is(node, when) -> bool:
    return await node.db.read(ms.provide_next_us) == db.to_us(when)


@contextlib.asynccontextmanager
async def mesh_node(data_dir, clock: Clock):
    async with running_node(ME, data_dir, clock=clock) as node:
        mesh = node.mesh = Mesh(node, SETTINGS)
        await mesh.start()
        try:
            yield node, mesh
        finally:
            await mesh.stop()


async def test_provider_records_are_republished_from_disk_on_schedule_and_after_a_restart(tmp_path):
    clock = Clock(NOW)
    async with mesh_node(tmp_path, clock) as (node, mesh):
        dids = [(await node.create("note", {"text": f"b{n}"}, broadcast=True))[0].did for n in range(6)]
        scoped = (await node.create("note", {"text": "lan"}, broadcast=True, network="lan:10.0.0.0/8"))[0].did
        interval = timedelta(seconds=mesh.dht.limits.republish_interval)
        await wait_until(lambda: mesh.counters["dht_provided"] == 6, "the first publish")
        # counted as each record goes out, scheduled on disk after the round
        await wait_until(lambda: _next_is(node, NOW + interval), "the next round on disk")
        assert mesh.counters["dht_provide_listed"] == 6  # the scoped one is never listed
        dht = mesh.dht
        kid = key_id(provider_key(dids[0]))
        assert dht._store.own_record(kid).timestamp == NOW
        assert dht._store.own_record(key_id(provider_key(scoped))) is None
        rows = await node.db.read(lambda conn: conn.execute("SELECT did, next_us FROM dht_provide").fetchall())
        assert sorted(rows) == sorted((d, db.to_us(NOW + interval)) for d in dids)
        # not due yet: nothing re-signed
        clock.now = NOW + interval - timedelta(seconds=1)
        mesh.publisher.due.set()
        await asyncio.sleep(0.3)
        assert mesh.counters["dht_provided"] == 6
        # due: each re-signed once, with the time it was signed at, and scheduled again
        clock.now = NOW + interval
        mesh.publisher.due.set()
        await wait_until(lambda: mesh.counters["dht_provided"] == 12, "the republish")
        await wait_until(lambda: _next_is(node, NOW + 2 * interval), "the round after on disk")
        assert dht._store.own_record(kid).timestamp == NOW + interval
        assert dht.stats()["own_records"] == 0 and dht.stats()["stored_own"] == 6
        # a deleted container loses its record
        await node.db.write(lambda conn: ms.delete_containers(conn, [dids[0]]))
    clock.now = NOW + 2 * interval
    async with mesh_node(tmp_path, clock) as (node, mesh):
        # after a restart the list is still there, and what is due is published again
        await wait_until(lambda: mesh.counters["dht_provided"] == 5, "the republish after a restart")
        assert mesh.dht._store.own_record(kid) is None
        assert mesh.dht._store.own_record(key_id(provider_key(dids[1]))).timestamp == NOW + 2 * interval
        assert await node.db.read(ms.provide_count) == 5


def test_should_publish_once_then_as_the_routing_table_doubles_while_small():
    assert not should_publish(0, 0)  # no neighbours: nowhere to publish
    assert should_publish(1, 0)  # first neighbours (or refilled after being emptied)
    assert not should_publish(3, 2) and should_publish(4, 2)  # doubled
    assert should_publish(14, 7) and not should_publish(13, 7)
    assert not should_publish(1000, 8)  # 8 or more when last published: the Dht republishes by itself
