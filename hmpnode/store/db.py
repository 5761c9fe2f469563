"""The node's SQLite database: one writer thread that batches transactions, and
a small pool of reader threads. Blocking database work never runs on the event
loop; WAL lets readers proceed while the writer commits.

Durability: a write's future resolves only after its transaction has committed
(with `synchronous=FULL` by default, after the WAL is fsynced), so whatever the
node acknowledged survives a kill -9 and a power cut.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from hmpnode.store.schema import migrate

__all__ = ["Database", "DatabaseClosed"]

log = logging.getLogger("hmpnode.store")
T = TypeVar("T")
_STOP = object()


class DatabaseClosed(RuntimeError):
    """The database is shutting down and takes no more work."""


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'full' else 'NORMAL'}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


class Database:
    def __init__(
        self,
        path: Path,
        *,
        synchronous: str = "full",
        batch_max: int = 512,
        batch_wait_ms: float = 2.0,
        reader_threads: int = 2,
    ):
        self.path = Path(path)
        self.synchronous = synchronous
        self.batch_max = batch_max
        self.batch_wait = batch_wait_ms / 1000
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._readers = ThreadPoolExecutor(max_workers=reader_threads, thread_name_prefix="hmpnode-db-read")
        self._reader_local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        self._closed = False
        self.schema_version = 0
        self.commits = 0
        self.writes = 0

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> None:
        """Create or migrate the database and start the writer (blocking; call before serving)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = _connect(self.path, self.synchronous)
        self.schema_version = migrate(conn)
        self._writer = threading.Thread(target=self._write_loop, args=(conn,), name="hmpnode-db-write", daemon=True)
        self._writer.start()

    async def close(self) -> None:
        """Finish every queued write, then stop."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        if self._writer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._writer.join)
        self._readers.shutdown(wait=True)
        with self._reader_lock:
            for conn in self._reader_conns:
                conn.close()
            self._reader_conns.clear()

    # -- work --------------------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` inside a write transaction (shared with other queued writes,
        isolated from them by a savepoint); resolves after the commit."""
        if self._closed:
            raise DatabaseClosed("database is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((fn, loop, future))
        return await future

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise DatabaseClosed("database is closed")
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._run_read, fn)

    def _run_read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = getattr(self._reader_local, "conn", None)
        if conn is None:
            conn = _connect(self.path, self.synchronous)
            conn.execute("PRAGMA query_only=ON")
            self._reader_local.conn = conn
            with self._reader_lock:
                self._reader_conns.append(conn)
        conn.execute("BEGIN")  # one consistent snapshot for the whole read
        try:
            return fn(conn)
        finally:
            conn.execute("COMMIT")

    # -- the writer thread -------------------------------------------------------

    def _write_loop(self, conn: sqlite3.Connection) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                break
            batch = [first]
            deadline = time.monotonic() + self.batch_wait
            while len(batch) < self.batch_max:
                timeout = deadline - time.monotonic()
                try:
                    item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
            self._commit_batch(conn, batch)
        conn.close()

    def _commit_batch(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        outcomes: list[tuple[bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for fn, _loop, _future in batch:
                conn.execute("SAVEPOINT op")
                try:
                    outcomes.append((True, fn(conn)))
                    conn.execute("RELEASE op")
                except Exception as exc:  # one failing write must not sink its batch-mates
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    outcomes.append((False, exc))
            conn.execute("COMMIT")
            self.commits += 1
            self.writes += len(batch)
        except Exception as exc:  # the commit itself failed (disk full, I/O error): nothing is durable
            log.error("write transaction failed: %s", exc)
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            outcomes = [(False, exc)] * len(batch)
        for (fn, loop, future), (ok, value) in zip(batch, outcomes, strict=True):
            try:
                loop.call_soon_threadsafe(_settle, future, ok, value)
            except RuntimeError:  # the caller's loop is gone (shutdown); the data is committed
                pass


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
