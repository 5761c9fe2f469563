"""Verification in worker processes: big batches use every core (issue 15).

Verification is mostly Python (parse, canonical form, schema checks) and holds the
GIL; only libsodium's signature check releases it. In one process the verify
threads, the writer thread and the event loop take turns on that one lock.
`VerifyProcesses` runs `Verifier.verify` in worker processes
(`python -m hmpnode.verifyprocs`), started once, on the first batch big enough to
pay for them, and fed over their stdin/stdout pipes (length-prefixed pickles):

- to a worker: the containers as received (a parsed container as its orjson text,
  parsed there the same way), the node's `now`, the limits, and the key-registry
  changes (pins, revocations) that worker has not seen yet;
- back: a compact verdict per container, in input order, and the worker's CPU
  seconds (a peer's verification budget). Not the parsed container: the node holds
  it already (API import) or parses an accepted container's bytes again, cheaper
  than pickling the tree back; but the `body` text the fast path cut (canonical
  bytes in), so the store need not serialise the container again: as an (offset,
  length) in the bytes sent when it is a slice of them (it is, for canonical wire text).

A worker runs with the node's GC settings (young threshold, start-up frozen).

A worker exits when its stdin closes: when the node stops, and when the node dies
(even by SIGKILL), so no worker outlives it. A worker that dies is replaced on a
later batch (at most `MAX_RESTARTS` times); the chunk it held, and every batch
while no worker is ready, is verified on the node's threads, with the same result.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from hmpnode.container.inflight import ByteBudget
from hmpnode.container.verify import BYTES_LIKE, Limits, Verifier, VerifyResult
from hmpnode.identity.registry import MemoryKeyRegistry
from hmpnode.memory.index import payload_text

__all__ = ["LoggedKeyRegistry", "VerifyProcesses", "index_payload", "resolve_count", "thread_count",
           "usable_cpus", "MAX_RESTARTS"]

log = logging.getLogger("hmpnode.verifyprocs")

#: workers started again after one died, over the node's life; then threads only
MAX_RESTARTS = 3
#: "auto" runs at most this many workers (the node's own threads need a core too)
AUTO_MAX = 8
_READY = b"hmpnode-verifyprocs-ready"
#: verify threads of "auto" on up to two cores: one. Measured with 4 clients importing
#: canonical bytes (docs/benchmarks-journal.md, "Issue 15, session 5: verification"): a second thread only adds
#: GIL hand-offs between the two (verification CPU ~85 against ~80 us per container,
#: node CPU ~179 against ~171 us), while one thread's libsodium time already overlaps the
#: writer's and the event loop's Python on the other core; throughput within the noise
AUTO_THREADS_2CORES = 1


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container or `taskset`
    pinned to fewer cores than the machine has), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def resolve_count(setting: str | int, cpus: int | None = None) -> int:
    """Worker processes for a `verify_processes` setting; an integer is taken as it is
    (0: threads only). "auto": none on one core (a worker only adds the copying, no
    core to run beside the node); on 2 cores two, where measured (issue 15,
    docs/benchmarks-journal.md, "round 2: verification in worker processes") they raise
    ingest 35-45 % over the threads at the same or less CPU per container, since
    with threads everything but libsodium's share of verification holds the node's
    one GIL beside the writer and the event loop; beyond, one per core but one (the
    writer and the event loop need a core), at most `AUTO_MAX`."""
    if setting == "auto":
        cpus = cpus if cpus is not None else usable_cpus()
        return 0 if cpus < 2 else min(max(cpus - 1, 2), AUTO_MAX)
    return int(setting)


def thread_count(setting: str | int, cpus: int | None = None) -> int:
    """Verify threads for a `verify_threads` setting; an integer is taken as it is.
    "auto": AUTO_THREADS_2CORES on up to two cores, else 2 (beside the worker processes
    "auto" starts from 2 cores on, the threads verify small batches only, and every
    batch while the workers start)."""
    if setting == "auto":
        cpus = cpus if cpus is not None else usable_cpus()
        return min(cpus, AUTO_THREADS_2CORES) if cpus <= 2 else 2
    return int(setting)


def index_payload(verdict: VerifyResult) -> None:
    """Keep only the (bounded) full-text index text of an opened payload, never the
    payload itself: a 16 MiB payload is let go where it was verified."""
    if verdict.payload is not None:
        verdict.payload = "" if isinstance(verdict.payload, (bytes, bytearray)) else payload_text(verdict.payload)


class LoggedKeyRegistry(MemoryKeyRegistry):
    """A MemoryKeyRegistry that logs which DIDs changed (pinned or revoked), in order,
    so that each worker process can be sent the changes it has not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.changes: list[str] = []
        self._lock = threading.Lock()

    def pin(self, did: str, public_key: bytes) -> bool:
        with self._lock:
            fresh = did not in self._pins
            same = super().pin(did, public_key)
            if fresh:
                self.changes.append(did)
        return same

    def revoke(self, did: str, at: datetime) -> None:
        with self._lock:
            super().revoke(did, at)
            self.changes.append(did)

    def delta(self, seen: int) -> tuple[int, dict[str, tuple[bytes | None, datetime | None]]]:
        """(position, {did: (pinned key, revoked at)}) of every DID changed after `seen`."""
        with self._lock:
            dids = self.changes[seen:]
            return len(self.changes), {did: (self._pins.get(did), self._revoked.get(did)) for did in dids}


