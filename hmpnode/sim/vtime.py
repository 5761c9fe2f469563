"""A virtual-time asyncio event loop: the simulator's clock.

The loop never waits for real time: when nothing is ready, its selector jumps the
clock to the next timer instead of sleeping. Everything scheduled on it (the mesh
core's drivers, the `kademlia` DHT, simulated links) therefore runs in simulated
time, in an order fixed by the schedule alone, so a seeded run is replayable.
No file descriptors may be registered: simulated links are in memory.
"""

from __future__ import annotations

import asyncio
import selectors

__all__ = ["VirtualLoop", "run"]


class _JumpSelector(selectors.BaseSelector):
    """A selector with nothing to select: `select(timeout)` advances the loop's clock."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._map: dict = {}

    def register(self, fileobj, events, data=None):  # the loop's self-pipe only
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._map.pop(fileobj)

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("virtual loop idle: nothing is scheduled (a simulated wait without a deadline)")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def close(self) -> None:
        self._map.clear()

    def get_map(self):
        return self._map


class VirtualLoop(asyncio.SelectorEventLoop):
    """`time()` is the virtual clock (seconds, from `start`); it moves only when the loop
    has nothing ready, straight to the next timer."""

    def __init__(self, start: float = 0.0) -> None:
        self._vnow = start
        super().__init__(_JumpSelector(self))
        self.set_debug(False)

    def time(self) -> float:
        return self._vnow

    def advance(self, seconds: float) -> None:
        self._vnow += seconds

    def _make_self_pipe(self) -> None:  # no real pipe: nothing wakes a virtual loop from outside
        self._ssock = self._csock = None

    def _close_self_pipe(self) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def _process_self_data(self, data) -> None:
        pass

    def run_in_executor(self, executor, func, *args):  # no threads: the work runs now, in virtual no-time
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting code, as an executor would
            future.set_exception(exc)
        return future


def run(main, *, start: float = 0.0):
    """Run coroutine `main` to completion on a fresh virtual loop; its result."""
    loop = VirtualLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        try:  # what is still running is cancelled and let finish, as asyncio.run does
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()
