"""Running the mesh core's decisions on asyncio (the node's and the simulator's).

`hmpnode.net.core.MeshCore` decides in generators of effects; `run` carries one such
generator to its end, asking a `World` to carry out each effect and sending the result
(or the exception) back in. The node's world is SQLite, sockets and verify threads
(`hmpnode.net.mesh`); the simulator's a dict store, simulated links and virtual time
(`hmpnode.sim`). The loops that pace the core's node-wide jobs (`outbox_loop`,
`timer_loop`) are the same for both: they run on whatever loop they are given, the
simulator's clock being virtual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from hmpnode.net import core as C

__all__ = ["World", "run", "outbox_loop"]

log = logging.getLogger("hmpnode.mesh")


class World:
    """What carries out the core's effects; one method per kind of effect."""

    async def read(self, fn) -> Any:
        raise NotImplementedError

    async def write(self, fn) -> Any:
        raise NotImplementedError

    async def ingest(self, effect: C.Ingest) -> list[Any]:
        raise NotImplementedError

    async def offload(self, effect: C.Offload) -> Any:
        raise NotImplementedError

    async def flush(self, link: Any) -> None:
        raise NotImplementedError

    async def reach(self, did: str, *, mail: bool = False) -> Any:
        """A link with `did` (core.Reach); `mail`: our agent has mail for it."""
        raise NotImplementedError

    async def find_peer(self, did: str) -> Any:
        return None

    def clock(self) -> tuple[Any, float]:
        raise NotImplementedError

    async def sets(self) -> Any:
        raise NotImplementedError

    def spawn(self, steps: C.Steps) -> None:
        raise NotImplementedError

    async def cut_off(self, link: Any) -> None:
        raise NotImplementedError

    async def unhandled(self, link: Any, event: Any) -> None:
        raise NotImplementedError

    async def carry_out(self, effect: C.Effect) -> Any:
        match effect:
            case C.Clock():
                return self.clock()
            case C.Read(fn):
                return await self.read(fn)
            case C.Write(fn):
                return await self.write(fn)
            case C.Flush(link):
                return await self.flush(link)
            case C.Ingest():
                return await self.ingest(effect)
            case C.Offload():
                return await self.offload(effect)
            case C.Reach(did, mail):
                return await self.reach(did, mail=mail)
            case C.FindPeer(did):
                return await self.find_peer(did)
            case C.Sets():
                return await self.sets()
            case C.Spawn(steps):
                return self.spawn(steps)
            case C.CutOff(link):
                return await self.cut_off(link)
            case C.Unhandled(link, event):
                return await self.unhandled(link, event)
            case C.Pause(seconds):
                await asyncio.sleep(seconds)
                return None
        raise TypeError(f"not an effect: {effect!r}")


async def run(steps: C.Steps, world: World) -> Any:
    """Carry a core generator to its end; its return value. An effect that raises has
    its exception thrown into the generator (which may handle it, as StorageFull)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = error = None
        try:
            value = await world.carry_out(effect)
        except Exception as exc:  # noqa: BLE001 - the generator decides what it means
            error = exc


async def outbox_loop(core: C.MeshCore, world: World, wake: asyncio.Event) -> None:
    """Deliver the agent's directed containers: recipient, its relays, or retry later. What
    waits is woken (due at once, not at its retry time) when a path to its recipient
    connects (`core.outbox_arrived`, then `wake` set)."""
    while True:
        # cleared before reading: a wake-up set while this pass delivers is kept for the next
        wake.clear()
        by_recipient, more = await run(core.outbox_pass(), world)
        if by_recipient:
            outcomes = await asyncio.gather(*(run(core.deliver(r, entries), world)
                                              for r, entries in by_recipient.items()), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    log.error("outbox delivery failed", exc_info=outcome)
        if more:
            continue  # more are due now
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), core.outbox_wait(bool(by_recipient)))
