"""The forward step of gossip (net/gossip.py) against in-memory sessions, in virtual time
(hmpnode.sim.vtime): who is pushed a broadcast at once, and when the others are told."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from hmpnode.net import gossip
from hmpnode.sim.vtime import run
from hmpnode.store.records import StoredContainer
from tests.test_session import did_of, make, note


class Link:
    def __init__(self, session):
        self.session, self.closed, self.frames = session, False, []

    async def flush(self) -> bool:
        self.frames += self.session.data_to_send()
        return True


class Mesh:
    """What `gossip.forward` uses of `Mesh`: the sessions, settings, clock, push and tasks."""

    def __init__(self, sessions, now, *, fanout: int, announce_delay_ms: int):
        self.sessions = {s.peer_did: Link(s) for s in sessions}
        self.settings = SimpleNamespace(fanout=fanout, announce_delay_ms=announce_delay_ms)
        self.node = SimpleNamespace(now=lambda: now)
        self._rng = random.Random(7)
        self.pushed: list[str] = []
        self.tasks: list[asyncio.Task] = []

    async def push(self, link, rows) -> None:
        self.pushed.append(link.session.peer_did)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task


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
        mesh = Mesh([make(alice, bob), make(alice, carol)], now, fanout=1, announce_delay_ms=200)
        start = loop.time()
        await gossip.forward(mesh, [row(item)])
        [pushed] = mesh.pushed
        [other] = [d for d in mesh.sessions if d != pushed]
        link = mesh.sessions[other]
        assert link.frames == [] and did not in link.session.announced  # not yet
        await asyncio.sleep(0.1)
        assert link.frames == []
        await asyncio.gather(*mesh.tasks)
        assert loop.time() - start >= 0.2
        assert did in link.session.announced and len(link.frames) == 1
        # the same once more, but the peer announced it to us while we waited: nothing to say
        mesh = Mesh([make(alice, bob), make(alice, carol)], now, fanout=1, announce_delay_ms=200)
        await gossip.forward(mesh, [row(item)])
        [other] = [d for d in mesh.sessions if d not in mesh.pushed]
        mesh.sessions[other].session.known.add(did)
        await asyncio.gather(*mesh.tasks)
        assert mesh.sessions[other].frames == []

    run(main())
