"""Full-text indexing after the commit (issue 15).

The ingest transaction stores containers only; this indexer adds their FTS rows
shortly after, in transactions of its own: a batching window of `delay` seconds
after the first new commit, then every row above its watermark, `batch` rows per
step. The text is extracted on a reader thread, from the parsed container the
ingest handed over (`committed(..., fresh)`, at most 2 x `batch` of them held), else
read back from the store; the writer thread only inserts it (FTS5 tokenizing), so an
acknowledgement never waits for the index (it was a fifth of the writer's time, and
the text extraction ran in the writer).

What it guarantees:
- a search or recall sees everything committed before it began: it calls
  `caught_up()`, which cuts the batching window short and returns once the
  watermark reached the newest seq committed when it was called;
- nothing committed stays unindexed: the watermark lives in memory only; at start
  the node indexes every held row that has no FTS row (`step` from 0, the old
  backlog scan), so a crash between a commit and its indexing is repaired there;
- a row forgotten between the read of its text and the write is not indexed
  again (`index_rows(..., held_only=True)`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from hmpnode.store import search as search_db
from hmpnode.store.db import Database
from hmpnode.store.marker import high_seq
from hmpnode.store.records import get_by_seq

__all__ = ["Indexer"]

log = logging.getLogger("hmpnode.store")


class Indexer:
    def __init__(self, db: Database, text_of: Callable[[dict[str, Any], str, Any], tuple[str, str, str]], *,
                 delay: float, batch: int):
        self.db = db
        self.text_of = text_of
        self.delay = delay
        self.batch = batch
        #: every held row with a seq at or below it is indexed
        self.indexed = 0
        #: the newest seq known committed
        self.target = 0
        #: steps run, rows indexed (status)
        self.steps = 0
        self.rows = 0
        self._due = asyncio.Event()
        self._now = asyncio.Event()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        #: seq -> (hmp_container, source, opened payload or None) of rows committed, not indexed
        self._fresh: dict[int, tuple[dict[str, Any], str, Any]] = {}

    async def step(self, after: int) -> int:
        """Index up to `batch` unindexed held rows above seq `after`; returns the seq
        up to which every held row is now indexed."""
        batch, fresh, text_of = self.batch, self._fresh, self.text_of

        def read(conn):
            top = high_seq(conn)
            span = range(after + 1, min(top, after + batch) + 1)
            if span and all(s in fresh for s in span):
                # every row above the watermark was handed over as it was stored: none of
                # them is indexed yet (only this task indexes, one step at a time, from its
                # watermark up), so no look into the index per row
                seqs = list(span)
            else:
                seqs = search_db.unindexed(conn, after, batch)
            handed = {s: fresh.pop(s) for s in seqs if s in fresh}  # dict.pop: atomic under the GIL
            rows = [(s, *text_of(*handed[s])) for s in seqs if s in handed]
            rows += [(r.seq, *text_of(r.hmp_container, r.source, None))
                     for r in get_by_seq(conn, [s for s in seqs if s not in handed])]
            return rows, seqs[-1] if len(seqs) == batch else max(top, after)

        rows, reached = await self.db.read(read)
        for seq in [s for s in self._fresh if s <= reached]:  # forgotten, conflict: not indexed
            del self._fresh[seq]
        if rows:
            await self.db.write(lambda conn: search_db.index_rows(conn, rows, held_only=True))
        self.steps += 1
        self.rows += len(rows)
        return reached

    async def catch_up_from(self, after: int) -> None:
        """Index every unindexed held row above `after` now (at start: the repair)."""
        while True:
            reached = await self.step(after)
            if reached <= after:
                break
            after = reached
        self.indexed = self.target = max(self.target, after)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop after the step in progress (no cancel: Python 3.11's wait_for could swallow
        one, and stop then waited forever)."""
        if self._task is not None:
            self._stopping = True
            self._due.set()
            self._now.set()
            await self._task
            self._task = None
        self._settle(everyone=True)
        self._fresh.clear()

    def committed(self, seq: int, fresh: dict[int, tuple[dict[str, Any], str, Any]] | None = None) -> None:
        """Rows up to `seq` were committed (after each ingest commit); `fresh`: seq ->
        (hmp_container, source, opened payload or None) of the stored ones, kept (while
        fewer than 2 x batch are) so that the indexer need not read them back."""
        if fresh and len(self._fresh) < 2 * self.batch:
            self._fresh.update(fresh)
        if seq > self.target:
            self.target = seq
            self._due.set()

    @property
    def lag(self) -> int:
        """Seqs committed but not indexed yet."""
        return max(0, self.target - self.indexed)

    async def caught_up(self) -> None:
        """Return once everything committed so far is indexed (at once when it is)."""
        target = self.target
        if self.indexed >= target or self._task is None:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        self._now.set()
        self._due.set()
        await future

    def _settle(self, everyone: bool = False) -> None:
        keep = []
        for target, future in self._waiters:
            if everyone or self.indexed >= target:
                if not future.done():
                    future.set_result(None)
            else:
                keep.append((target, future))
        self._waiters = keep

    async def _run(self) -> None:
        while not self._stopping:
            await self._due.wait()
            self._due.clear()
            if not self._waiters and self.delay > 0 and not self._stopping:  # gather more rows into one step
                now = asyncio.ensure_future(self._now.wait())
                await asyncio.wait({now}, timeout=self.delay)
                now.cancel()
            self._now.clear()
            try:
                while self.indexed < self.target and not self._stopping:
                    reached = await self.step(self.indexed)
                    if reached <= self.indexed:  # nothing above it is committed (cannot happen: bounded anyway)
                        break
                    self.indexed = reached
                    self._settle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store failed (disk full, closing): searches must not hang on it
                log.error("full-text indexing failed: %s; retried with the next commit", exc)
                self._settle(everyone=True)