# -- framing: 8-byte length + pickle, both ways (the peer is our own worker) --------


def _send(fh: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(len(data).to_bytes(8, "big"))
    fh.write(data)
    fh.flush()


def _recv(fh: BinaryIO) -> Any:
    head = fh.read(8)
    if len(head) < 8:
        raise EOFError("the worker closed its pipe")
    size = int.from_bytes(head, "big")
    data = fh.read(size)
    if len(data) < size:
        raise EOFError("the worker closed its pipe")
    return pickle.loads(data)


# -- the worker process -------------------------------------------------------------


#: a parsed container sent as its orjson text: parsed again in the worker (kind 1);
#: anything else (bytes, text, a dict orjson cannot write) is verified as sent (kind 0)
_AS_SENT, _ORJSON_TEXT = 0, 1


class _Worker:
    """The state of one worker process: its copy of the key registry and its Verifiers."""

    def __init__(self) -> None:
        from hmpnode.container.schema import default_schemas

        self.registry = MemoryKeyRegistry()
        self.schemas = default_schemas()  # what the node uses (Node.schemas)
        self.verifiers: dict[Limits, Verifier] = {}

    def run(self, task: tuple) -> tuple[list[tuple], float]:
        delta, now, limits, from_peer, kinds, items = task
        for did, (key, revoked) in delta.items():
            _set(self.registry._pins, did, key)
            _set(self.registry._revoked, did, revoked)
        verifier = self.verifiers.get(limits)
        if verifier is None:
            verifier = self.verifiers[limits] = Verifier(registry=self.registry, schemas=self.schemas, limits=limits)
        started = time.process_time()
        out = []
        for kind, item in zip(kinds, items, strict=True):
            verdict = verifier.verify(orjson.loads(item) if kind == _ORJSON_TEXT else item, now=now, from_peer=from_peer)
            index_payload(verdict)
            out.append((verdict.ok, verdict.reason, verdict.detail, verdict.container_did, verdict.expired,
                        tuple(verdict.store_and_forward), verdict.key_revoked_later, verdict.pin_candidate,
                        verdict.payload, _body_ref(verdict.body, item)))
        return out, time.process_time() - started


def _body_ref(body: bytes | None, sent: Any) -> bytes | tuple[int, int] | None:
    """`body` as (offset, length) in the bytes the node sent when it is a slice of them
    (the fast path cuts the hmp_container's text out of the full form's wire text,
    ending one byte before it): the node holds those bytes, so they need not travel back."""
    if body is not None and type(sent) is bytes:
        at = len(sent) - len(body) - 1
        if at >= 0 and sent.startswith(body, at):
            return at, len(body)
    return body


def _set(table: dict, key: str, value: Any) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


def main(argv: Sequence[str] = ()) -> int:
    """The worker: verify what stdin brings until it closes. `argv`: the node's
    young-generation GC threshold ([node] gc_young_threshold)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the pipe carries frames only
    # Ctrl-C reaches the whole process group: the node stops and closes our stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _Worker()
    # as in the daemon: a batch allocates thousands of objects, and each young
    # collection walks them; what start-up left alive (modules, schemas) is frozen
    # out of every later collection
    if argv:
        gc.set_threshold(int(argv[0]), *gc.get_threshold()[1:])
    gc.collect()
    gc.freeze()
    try:
        _send(stdout, _READY)
        while True:
            try:
                task = _recv(stdin)
            except EOFError:
                return 0
            _send(stdout, worker.run(task))
    except (BrokenPipeError, ConnectionResetError):
        return 0


# -- the node's side ----------------------------------------------------------------


class _Proc:
    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        #: how far this worker has been sent `LoggedKeyRegistry.changes`
        self.seen = 0
        #: one exchange at a time on the pipes (FIFO: batches are served in turn)
        self.lock = asyncio.Lock()
        self.dead = False

    def exchange(self, task: tuple) -> tuple[list[tuple], float]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        _send(self.popen.stdin, task)
        return _recv(self.popen.stdout)

    def end(self, timeout: float) -> None:
        """Close stdin (the worker exits at EOF); kill it if it is not gone within `timeout`."""
        self.dead = True
        for pipe in (self.popen.stdin, self.popen.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class VerifyProcesses:
    """`count` verify worker processes for batches of at least `min_batch` containers."""

    def __init__(self, count: int, *, min_batch: int, registry: LoggedKeyRegistry):
        self.count = max(count, 0)
        self.min_batch = max(min_batch, 1)
        self.registry = registry
        #: workers that died or did not start (no more starts after MAX_RESTARTS)
        self.lost = 0
        self.counters: Counter[str] = Counter()
        self._procs: list[_Proc] = []
        self._starting: asyncio.Task | None = None
        self._closed = False
        # one thread per worker waits on its pipe (the GIL is released meanwhile)
        self._io = ThreadPoolExecutor(max_workers=self.count + 1, thread_name_prefix="hmpnode-verify-io")

    def wants(self, n: int) -> bool:
        """Should a batch of `n` go to the workers (when they are ready)?"""
        return self.count > 0 and not self._closed and n >= self.min_batch

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self._procs]

    def stats(self) -> dict[str, Any]:
        return {"processes": self.count, "ready": len(self._procs), "min_batch": self.min_batch,
                "lost": self.lost, **self.counters}

    async def verify(self, raws: Sequence[Any], costs: Sequence[int], now: datetime, limits: Limits,
                     from_peer: bool, budget: ByteBudget,
                     fallback: Callable[[Sequence[Any], Sequence[int]], Awaitable[tuple[list[VerifyResult], float]]],
                     ) -> tuple[list[VerifyResult], float] | None:
        """Verdicts for `raws` in input order and the workers' CPU seconds; None while no
        worker is ready (they are started on the first call, and again after one died):
        verify on threads then. A chunk whose worker dies goes to `fallback` (the threads)."""
        if len(self._procs) < self.count:
            self._start_soon()
        procs = list(self._procs)
        if not procs:
            return None
        size = -(-len(raws) // len(procs))
        parts = await asyncio.gather(*(
            self._chunk(proc, raws[i:i + size], costs[i:i + size], now, limits, from_peer, budget, fallback)
            for proc, i in zip(procs, range(0, len(raws), size))
        ))
        self.counters["batches"] += 1
        return [v for part, _ in parts for v in part], sum(cpu for _, cpu in parts)

    async def _chunk(self, proc, raws, costs, now, limits, from_peer, budget, fallback):
        hold = min(max(costs, default=0), budget.capacity)  # a worker verifies one container at a time

        def exchange():
            # in an IO thread: what costs per container (writing a parsed one out,
            # rebuilding the verdicts) stays off the event loop, which serves reads
            kinds, items = _encode(raws)
            seen, delta = self.registry.delta(proc.seen)
            budget.acquire(hold)
            try:
                out, cpu = proc.exchange((delta, now, limits, from_peer, kinds, items))
            finally:
                budget.release(hold)
            proc.seen = seen
            return [_verdict(item, raw, sent) for item, raw, sent in zip(out, raws, items, strict=True)], cpu

        async with proc.lock:
            try:
                if proc.dead:
                    raise EOFError("the worker is gone")
                out, cpu = await asyncio.get_running_loop().run_in_executor(self._io, exchange)
            except (EOFError, OSError, pickle.UnpicklingError) as exc:
                self._lost(proc, exc)
                out = None
        if out is None:
            self.counters["fallback_chunks"] += 1
            return await fallback(raws, costs)
        self.counters["containers"] += len(raws)
        return out, cpu

    def _lost(self, proc: _Proc, exc: BaseException) -> None:
        if proc in self._procs:
            if not self._closed:
                log.warning("verify worker %d stopped (%s); verifying on threads meanwhile", proc.popen.pid, exc)
                self.lost += 1
            self._procs.remove(proc)
        proc.end(timeout=1)

    async def start(self) -> int:
        """Start the missing workers now and wait until they are ready (or failed);
        returns how many are ready. (Batches start them on their own; this is for
        callers that want them at once.)"""
        self._start_soon()
        if self._starting is not None:
            await asyncio.shield(self._starting)
        return len(self._procs)

    def _start_soon(self) -> None:
        if self._closed or self._starting is not None or self.lost > MAX_RESTARTS:
            return
        self._starting = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        """Start the missing workers; they join once they say they are ready."""
        try:
            started = await asyncio.get_running_loop().run_in_executor(
                self._io, self._spawn, self.count - len(self._procs))
            for proc in started:
                if self._closed:
                    proc.end(timeout=1)
                else:
                    self._procs.append(proc)
        finally:
            self._starting = None

    def _spawn(self, n: int) -> list[_Proc]:
        """Start `n` workers and wait for each to say it is ready (its imports done)."""
        import hmpnode

        # the worker imports the same hmpnode as this process, wherever it came from
        root = str(Path(hmpnode.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        procs = []
        for _ in range(n):
            try:
                # the node's GC threshold ([node] gc_young_threshold, set by the daemon) too
                command = [sys.executable, "-m", "hmpnode.verifyprocs", str(gc.get_threshold()[0])]
                procs.append(_Proc(subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)))
            except OSError as exc:
                log.warning("cannot start a verify worker (%s): verifying on threads", exc)
                self.lost += 1
        ready = []
        for proc in procs:
            try:
                assert proc.popen.stdout is not None
                if _recv(proc.popen.stdout) != _READY:
                    raise EOFError("unexpected greeting")
                ready.append(proc)
            except (EOFError, OSError, pickle.UnpicklingError) as exc:
                log.warning("verify worker %d did not start (%s): verifying on threads", proc.popen.pid, exc)
                self.lost += 1
                proc.end(timeout=1)
        return ready

    async def close(self) -> None:
        """Stop every worker once its exchange in progress is done (stdin closed; killed
        after 5 s) and wait for them to exit."""
        self._closed = True
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        procs, self._procs = self._procs, []
        loop = asyncio.get_running_loop()

        async def end(proc: _Proc) -> None:
            async with proc.lock:
                await loop.run_in_executor(self._io, proc.end, 5.0)

        await asyncio.gather(*(end(proc) for proc in procs))
        self._io.shutdown(wait=True)


def _encode(raws: Sequence[Any]) -> tuple[list[int], list[Any]]:
    """(kinds, items) sent to a worker for `raws`: a parsed container as its orjson text."""
    kinds, items = [], []
    for raw in raws:
        if isinstance(raw, dict):
            try:
                items.append(orjson.dumps(raw))
                kinds.append(_ORJSON_TEXT)
                continue
            except orjson.JSONEncodeError:
                pass  # not JSON orjson can write (a huge integer): sent as the object itself
        items.append(bytes(raw) if isinstance(raw, BYTES_LIKE) else raw)  # msgspec.Raw does not pickle
        kinds.append(_AS_SENT)
    return kinds, items


def _verdict(item: tuple, raw: Any, sent: Any) -> VerifyResult:
    """A worker's compact verdict as the VerifyResult `Node.ingest` uses. An accepted
    container's full form is the node's parsed object (or the bytes sent parsed again,
    as the verifier parsed them: loads_strict returns orjson's value); a rejected one
    carries none (ingest reads only its DID, reason and detail). `sent`: what `_encode`
    sent for `raw` (the `body` an (offset, length) in it refers to)."""
    ok, reason, detail, did, expired, saf, revoked_later, pin, payload, body = item
    if type(body) is tuple:
        body = sent[body[0]:body[0] + body[1]]
    container = None
    if ok:
        doc = raw if isinstance(raw, dict) else orjson.loads(sent)
        container = doc if "hmp_container" in doc else {"hmp_container": doc}
    return VerifyResult(ok, reason, detail, did, expired=expired, store_and_forward=frozenset(saf),
                        key_revoked_later=revoked_later, pin_candidate=pin, container=container, payload=payload,
                        body=body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
