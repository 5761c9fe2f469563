"""The container index on request (spec 12.9; docs/protocol.md 31): answering a peer's
index request out of the store, and asking connected peers (`query_index`, the API's
`versions?mesh=1` and peer index views).

A node feature on top of the sessions: a session parses and budgets the frames
(`PeerSession.ask_index`, `answer_index`, the `Index*` events), `hmpnode.net.index`
decides what a page holds; this module reads the store and waits for the answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import nacl.utils

from hmpnode.net import index as IX
from hmpnode.net import session as SE
from hmpnode.net.session import PeerSession
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.host import Host
    from hmpnode.net.link import Link

__all__ = ["IndexQueries", "IndexAnswer", "read_index_page"]


class IndexQueries:
    """The index requests of this node: answered, and asked (one wait per peer and request)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        #: (peer DID, request DID) -> the answer being collected for `query_index`
        self._waits: dict[tuple[str, str], IndexAnswer] = {}


    async def on_requested(self, link: Link, event: SE.IndexRequested) -> None:
        """Answer a peer's index request (`read_index_page`), or count its refusal. The
        read's CPU time is charged to the peer's verification budget, as its frames'
        checks are: a peer asking for costly pages has its next frames wait."""
        if event.refusal is not None or event.query is None:
            self.host.node.refuse("index", event.refusal or "declined")
            return
        session, query = link.session, event.query
        now = self.host.node.now()

        def read(conn):
            started = time.thread_time()
            return read_index_page(conn, session, query, now, self.host.core.is_revoked), \
                time.thread_time() - started

        page, cpu = await self.host.node.db.read(read)
        session.charge_cpu(time.monotonic(), cpu)
        session.answer_index(event.request, page, now, ignored=query.ignored)

    async def on_entries(self, link: Link, event: SE.IndexEntries) -> None:
        wait = self._waits.get((link.did, event.request))
        if wait is not None:
            wait.entries.update(event.entries)

    async def on_done(self, link: Link, event: SE.IndexDone) -> None:
        wait = self._waits.get((link.did, event.request))
        if wait is not None and not wait.done.done():
            if wait.status != "processed":  # a later page declined keeps the pages answered before
                wait.status = event.status
            wait.complete, wait.cursor, wait.reason = event.complete, event.cursor, event.reason
            wait.done.set_result(None)

    async def query_index(self, selections: Sequence[dict[str, Any]], *, timeout: float | None = None,
                          limit: int | None = None, to: Sequence[str] | None = None,
                          after: str | None = None, pages: int = 1) -> list[IndexAnswer]:
        """Ask at most index_query_peers connected peers (those of `to` only, when given)
        for the index entries that match `selections`, from cursor `after`, following each
        peer's cursor for up to `pages` pages, and wait at most `timeout` in all
        (index_query_seconds): one IndexAnswer per peer asked, `status` None when it did not
        answer in time (what came meanwhile is kept, `complete` false)."""
        links = [link for link in self.host.sessions.values() if not link.closed and (to is None or link.did in to)]
        links = links[:self.host.settings.mesh.index_query_peers]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.host.settings.mesh.index_query_seconds if timeout is None else max(timeout, 0))
        pending: dict[asyncio.Future, tuple[Link, IndexAnswer, tuple[str, str]]] = {}

        async def ask(link: Link, answer: IndexAnswer, cursor: str | None) -> None:
            request = link.session.ask_index(selections, self.host.node.now(), limit=limit, after=cursor,
                                             nonce=nacl.utils.random(8).hex())
            answer.done, answer.pages = loop.create_future(), answer.pages + 1
            self._waits[(link.did, request)] = answer
            pending[answer.done] = (link, answer, (link.did, request))
            await link.flush()

        answers = []
        for link in links:
            answers.append(IndexAnswer(link.did, loop.create_future()))
            await ask(link, answers[-1], after)
        try:
            while pending and loop.time() < deadline:
                done, _ = await asyncio.wait(list(pending), timeout=deadline - loop.time(),
                                             return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    link, answer, key = pending.pop(future)
                    self._waits.pop(key, None)
                    if (answer.status == "processed" and not answer.complete and answer.cursor
                            and answer.pages < pages and not link.closed):
                        await ask(link, answer, answer.cursor)  # the next page (its status stays meanwhile)
        finally:
            for future, (_, _, key) in pending.items():
                self._waits.pop(key, None)
                future.cancel()
        self.host.counters["index_queries"] += 1
        return answers


def read_index_page(conn, session: PeerSession, query: IX.IndexQuery, now: datetime,
                    revoked: Callable[[db.StoredContainer], bool] = lambda row: False) -> IX.Page:
    """One answer to `session`'s peer out of the store (on its read thread): at most
    index_scan rows after the cursor (narrowed in SQL by a single selection), read in
    chunks of about a page (loading a row's body is most of the cost: a full page stops
    the reading), of which those that match and that the peer may be sent (`may_receive`,
    as gossip, and not `revoked`: what is not served is not listed either, 32) make the page."""
    limit, now_us, prefilter = session.index_limit(query), db.to_us(now), query.prefilter()
    chunk = max(limit, 100)
    read = {"left": session.limits.index_scan, "ended": False}

    def rows():
        after = query.after
        while read["left"] > 0:
            want = min(read["left"], chunk)
            got = db.list_containers(conn, db.ListQuery(**prefilter, after_seq=after, limit=want), now_us)
            read["left"] -= len(got)
            yield from got
            if len(got) < want:
                read["ended"] = True
                return
            after = got[-1].seq

    return IX.page(rows(), query,
                   eligible=lambda row: session.may_receive(row.hmp_container["head"], now) and not revoked(row),
                   entry=lambda row: IX.entry_of(row.hmp_container, db.backlinks_of(conn, row.did),
                                                 db.evaluations_of(conn, row.did)),
                   limit=limit, max_bytes=session.limits.max_frame_bytes // 2, more=lambda: not read["ended"])


@dataclass(eq=False)
class IndexAnswer:
    """One peer's answer to `IndexQueries.query_index`: its entries, and how it closed the answer
    (`status` processed/declined/unknown, None: no answer in time; `complete`: the end
    of what matched was reached)."""

    peer: str
    done: asyncio.Future
    entries: dict[str, Any] = field(default_factory=dict)
    status: str | None = None
    complete: bool = False
    cursor: str | None = None
    reason: str | None = None
    #: requests made for it (one per page)
    pages: int = 0
