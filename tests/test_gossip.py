"""The forward step of gossip (MeshCore.forward) against in-memory sessions, in virtual time
(hmpnode.sim.vtime): who is pushed a broadcast at once, and when the others are told."""

from __future__ import annotations

import asyncio
import random

from hmpnode.net import drive
from hmpnode.net.core import MeshCore
from hmpnode.net.settings import MeshLimits, MeshSettings
from hmpnode.sim.vtime import run
from hmpnode.store.records import StoredContainer
from tests.test_session import did_of, make, note


class Link:
    def __init__(self, session):
        self.session, self.closed, self.frames = session, False, []

    @property
    def did(self) -> str:
        return self.session.peer_did

    @property
    def roles(self) -> tuple[str, ...]:
        return ()


class World(drive.World):
    """The effects `MeshCore.forward` asks for: the time, sending, a task of its own."""

    def __init__(self, now):
        self.now, self.tasks = now, []

    def clock(self):
        return self.now, asyncio.get_running_loop().time()

    async def flush(self, link) -> None:
        link.frames += link.session.data_to_send()

    def spawn(self, steps) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(drive.run(steps, self)))


def mesh_of(identity, sessions, *, fanout: int, announce_delay_ms: int) -> MeshCore:
    limits = MeshLimits(fanout=fanout, announce_delay_seconds=announce_delay_ms / 1000)
    core = MeshCore(identity, MeshSettings(mesh=limits), random.Random(7))
    core.links.update({s.peer_did: Link(s) for s in sessions})
    return core


def pushed_to(core: MeshCore) -> list[str]:
    return [d for d, link in core.links.items() if any(f.startswith(b'{"type":"containers"') for f in link.frames)]


def row(container) -> StoredContainer:
    return StoredContainer(seq=1, did=did_of(container), hmp_container=container["hmp_container"], ts_us=0,
                           ttl_us=None, received_us=0, source="agent", flags=[], conflict=False, size=0)


def test_announcements_wait_for_the_pushes_and_skip_who_told_us(alice, bob, carol, now):
    """A broadcast is pushed to `fanout` peers at once and announced to the others only
    `announce_delay_ms` later (the pushed copies go first: an announcement racing them
    would make a peer ask and graft a link the tree pruned); a peer that told us it has
    it meanwhile is not told."""
    item = note(alice, now, "b", broadcast=True)
    did = did_of(item)

    async def main():
        loop = asyncio.get_running_loop()
        core = mesh_of(alice, [make(alice, bob), make(alice, carol)], fanout=1, announce_delay_ms=200)
        world = World(now)
        start = loop.time()
        await drive.run(core.forward([row(item)]), world)
        [pushed] = pushed_to(core)
        [other] = [d for d in core.links if d != pushed]
        link = core.links[other]
        assert link.frames == [] and did not in link.session.announced  # not yet
        await asyncio.sleep(0.1)
        assert link.frames == []
        await asyncio.gather(*world.tasks)
        assert loop.time() - start >= 0.2
        assert did in link.session.announced and len(link.frames) == 1
        # the same once more, but the peer announced it to us while we waited: nothing to say
        core = mesh_of(alice, [make(alice, bob), make(alice, carol)], fanout=1, announce_delay_ms=200)
        world = World(now)
        await drive.run(core.forward([row(item)]), world)
        [other] = [d for d in core.links if d not in pushed_to(core)]
        core.links[other].session.known.add(did)
        await asyncio.gather(*world.tasks)
        assert core.links[other].frames == []

    run(main())
