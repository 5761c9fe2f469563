"""The node's SQLite database: one writer thread that batches transactions, and
a small pool of reader threads. Blocking database work never runs on the event
loop; WAL lets readers proceed while the writer commits.

Durability: a write's future resolves only after its transaction has committed
(with `synchronous=FULL` by default, after the WAL is fsynced), so whatever the
node acknowledged survives a kill -9 and a power cut.

Disk full (SQLITE_FULL): SQLite may roll back the whole open transaction from
inside one write, so the writer checks `in_transaction` before touching that
write's savepoint (it used to log "no such savepoint: op"); every write of the
batch then fails with `StorageFull` (nothing of it was stored or acknowledged),
the log says "disk full" once per episode (again every FULL_LOG_EVERY seconds
while it lasts) and says when writes work again. The writer thread carries on:
the next batch simply tries again, so freeing space is all it takes.
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

from hmpnode.store.records import sql_functions
from hmpnode.store.schema import migrate

__all__ = ["Database", "DatabaseClosed", "StorageFull", "FULL_LOG_EVERY"]

log = logging.getLogger("hmpnode.store")
T = TypeVar("T")
_STOP = object()


class DatabaseClosed(RuntimeError):
    """The database is shutting down and takes no more work."""


class StorageFull(sqlite3.OperationalError):
    """SQLITE_FULL: the disk (or the database's page limit) is full. Nothing of the
    write was stored; the same write can succeed once space is freed."""


#: seconds between "disk full" log lines while the disk stays full
FULL_LOG_EVERY = 30.0

#: SQLite virtual machine steps a read on the event loop may take per row it may return
#: (Database.read_small) before it is moved to a reader thread: a list row with its
#: blocks takes ~50 (a 50-row page ~2 500), a GET under 100; more means the query skips
#: rows it does not return
LOOP_READ_STEPS_PER_ROW = 100

#: MiB of page cache of the writer's connection (SQLite's default is 2 MiB, 128 pages of 16 KiB).
#: At 100 000 stored the pages an ingest commit touches (the random `did_key` index's leaves,
#: the FTS5 segments being merged, the tails of the other indexes) no longer fit in 2 MiB: each
#: miss is a read of a page from the WAL or the database file, and dirty pages spilled to the
#: WAL mid-transaction are written again later (issue 15: 30 KB read and 24 KB written per
#: container with 2 MiB, 8 KB and 19 KB with 64; docs/benchmarks-journal.md). Memory is taken only as
#: pages are used; the one writer connection has it, not the readers.
WRITER_CACHE_MIB = 64
#: page size of a new store (store.page_size) and GET rows read on the loop (store.loop_read_rows)
PAGE_SIZE = 16384
LOOP_READ_ROWS = 1


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, StorageFull):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(exc, sqlite3.Error) and code is not None:
        return code & 0xFF == sqlite3.SQLITE_FULL
    return isinstance(exc, sqlite3.OperationalError) and "database or disk is full" in str(exc)


def _connect(path: Path, synchronous: str, page_size: int | None = None) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    if page_size is not None:  # takes effect on a new, empty database only (before WAL is on)
        conn.execute(f"PRAGMA page_size={int(page_size)}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'full' else 'NORMAL'}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=30000")
    sql_functions(conn)
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
        page_size: int | None = PAGE_SIZE,
        loop_read_rows: int = LOOP_READ_ROWS,
        writer_cache_mib: int = WRITER_CACHE_MIB,
    ):
        self.path = Path(path)
        self.synchronous = synchronous
        #: the page size a new store is created with (None: SQLite's default)
        self.page_size = page_size
        #: the writer connection's page cache (store.writer_cache_mib)
        self.writer_cache_mib = writer_cache_mib
        self.batch_max = batch_max
        self.batch_wait = batch_wait_ms / 1000
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._readers = ThreadPoolExecutor(max_workers=reader_threads, thread_name_prefix="hmpnode-db-read")
        self._reader_local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        #: reads of at most this many rows may run on the event loop (read_small); 0: never
        self.loop_read_rows = loop_read_rows
        self._loop_conn: sqlite3.Connection | None = None
        self._loop_steps = 0
        self.loop_reads = self.loop_reads_moved = 0
        self._closed = False
        self.schema_version = 0
        self.commits = 0
        self.writes = 0
        #: writes refused because the disk was full; the monotonic time of the
        #: current episode's last "disk full" log line (None: not full)
        self.full_refused = 0
        self._full_logged: float | None = None
        self._full_episode = 0

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> None:
        """Create or migrate the database and start the writer (blocking; call before serving)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = _connect(self.path, self.synchronous, self.page_size)
        conn.execute(f"PRAGMA cache_size=-{int(self.writer_cache_mib) * 1024}")  # negative: KiB
        self.schema_version = migrate(conn)
        if self.loop_read_rows > 0:  # opened here, off the loop: never on the first GET
            self._loop_conn = self._reader_conn(busy_timeout_ms=0)
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
        if self._loop_conn is not None:
            self._loop_conn.close()
            self._loop_conn = None
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

    async def checkpoint_truncate(self) -> tuple[int, int, int]:
        """Copy the WAL into the database and truncate it to zero bytes (old page images,
        e.g. of deleted rows, leave the WAL file), on a short-lived connection of its
        own, off the event loop; waits for readers and the writer (busy_timeout).
        Returns SQLite's (busy, log frames, checkpointed frames)."""
        if self._closed:
            raise DatabaseClosed("database is closed")

        def run() -> tuple[int, int, int]:
            conn = _connect(self.path, self.synchronous)
            try:
                return tuple(conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())
            finally:
                conn.close()

        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def read(self, fn: Callable[[sqlite3.Connection], T], *, snapshot: bool = True) -> T:
        """Run `fn(conn)` in a reader thread, inside one read transaction (one consistent
        snapshot for all its statements). `snapshot=False` for an `fn` of ONE statement
        (itself a snapshot): saves the BEGIN and COMMIT, each a GIL release and re-take."""
        if self._closed:
            raise DatabaseClosed("database is closed")
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._run_read, fn, snapshot)

    async def read_small(self, fn: Callable[[sqlite3.Connection], T], rows: int) -> T:
        """`read(fn, snapshot=False)` for a read of ONE statement returning at most `rows`
        rows (a GET, a short list page), run right here on the event loop on a read-only
        connection of its own when `rows` <= `loop_read_rows`: a reader thread costs two
        thread hand-offs (to the thread and back to the loop), each a wake-up and a wait
        for the GIL, which while the node ingests can wait behind a busy thread (issue
        15: idle, the round trip was most of a GET's 65 us). Only small reads: every
        row stepped through lets go of the GIL, and the loop waits to get it back. So
        that the loop is never held by a read that turns out long (a filter that skips
        many rows), SQLite interrupts it after LOOP_READ_STEPS_PER_ROW virtual machine
        steps per row and it runs again in a reader thread; so does one that finds the
        database busy (the loop's connection does not wait: busy_timeout 0)."""
        if self._closed:
            raise DatabaseClosed("database is closed")
        if rows > self.loop_read_rows:
            return await self.read(fn, snapshot=False)
        conn = self._loop_conn
        if conn is None:  # not opened (open() not called, or no loop reads)
            return await self.read(fn, snapshot=False)
        budget = LOOP_READ_STEPS_PER_ROW * (rows + 1)
        # the handler runs every `budget` steps of a statement's running count, which
        # goes on from its last run: its first call may come early, its second cannot
        self._loop_steps = 0

        def over() -> bool:
            self._loop_steps += 1
            return self._loop_steps >= 2

        conn.set_progress_handler(over, budget)
        try:
            out = fn(conn)
        except sqlite3.OperationalError:  # interrupted (above), or busy: the reader waits if need be
            self.loop_reads_moved += 1
            return await self.read(fn, snapshot=False)
        finally:
            conn.set_progress_handler(None, 0)
        self.loop_reads += 1
        return out

    def _reader_conn(self, busy_timeout_ms: int = 30_000) -> sqlite3.Connection:
        """A read-only connection: a reader thread's, or the event loop's (which never
        waits for a lock: busy_timeout 0, a busy read moves to a reader thread)."""
        conn = _connect(self.path, self.synchronous)
        conn.execute("PRAGMA query_only=ON")
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        return conn

    def _run_read(self, fn: Callable[[sqlite3.Connection], T], snapshot: bool = True) -> T:
        conn = getattr(self._reader_local, "conn", None)
        if conn is None:
            conn = self._reader_local.conn = self._reader_conn()
            with self._reader_lock:
                self._reader_conns.append(conn)
        if not snapshot:
            return fn(conn)
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

    @property
    def closed(self) -> bool:
        """Whether close() began: no write is taken any more."""
        return self._closed

    @property
    def full(self) -> bool:
        """Whether the last write failed because the disk was full."""
        return self._full_logged is not None

    def _storage_full(self, exc: BaseException, refused: int) -> StorageFull:
        full = exc if isinstance(exc, StorageFull) else StorageFull(
            f"disk full: the store {self.path} cannot grow ({exc}); nothing of this write was stored")
        self.full_refused += refused
        self._full_episode += refused
        now = time.monotonic()
        if self._full_logged is None or now - self._full_logged >= FULL_LOG_EVERY:
            log.error("disk full: cannot write to the store %s (%s); %d write(s) refused so far, none of them "
                      "acknowledged; writes resume once space is freed", self.path, exc, self._full_episode)
            self._full_logged = now
        return full

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
                    if not conn.in_transaction:
                        # SQLite rolled the whole transaction back (SQLITE_FULL, I/O error):
                        # the batch-mates' work is gone too, and so is the savepoint
                        raise
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    outcomes.append((False, self._storage_full(exc, 1) if _is_full(exc) else exc))
            conn.execute("COMMIT")
            self.commits += 1
            self.writes += len(batch)
            if self._full_logged is not None and not any(_is_full(v) for ok, v in outcomes if not ok):
                log.warning("disk space again: writes to the store %s work again after %d refused",
                            self.path, self._full_episode)
                self._full_logged, self._full_episode = None, 0
        except Exception as exc:  # nothing of the batch is durable (disk full, I/O error)
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            if _is_full(exc):
                exc = self._storage_full(exc, len(batch))
            else:
                log.error("write transaction failed: %s", exc)
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
