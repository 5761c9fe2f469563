"""The node: one agent's verified, durable container store and its upkeep.

Every container, from the agent or (later) from a peer, takes the same path,
`Node.ingest`:

    verify (container core, node key registry; on worker threads)
      -> deduplicate -> store -> record links -> pin keys / record revocations
      -> evaluations and backlink reports carried in the full form
      -> commit (durable) -> wake event subscribers

The node's own identity signs what the agent creates, its evaluations and the
referenced-by blocks it serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import nacl.utils
import orjson

from hmpnode import consensus as cons
from hmpnode import trust as trust_mod
from hmpnode import verifyprocs
from hmpnode.container import reasons as R
from hmpnode.container.backlinks import build_referenced_by, merge_referenced_by
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import format_time, parse_time, sha256_tag
from hmpnode.container.evaluations import build_evaluation, evaluations_block, kept_form, verify_evaluation
from hmpnode.container import inflight
from hmpnode.container.peek import head_view
from hmpnode.container.payload import PayloadError, open_payload, parse_payload_type
from hmpnode.container.schema import default_schemas
from hmpnode.container.verify import Limits, Verifier, VerifyResult
from hmpnode.identity import Identity
from hmpnode.store import Database
from hmpnode.store.db import LOOP_READ_ROWS, PAGE_SIZE, WRITER_CACHE_MIB
from hmpnode.store import records as db
from hmpnode.store import forget as forget_db
from hmpnode.store import search as search_db
from hmpnode.store import consensus as consensus_db
from hmpnode.store.indexer import Indexer
from hmpnode.memory import journal
from hmpnode.memory import recall as recall_mod
from hmpnode.memory.tokens import count_json_tokens
from hmpnode.net import index as IX
from hmpnode.memory.index import fts_any, fts_query, query_terms, recall_terms, searchable

__all__ = ["Node", "IngestResult", "NodeError", "Keep", "utc_now"]

log = logging.getLogger("hmpnode.node")


@functools.lru_cache(maxsize=64)
def _second_text(second: int) -> str:
    moment = datetime.fromtimestamp(second, timezone.utc)
    return f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:{moment.minute:02d}:{moment.second:02d}"


def received_text(us: int) -> str:
    """A stored `received_us` as `describe` shows it (ISO 8601, microseconds when there
    are any, Z): from the integer exactly, the seconds' text cached (a list's rows
    mostly share a few seconds; datetime formatting was ~2 us per row)."""
    second, micro = divmod(us, 1_000_000)
    return f"{_second_text(second)}.{micro:06d}Z" if micro else f"{_second_text(second)}Z"


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class NodeError(Exception):
    """A request the node refuses; `reason` is a stable code, `status` an HTTP status."""

    def __init__(self, reason: str, detail: str, status: int = 400):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.status = status


@dataclass(slots=True)
class IngestResult:
    status: str  # stored | duplicate | conflict | rejected
    did: str | None = None
    reason: str | None = None
    detail: str = ""
    seq: int | None = None
    expired: bool = False
    store_and_forward: list[str] = field(default_factory=list)
    evaluations: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        # one dict literal (an import answers up to max_batch of these on the event loop)
        if self.status == "rejected":
            out = {"status": self.status, "did": self.did, "reason": self.reason, "detail": self.detail}
        else:
            out = {"status": self.status, "did": self.did, "seq": self.seq, "expired": self.expired,
                   "store_and_forward": self.store_and_forward}
        if self.evaluations:
            out["evaluations"] = self.evaluations
        return out


@dataclass(frozen=True, slots=True)
class Keep:
    """Node-local labels of what the agent stores (hmpnode.store.forget): the source
    it names (forget --source finds it) and the scope the container joins."""

    source: str | None = None
    scope: str | None = None


class _NodeRegistry(verifyprocs.LoggedKeyRegistry):
    """The key registry verification sees: pins and revocations from the database,
    updated after each commit. Reads are plain dict lookups (thread-safe); changes
    are logged for the verify worker processes."""

    def load(self, pins: dict[str, bytes], revoked_us: dict[str, int]) -> None:
        self._pins.update(pins)
        for did, at in revoked_us.items():
            self._revoked[did] = datetime.fromtimestamp(at / 1e6, timezone.utc)
        self.changes.extend([*pins, *revoked_us])


class Node:
    def __init__(
        self,
        identity: Identity,
        data_dir: Path,
        *,
        limits: Limits = Limits(),
        synchronous: str = "full",
        batch_max: int = 512,
        batch_wait_ms: float = 2.0,
        reader_threads: int = 2,
        page_size: int = PAGE_SIZE,
        writer_cache_mib: int = WRITER_CACHE_MIB,
        loop_read_rows: int = LOOP_READ_ROWS,
        index_delay_ms: float = 50.0,
        index_batch: int = 2000,
        verify_threads: int | None = None,
        verify_processes: int = 0,
        verify_process_min_batch: int = 64,
        inflight_bytes: int = 64 * 1024 * 1024,
        peer_max_decompressed_bytes: int = 4 * 1024 * 1024,
        forget_scrub: bool = True,
        recall_limits: recall_mod.RecallLimits = recall_mod.RecallLimits(),
        consensus: cons.Policy = cons.Policy(),
        clock: Callable[[], datetime] = utc_now,
        rng: Callable[[int], bytes] = nacl.utils.random,
    ):
        self.identity = identity
        self.data_dir = Path(data_dir)
        #: after a forget: rewrite the index and truncate the WAL (store.forget_scrub)
        self.forget_scrub = forget_scrub
        #: [consensus] settings: rules of new proposals, closing, trust damping
        self.consensus_policy = consensus
        self._closing = asyncio.Lock()
        #: consensus_result DIDs whose recount did not match (each counted once)
        self._mismatched_results: set[str] = set()
        self.limits = limits
        self.clock = clock
        self.rng = rng
        self.db = Database(
            self.data_dir / "hmpnode.sqlite3",
            synchronous=synchronous,
            batch_max=batch_max,
            batch_wait_ms=batch_wait_ms,
            reader_threads=reader_threads,
            page_size=page_size,
            writer_cache_mib=writer_cache_mib,
            loop_read_rows=loop_read_rows,
        )
        #: full-text indexing after the commit (store.index_delay_ms, store.index_batch)
        self.indexer = Indexer(self.db, self._searchable, delay=index_delay_ms / 1000, batch=index_batch)
        self.registry = _NodeRegistry()
        self.schemas = default_schemas()
        self._verify_pool = ThreadPoolExecutor(
            max_workers=verify_threads or verifyprocs.thread_count("auto"),
            thread_name_prefix="hmpnode-verify"
        )
        self._verifiers = threading.local()
        #: worker processes for big batches ([node] verify_processes; 0: threads only)
        self.verify_procs = verifyprocs.VerifyProcesses(verify_processes, min_batch=verify_process_min_batch,
                                                        registry=self.registry)
        #: decompressed bytes held by verifications in progress, node-wide (API and peers)
        self.inflight = inflight.ByteBudget(max(inflight_bytes, 1))
        #: what a container from a peer may expand to (the agent's own: limits.max_decompressed_bytes)
        self.peer_limits = dataclasses.replace(
            limits, max_decompressed_bytes=min(peer_max_decompressed_bytes, limits.max_decompressed_bytes))
        #: event-loop lag (seconds a 0.1 s timer fired late): the last and the largest seen
        self.loop_lag = {"last": 0.0, "max": 0.0}
        #: the largest lag since `lag_peak` was last read (the dashboard's history samples it)
        self._lag_peak = 0.0
        self._lag_task: asyncio.Task | None = None
        self._tick: asyncio.Future[None] | None = None
        self._backlink_blocks: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self.started_at = 0.0
        self.last_seq = 0
        self.counters: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        #: (area, reason) -> times the node refused work from outside (a peer, a
        #: datagram, a request) to stay within a limit; see `refuse`
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.subscribers = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._journal_lock = asyncio.Lock()
        #: from the last check of the journal: (count, highest seq) of its rows, the report
        #: of them, and the append helper (vocabulary) of that chain once an append built it
        self._journal_checked: tuple[tuple[int, int], journal.ChainReport, journal.Journal | None] | None = None
        #: HMAC key of recall plans (hmpnode.memory.recall)
        self._plan_key = identity.local_key(recall_mod.PLAN_LABEL)
        self.recall_limits = recall_limits
        #: the mesh (hmpnode.net.mesh.Mesh) when the daemon runs one
        self.mesh: Any = None
        #: called in the writer thread, inside the ingest transaction, with
        #: (conn, source, [(verdict, result), ...]) of every accepted container:
        #: what a hook writes commits together with the containers (the mesh
        #: keeps relay holdings and the outbox this way)
        self.store_hooks: list[Callable[[Any, str, list[tuple[VerifyResult, IngestResult]]], None]] = []

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.db.open)
        pins, revoked = await self.db.read(db.load_keys)
        self.registry.load(pins, revoked)
        self.last_seq = await self.db.read(lambda c: c.execute("SELECT COALESCE(MAX(seq), 0) FROM containers").fetchone()[0])
        await self._index_backlog()
        self.indexer.start()
        self._tick = loop.create_future()
        self.loop = loop
        self.started_at = time.time()
        self._lag_task = loop.create_task(self._watch_loop_lag())

    async def _watch_loop_lag(self, every: float = 0.1) -> None:
        """How late a periodic timer fires: anything that blocks the event loop (a
        parse, a check, a decompression done on it) shows here, in status and /metrics."""
        while True:
            due = time.monotonic() + every
            await asyncio.sleep(every)
            lag = max(0.0, time.monotonic() - due)
            self.loop_lag["last"] = lag
            self.loop_lag["max"] = max(self.loop_lag["max"], lag)
            self._lag_peak = max(self._lag_peak, lag)

    def lag_peak(self) -> float:
        """The largest event-loop lag since the previous call (a chart's point shows the
        worst of its interval, not one 0.1 s tick)."""
        peak, self._lag_peak = self._lag_peak, 0.0
        return peak

    def _searchable(self, hmp: dict[str, Any], source: str, opened: Any) -> tuple[str, str, str]:
        """What the full-text index holds for a stored container (hmpnode.memory.index); a
        payload not opened yet (`opened` None) is opened within its source's limit."""
        limit = (self.peer_limits if source.startswith("peer:") else self.limits).max_decompressed_bytes
        return searchable(hmp, self.identity, opened, max_bytes=limit)

    async def _index_backlog(self) -> None:
        """Index every held row without an index row: stored before the index existed (an
        older version), or committed just before a crash, before the indexer reached it."""
        await self.indexer.catch_up_from(0)

    async def stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
        await self.indexer.stop()
        await self.db.close()
        await self.verify_procs.close()
        self._verify_pool.shutdown(wait=True)
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(None)

    def now(self) -> datetime:
        return self.clock()

    def now_us(self) -> int:
        return db.to_us(self.clock())

    # -- ingest ----------------------------------------------------------------------

    def changed(self) -> asyncio.Future[None]:
        """Resolves when the next ingest commits new containers."""
        assert self._tick is not None
        return self._tick

    def verifier(self, limits: Limits | None = None) -> Verifier:
        """This thread's Verifier (the node's registry and schemas; the node's limits
        unless others are given)."""
        limits = limits or self.limits
        verifiers = getattr(self._verifiers, "by_limits", None)
        if verifiers is None:
            verifiers = self._verifiers.by_limits = {}
        verifier = verifiers.get(limits)
        if verifier is None:
            verifier = verifiers[limits] = Verifier(registry=self.registry, schemas=self.schemas, limits=limits)
        return verifier

    def _verify_many(self, raws: Sequence[Any], costs: Sequence[int], now: datetime,
                     limits: Limits, from_peer: bool = False) -> tuple[list[VerifyResult], float]:
        """In a verify thread: verify each container while holding its decompressed cost
        from the node-wide budget; keep only the (bounded) index text of an opened
        payload, never the payload. Returns the results and the thread's CPU seconds."""
        verifier = self.verifier(limits)
        started = time.thread_time()
        out = []
        for raw, cost in zip(raws, costs, strict=True):
            cost = min(cost, self.inflight.capacity)
            self.inflight.acquire(cost)
            try:
                verdict = verifier.verify(raw, now=now, from_peer=from_peer)
                verifyprocs.index_payload(verdict)
            finally:
                self.inflight.release(cost)
            out.append(verdict)
        return out, time.thread_time() - started

    async def offload(self, fn: Callable[..., Any], *args: Any,
                      on_cpu: Callable[[float], None] | None = None) -> Any:
        """Run `fn(*args)` on a verify thread (off the event loop); `on_cpu` is told
        the thread CPU seconds it took (a peer's verification budget)."""
        def timed():
            started = time.thread_time()
            try:
                return fn(*args)
            finally:
                if on_cpu is not None:
                    spent = time.thread_time() - started
                    loop.call_soon_threadsafe(on_cpu, spent)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._verify_pool, timed)

    async def _verify(self, raws: Sequence[Any], costs: Sequence[int], limits: Limits,
                      from_peer: bool = False) -> tuple[list[VerifyResult], float]:
        """Verify in order: a big batch in the verify worker processes (every core; the
        GIL holds the Python parts of verification), anything else, or while no worker
        is ready, on the verify threads (libsodium releases the GIL)."""
        now = self.now()
        if self.verify_procs.wants(len(raws)):
            done = await self.verify_procs.verify(
                raws, costs, now, limits, from_peer, self.inflight,
                lambda part, part_costs: self._verify_threads(part, part_costs, now, limits, from_peer))
            if done is not None:
                return done
        return await self._verify_threads(raws, costs, now, limits, from_peer)

    async def _verify_threads(self, raws: Sequence[Any], costs: Sequence[int], now: datetime, limits: Limits,
                              from_peer: bool) -> tuple[list[VerifyResult], float]:
        loop = asyncio.get_running_loop()
        workers = self._verify_pool._max_workers
        if len(raws) < 8 or workers == 1:
            return await loop.run_in_executor(self._verify_pool, self._verify_many, raws, costs, now, limits, from_peer)
        size = -(-len(raws) // workers)
        parts = await asyncio.gather(*(
            loop.run_in_executor(self._verify_pool, self._verify_many, raws[i:i + size], costs[i:i + size], now, limits,
                                 from_peer)
            for i in range(0, len(raws), size)
        ))
        return [r for part, _ in parts for r in part], sum(cpu for _, cpu in parts)

    async def ingest(self, raws: Sequence[bytes | str | dict[str, Any]], *, source: str = "agent",
                     budget: int | None = None, on_cpu: Callable[[float], None] | None = None,
                     keep: Keep | None = None) -> list[IngestResult]:
        """Verify and durably store containers; one result per input, in order.
        Returns after the commit: a `stored` result is on disk.

        A container from a peer (`source` "peer:<did>") may expand to at most
        `peer_limits.max_decompressed_bytes`; `budget` bounds the decompressed bytes
        of the whole batch (an API import, a peer's frame). What goes over is
        rejected (`decompressed_too_large`, `over_budget`) before any decompression
        and counted by `refuse`. `on_cpu` is told the verification CPU seconds spent.
        A container whose DID the agent forgot is refused (`forgotten`), never stored
        again. `keep` (the agent's own only) labels what is stored with a source and a
        scope, in the same transaction. A parsed container whose DID and signature the
        store holds is answered `duplicate` before verification (`_answer_held`)."""
        peer = source.startswith("peer:")
        limits = self.peer_limits if peer else self.limits
        item_limit = limits.max_decompressed_bytes
        results: list[IngestResult | None] = [None] * len(raws)
        # what is read before verification, read once (parsed input as it is; bytes: the few fields, peek.py)
        views = await in_slices(head_view, raws)
        held_seqs = await self._answer_held(views, results)
        pending = [i for i, r in enumerate(results) if r is None]
        costs = dict(zip(pending, await in_slices(
            lambda i: inflight.decompressed_cost(raws[i] if views[i] is None else views[i], item_limit), pending),
            strict=True))
        plan = dict(zip(pending, inflight.plan_batch([costs[i] for i in pending], item_limit=item_limit,
                                                     batch_budget=budget if budget is not None else sum(costs.values())),
                        strict=True))
        todo = [i for i, refusal in plan.items() if refusal is None]
        self.counters["verified"] += len(todo)
        for i, refusal in plan.items():
            if refusal is not None:
                self.refuse("peer" if peer else "import", refusal)
                detail = (f"the payload expands to {costs[i]} bytes; at most {item_limit} are accepted"
                          + (" from a peer" if peer else "")) if refusal == inflight.DECOMPRESSED_TOO_LARGE \
                    else f"the batch may expand to at most {budget} bytes in all; this container does not fit"
                results[i] = IngestResult("rejected", _did_of(views[i]), refusal, detail)
        verdicts, cpu = await self._verify([raws[i] for i in todo], [costs[i] for i in todo], limits, peer) \
            if todo else ([], 0.0)
        if on_cpu is not None:
            on_cpu(cpu)
        accepted: list[tuple[int, VerifyResult]] = []
        for i, verdict in zip(todo, verdicts, strict=True):
            if verdict.ok:
                accepted.append((i, verdict))
            else:
                self.rejections[verdict.reason or R.MALFORMED] += 1
                results[i] = IngestResult("rejected", verdict.container_did, verdict.reason, verdict.detail)
        del verdicts
        if accepted or (held_seqs and keep is not None):
            now_us = self.now_us()
            stored = await self.db.write(lambda conn: self._store_batch(conn, accepted, source, now_us, keep,
                                                                        held_seqs))
            pins, revocations = [], []
            for i, result, pin, revocation in stored:
                results[i] = result
                if pin:
                    pins.append(pin)
                if revocation:
                    revocations.append(revocation)
            for did, key in pins:
                self.registry.pin(did, key)
            for did, at in revocations:
                self.registry.revoke(did, at)
            if revocations and self.mesh is not None:  # held containers they invalidate: removed (protocol.md 32)
                self.mesh.revoked(revocations)
            # the indexer gets the text verification took out of the payload (bounded:
            # verifyprocs.index_payload) and then needs only the head; a payload that was not
            # opened is opened there, from the container (one pass over the batch, on the loop)
            fresh = {}
            for i, v in accepted:
                result = results[i]
                if result.status == "stored" and result.seq:
                    fresh[result.seq] = (_for_index(v.container["hmp_container"], v.payload), source, v.payload)
            if fresh:
                self.last_seq = max(self.last_seq, max(fresh))
                self.indexer.committed(self.last_seq, fresh)
                self._wake()
            if peer:
                await self._recount_arrived([v for i, v in accepted if results[i].status == "stored"])
        for r in results:
            self.counters[f"ingest_{r.status}"] += 1
        return results  # type: ignore[return-value]

    async def _answer_held(self, views: Sequence[Any], results: list[IngestResult | None]) -> list[int]:
        """Skip work already done: answer `duplicate` for every container whose DID and
        signature the store holds, before it is verified
        (docs/protocol.md#rule-duplicate-before-verification), with one batched lookup in the
        `did_key` index. `views`: the inputs' `head_view`s.
        Fills `results`; returns the held seqs."""
        keys = {i: key for i, view in enumerate(views) if (key := duplicate_key(view)) is not None}
        if not keys:
            return []
        dids = list({did for did, _ in keys.values()})
        held = await self.db.read(lambda conn: db.held_of(conn, dids))
        if not held:
            return []
        answers = answer_held(keys, held, self.now_us())
        for i, result in answers.items():
            results[i] = result
        self.counters["duplicate_unverified"] += len(answers)
        return [r.seq for r in answers.values() if r.seq]

    def _store_batch(self, conn, accepted, source: str, now_us: int, local: Keep | None = None,
                     held_seqs: Sequence[int] = ()):
        """In the writer thread, inside the batch transaction. `held_seqs`: duplicates
        answered before verification, labelled with `local` like the others."""
        out = []
        keep: list[tuple[int, VerifyResult, tuple[str, bytes] | None]] = []
        gone = forget_db.forgotten_of(conn, [v.container_did for _, v in accepted])
        for i, verdict in accepted:
            if verdict.container_did in gone:  # the agent forgot it: never stored again, from anyone
                self.refuse("peer" if source.startswith("peer:") else "import", forget_db.FORGOTTEN)
                out.append((i, IngestResult("rejected", verdict.container_did, forget_db.FORGOTTEN,
                                            "this node forgot that container"), None, None))
                continue
            pin = None
            if verdict.pin_candidate is not None:
                pin_did, key = verdict.pin_candidate
                # Re-checked here: two first-seen keys for one DID may sit in one batch.
                if not db.pin_key(conn, pin_did, key, now_us):
                    self.rejections[R.KEY_MISMATCH] += 1
                    out.append((i, IngestResult("rejected", verdict.container_did, R.KEY_MISMATCH,
                                                "public_key differs from the key pinned for sender_did"), None, None))
                    continue
                pin = (pin_did, key)
            keep.append((i, verdict, pin))
        inserts = db.insert_containers(
            conn,
            [db.NewContainer(v.container["hmp_container"], v.store_and_forward, source, v.body)
             for _, v, _ in keep],
            now_us,
        )
        for (i, verdict, pin), insert in zip(keep, inserts, strict=True):
            container, status, flags = verdict.container, insert.status, verdict.store_and_forward
            result = IngestResult(status, insert.did, seq=insert.seq, expired=verdict.expired,
                                  store_and_forward=sorted(flags))
            revocation = None
            if status == "stored":
                revocation = self._revocation_in(conn, container["hmp_container"])
                for evaluated, item in insert.released_evaluations or ():
                    self._apply_evaluation(conn, evaluated, orjson.loads(item))
            if status != "conflict" and len(container) > 1:  # unsigned blocks beside hmp_container
                if isinstance(container.get("evaluations"), dict):
                    result.evaluations = self._take_evaluations(conn, insert.did, container["evaluations"])
                if isinstance(container.get("referenced-by"), dict):
                    self._take_backlinks(conn, insert.did, container["referenced-by"])
            out.append((i, result, pin, revocation))
        if local is not None:
            seqs = [*held_seqs, *(r.seq for (_, r, _, _) in out if r.status in ("stored", "duplicate") and r.seq)]
            if local.source is not None:
                forget_db.label(conn, [(seq, local.source) for seq in seqs])
            if local.scope is not None:
                forget_db.join_scope(conn, local.scope, seqs)
        if self.store_hooks:
            done = [(verdict, result) for (_, verdict, _), (_, result, _, _) in zip(keep, out[-len(keep):] if keep else [],
                                                                                     strict=True)]
            for hook in self.store_hooks:
                hook(conn, source, done)
        return out

    def _revocation_in(self, conn, hmp) -> tuple[str, datetime] | None:
        """A peer_announce with key_is_falsified revokes its sender's key (profile section 4)."""
        head, payload = hmp["head"], hmp.get("payload")
        if head["class"] == "peer_announce" and isinstance(payload, dict) and payload.get("key_is_falsified") is True:
            at = datetime.fromisoformat(head["timestamp"])
            db.revoke_key(conn, head["sender_did"], db.to_us(at))
            return head["sender_did"], at
        return None

    def _take_evaluations(self, conn, did: str, block: dict[str, Any]) -> dict[str, int]:
        tally: Counter[str] = Counter()
        items = block.get("items")
        if not isinstance(items, list):
            return {"rejected": 1}
        for item in items[:1024]:
            tally[self._apply_evaluation(conn, did, item)] += 1
        return dict(tally)

    def _apply_evaluation(self, conn, did: str, item: Any) -> str:
        """Verify an evaluation of `did` and keep it, park it or refuse it: returns
        active | superseded | pending | the reject reason."""
        if isinstance(item, dict):
            item = kept_form(item)  # unsigned extras are ignored and not kept (profile section 13)
        check = verify_evaluation(item, did, registry=self.registry, resolve=db.resolver(conn),
                                  now=self.now(), max_skew=self.limits.max_clock_skew)
        if check.pending:
            db.park_evaluation(conn, did, item)
            return "pending"
        if not check.ok:
            if isinstance(item, dict) and isinstance(item.get("signature"), str) and isinstance(item.get("agent_did"), str):
                db.drop_pending_evaluation(conn, did, item)
            return check.reason or "malformed"
        return "active" if db.put_evaluation(conn, did, item) else "superseded"

    def _take_backlinks(self, conn, did: str, block: dict[str, Any]) -> None:
        """Links another node reports for `did`: kept as hints only while the
        referencing container is not held; true ones we know already, false ones drop."""

        def confirm(relation: str, source: str, target: str) -> bool | None:
            if db.link_exists(conn, target, relation, source):
                return True
            return False if db.is_held(conn, source) else None

        merged = merge_referenced_by(did, [], [block], confirm, registry=self.registry)
        reporter = block.get("peer_did") if isinstance(block.get("peer_did"), str) else "?"
        for link in merged.pending:
            db.add_backlink_hint(conn, did, link["type"], link["target"], reporter)

    def _wake(self) -> None:
        tick, self._tick = self._tick, asyncio.get_running_loop().create_future()
        if tick is not None and not tick.done():
            tick.set_result(None)

    # -- the agent's own containers and evaluations -----------------------------------

    async def create(
        self,
        class_: str,
        payload: Any,
        *,
        encrypt_for: Sequence[Recipient] = (),
        keep: Keep | None = None,
        **options: Any,
    ) -> tuple[IngestResult, dict[str, Any]]:
        """Build and sign a container as this node's agent, then ingest it (with
        `keep`: its node-local source label and scope)."""
        try:
            container = build_container(
                self.identity, class_, payload, now=self.now().replace(microsecond=0), rng=self.rng,
                encrypt_to=list(encrypt_for) or None, schemas=self.schemas, **options,
            )
        except (ValueError, TypeError) as exc:
            raise NodeError("invalid_container", str(exc), 422) from None
        (result,) = await self.ingest([container], source="agent", keep=keep)
        return result, container

    async def evaluate(self, did: str, *, type_: str, value: float, target: str | None = None) -> dict[str, Any]:
        """Sign an evaluation of `did` as this agent and keep it as the agent's active one."""
        if not await self.db.read(lambda conn: db.is_held(conn, did)):
            raise await self._absent(did)
        try:
            item = build_evaluation(self.identity, value=value, type=type_, target=target or did, now=self.now())
        except ValueError as exc:
            raise NodeError("invalid_evaluation", str(exc), 422) from None
        status = await self.db.write(lambda conn: self._apply_evaluation(conn, did, item))
        if status not in ("active", "superseded", "pending"):
            raise NodeError(status, f"evaluation refused: {status}", 422)
        if status == "active" and self.mesh is not None:
            self.mesh.evaluated(did)
        return {"status": status, "item": item}

    async def take_blocks(self, did: str, *, referenced_by: Any = None, evaluations: Any = None) -> bool:
        """Unsigned blocks a peer reports for a held container (spec 5.6), taken
        as if they had come with the container; ignored for containers not held.
        True when an evaluation became active (the container's block changed)."""

        def write(conn):
            if not db.is_held(conn, did):
                return False
            active = 0
            if isinstance(evaluations, dict):
                active = self._take_evaluations(conn, did, evaluations).get("active", 0)
            if isinstance(referenced_by, dict):
                self._take_backlinks(conn, did, referenced_by)
            return active > 0

        return await self.db.write(write)

    async def add_evaluation(self, did: str, item: Any) -> str:
        """An item signed by another agent: verified, then kept, parked or refused."""
        if not await self.db.read(lambda conn: db.is_held(conn, did)):
            raise await self._absent(did)
        status = await self.db.write(lambda conn: self._apply_evaluation(conn, did, item))
        if status not in ("active", "superseded", "pending"):
            raise NodeError(status, f"evaluation refused: {status}", 422)
        if status == "active" and self.mesh is not None:
            self.mesh.evaluated(did)
        return status

    # -- consensus and trust (hmpnode.consensus, hmpnode.trust) ---------------------------

    async def propose(self, payload: dict[str, Any], *, deadline: datetime | None = None,
                      rules: cons.Rules | None = None, tags: Sequence[str] = ()) -> tuple[IngestResult, dict[str, Any]]:
        """Publish a `proposal` (broadcast) whose ttl is the voting deadline and whose
        payload states the rules (`consensus` member) every node counts by."""
        body = {**payload, "consensus": cons.rules_payload(rules or self.consensus_policy.rules())}
        ttl = deadline or self.now().replace(microsecond=0) + timedelta(
            seconds=self.consensus_policy.default_ttl_seconds)
        return await self.create("proposal", body, ttl=ttl, broadcast=True, tags=list(tags) or None)

    async def vote(self, did: str, value: float | bool, *, vote_type: str | None = None,
                   reason: str | None = None) -> tuple[IngestResult, dict[str, Any]]:
        """Publish this agent's `vote` on a held proposal (broadcast; a later vote replaces it)."""
        view = await self.consensus(did)
        if view["state"] != cons.OPEN:
            raise NodeError("voting_closed", f"the proposal is {view['state']}; its deadline was {view['deadline']}",
                            409)
        payload: dict[str, Any] = {"target_did": did, "vote_value": value}
        if vote_type is not None:
            payload["vote_type"] = vote_type
        if reason is not None:
            payload["arguments"] = [{"reason": reason}]
        return await self.create("vote", payload, related={"in_reply_to": [did]}, broadcast=True)

    def _open(self, stored: db.StoredContainer) -> Any:
        try:
            return open_payload(stored.hmp_container, self.identity, max_bytes=self.limits.max_decompressed_bytes)
        except PayloadError:
            return None

    def _proposal(self, stored: db.StoredContainer) -> cons.Proposal:
        return cons.proposal_from(stored.did, stored.hmp_container["head"], self._open(stored))

    def _votes(self, stored: list[db.StoredContainer]) -> tuple[dict[str, cons.Vote | None], list[dict[str, Any]]]:
        """Readable votes by DID (None: not a usable vote) and why the others are unusable."""
        out: dict[str, cons.Vote | None] = {}
        bad = []
        for s in stored:
            try:
                out[s.did] = cons.vote_from(s.did, s.hmp_container["head"], self._open(s))
            except cons.ConsensusError as exc:
                out[s.did] = None
                bad.append({"agent_did": s.hmp_container["head"]["sender_did"], "target": s.did,
                            "reason": exc.reason})
        return out, bad

    def _trust(self, conn, agent: str) -> trust_mod.TrustFigure:
        return trust_mod.trust_figure(agent, consensus_db.trust_rows(conn, agent),
                                      damping=self.consensus_policy.trust_damping)

    def _ballot(self, conn, did: str, now: datetime, *, weigh: bool = True):
        """(proposal container, proposal, votes by DID, unusable votes, outcome at `now`) or None;
        `weigh=False` skips the trust figures (a recount takes the result's weights)."""
        stored = db.get_by_did(conn, did)
        if stored is None:
            return None
        proposal = self._proposal(stored)
        votes, unusable = self._votes(consensus_db.replies_of(conn, did, "vote", self.consensus_policy.max_votes))
        usable = [v for v in votes.values() if v is not None]
        weights = {a: self._trust(conn, a).trust for a in {v.agent for v in usable}} \
            if weigh and proposal.rules.weighting == "trust" else None
        return stored, proposal, votes, unusable, cons.decide(proposal, usable, now, weights)

    def _consensus_view(self, conn, did: str, now: datetime) -> dict[str, Any] | None:
        """Everything GET /v1/consensus/{did} answers, read in one transaction."""
        ballot = self._ballot(conn, did, now)
        if ballot is None:
            return None
        stored, proposal, votes, unusable, outcome = ballot
        results = []
        for r in consensus_db.replies_of(conn, did, "consensus_result", 64):
            check = self._recount(conn, proposal, r, votes)
            head = r.hmp_container["head"]
            results.append({"did": r.did, "sender": head["sender_did"], "timestamp": head["timestamp"],
                            "authoritative": head["sender_did"] == proposal.proposer, "recount": check.to_json()})
        closed = next((r["did"] for r in results if r["authoritative"] and r["recount"]["status"] == "match"), None)
        return {
            "did": did, "proposer": proposal.proposer, "class": stored.hmp_container["head"]["class"],
            "deadline": format_time(proposal.deadline) if proposal.deadline else None,
            "rules": cons.rules_payload(proposal.rules), **outcome.to_json(),
            "excluded": outcome.excluded + unusable, "closed_by": closed, "results": results,
        }

    def _recount(self, conn, proposal: cons.Proposal, result: db.StoredContainer,
                 votes: dict[str, cons.Vote | None]) -> cons.Recount:
        """Recount one consensus_result; a mismatch is counted once per result."""
        check = self._recount_of(conn, proposal, result, votes)
        if check.status == "mismatch" and result.did not in self._mismatched_results:
            self._mismatched_results.add(result.did)
            self.counters["consensus_result_mismatch"] += 1
            log.warning("consensus_result does not recount",
                        extra={"fields": {"did": result.did, "problems": check.problems}})
        return check

    def _recount_of(self, conn, proposal: cons.Proposal, result: db.StoredContainer,
                    votes: dict[str, cons.Vote | None]) -> cons.Recount:
        hmp = result.hmp_container
        related = hmp.get("related") or {}
        deps = related.get("depends_on") if isinstance(related, dict) else None
        wanted = [d for d in (deps if isinstance(deps, list) else []) if isinstance(d, str) and d not in votes]
        more = [s for s in (db.get_by_did(conn, d) for d in wanted[:self.consensus_policy.max_votes]) if s]
        held = {**votes, **self._votes(more)[0]}
        return cons.recount(proposal, hmp["head"]["sender_did"], parse_time(hmp["head"]["timestamp"]),
                            self._open(result), related, held,
                            others=[v for v in votes.values() if v is not None])

    async def _recount_arrived(self, verdicts: list[VerifyResult]) -> None:
        """Recount each consensus_result a peer just delivered (after the commit, on a
        reader: a 4096-vote recount takes ~0.2 s and must not hold the writer)."""
        results = [v.container_did for v in verdicts if v.container["hmp_container"]["head"]["class"]
                   == "consensus_result" and v.container_did]

        def read(conn) -> None:
            for did in results:
                stored = db.get_by_did(conn, did)
                related = (stored.hmp_container.get("related") if stored else None) or {}
                targets = related.get("in_reply_to", []) if isinstance(related, dict) else []
                for target in targets[:4] if isinstance(targets, list) else []:
                    try:
                        ballot = self._ballot(conn, target, self.now(), weigh=False) \
                            if isinstance(target, str) else None
                        if ballot is not None:
                            self._recount(conn, ballot[1], stored, ballot[2])
                    except cons.ConsensusError:
                        continue
                    except Exception:  # noqa: BLE001 - a hostile result must not fail the peer's ingest
                        log.exception("recount failed", extra={"fields": {"proposal": target}})

        if results:
            await self.db.read(read)

    async def consensus(self, did: str) -> dict[str, Any]:
        """The state of a held proposal, its counted and excluded votes, and every
        consensus_result answering it with this node's recount."""
        now = self.now()
        try:
            view = await self.db.read(lambda conn: self._consensus_view(conn, did, now))
        except cons.ConsensusError as exc:
            raise NodeError(exc.reason, exc.detail, 422) from None
        if view is None:
            raise await self._absent(did)
        return view

    async def trust(self, agent: str) -> dict[str, Any]:
        return (await self.db.read(lambda conn: self._trust(conn, agent))).to_json()

    async def close_due(self) -> list[str]:
        """Publish a consensus_result for each of this agent's proposals whose deadline
        (plus close_grace_seconds) has passed; returns the result DIDs."""
        async with self._closing:
            now = self.now()
            due_us = db.to_us(now - timedelta(seconds=self.consensus_policy.close_grace_seconds))
            dids = await self.db.read(lambda conn: consensus_db.proposals_to_close(conn, self.identity.did, due_us))
            published = []
            for did in dids:
                try:
                    view = await self.db.read(lambda conn, did=did: self._closing_outcome(conn, did, now))
                except cons.ConsensusError as exc:
                    log.warning("proposal cannot be closed", extra={"fields": {"did": did, "reason": exc.reason}})
                    continue
                payload, related = view
                result, _ = await self.create("consensus_result", payload, related=related, broadcast=True)
                if result.status != "stored":
                    log.warning("consensus_result not stored", extra={"fields": {"did": did, "reason": result.reason}})
                    continue
                self.counters["consensus_closed"] += 1
                published.append(result.did)
            return published

    def _closing_outcome(self, conn, did: str, now: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
        ballot = self._ballot(conn, did, now)
        if ballot is None:
            raise cons.ConsensusError("not_found", f"{did} is no longer held")
        return cons.result_payload(ballot[1], ballot[4])

    async def close_proposals_forever(self) -> None:
        """The closing loop the daemon runs (every consensus.check_seconds)."""
        while True:
            await asyncio.sleep(self.consensus_policy.check_seconds)
            try:
                await self.close_due()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a full disk or a closed store: try again next round
                log.exception("closing proposals failed")

    # -- reads --------------------------------------------------------------------------

    def referenced_by_block(self, did: str, links: list[tuple[str, str]]) -> dict[str, Any] | None:
        """The referenced-by block this node signs for `did` (None without links)."""
        return self._referenced_by(did, links)

    def _referenced_by(self, did: str, links: list[tuple[str, str]]) -> dict[str, Any] | None:
        if not links:
            return None
        ordered = [{"type": rel, "target": src} for rel, src in links]
        key = (did, sha256_tag(canonical_json(ordered)))
        block = self._backlink_blocks.get(key)
        if block is None:
            block = build_referenced_by(ordered, self.identity)
            self._backlink_blocks[key] = block
            if len(self._backlink_blocks) > 4096:
                self._backlink_blocks.popitem(last=False)
        return block

    def describe(self, view: db.ContainerView, *, decrypt: bool = False, spliced: bool = False,
                 now_us: int | None = None) -> dict[str, Any]:
        """A stored container as the API shows it. `spliced`: its `hmp_container` is the
        stored JSON text as an `orjson.Fragment`, for answers that only serialise it (no
        parse, no re-serialisation: most of a list's CPU); otherwise parsed."""
        hmp = orjson.loads(view.body) if decrypt or not spliced else None
        full: dict[str, Any] = {"hmp_container": orjson.Fragment(view.body) if spliced else hmp}
        if view.relay_chain:
            full["relay_chain"] = view.relay_chain
        block = self._referenced_by(view.did, view.links)
        if block is not None:
            full["referenced-by"] = block
        if view.evaluations:
            full["evaluations"] = evaluations_block(view.evaluations)
        out = {
            "did": view.did,
            "seq": view.seq,
            "expired": view.expired(self.now_us() if now_us is None else now_us),
            "store_and_forward": view.flags,
            "received": received_text(view.received_us),
            "source": view.source,
            "container": full,
        }
        if decrypt:
            try:
                payload = open_payload(hmp, self.identity, max_bytes=self.limits.max_decompressed_bytes)
                out["payload"] = payload if not isinstance(payload, bytes) else {"binary_bytes": len(payload)}
            except PayloadError as exc:
                out["payload_error"] = {"reason": exc.code, "detail": str(exc)}
        return out

    async def get(self, did: str, *, decrypt: bool = False, spliced: bool = False) -> dict[str, Any]:
        """A held container's description (`describe`; `spliced` as there); 404 / 410."""
        view = await self.db.read_small(lambda conn: db.view_by_did(conn, did), rows=1)
        if view is None:
            raise await self._absent(did)
        return self.describe(view, decrypt=decrypt, spliced=spliced)

    async def list(self, query: db.ListQuery, *, spliced: bool = False) -> tuple[list[dict[str, Any]], int | None]:
        """One page of `query` (`describe`; `spliced` as there) and the seq to go on from.
        The rows are described where they are read (a reader thread, for a page larger than
        loop_read_rows): the event loop, which every request needs, keeps only the answer.
        (`describe` may run in two readers at once: its one shared state, the referenced-by
        block cache, is only touched by single OrderedDict calls, atomic under the GIL.)"""
        now_us = self.now_us()

        def read(conn):
            return [self.describe(v, spliced=spliced, now_us=now_us) for v in db.list_views(conn, query, now_us)]

        items = await self.db.read_small(read, rows=query.limit)
        return items, (items[-1]["seq"] if len(items) == query.limit else None)

    async def referenced_by(self, did: str) -> dict[str, Any]:
        links = await self._held_or_404(did, lambda conn: db.backlinks_of(conn, did))
        return self._referenced_by(did, links) or build_referenced_by([], self.identity)

    async def evaluations(self, did: str) -> dict[str, Any]:
        items = await self._held_or_404(did, lambda conn: db.evaluations_of(conn, did))
        return evaluations_block(items)

    async def versions(self, did: str, *, mesh: bool = False) -> dict[str, Any]:
        """Versions of a held container (spec 3.12); `mesh`: also those the connected
        peers' indexes know of (spec 5.7, docs/protocol.md 31.6)."""
        def read(conn):
            stored = db.get_by_did(conn, did)
            edges = db.descendants_of(conn, did) if stored is not None or mesh else []
            return (stored.hmp_container["head"]["sender_did"] if stored is not None else None), edges

        author, edges = await self.db.read(read)
        if author is None:
            # not held: 404/410 without `mesh`; with it, what this node and its peers know of
            # its descendants (its author unknown: 31.6), 404 when nobody knows any
            absent = await self._absent(did)
            if not mesh or absent.status != 404:
                raise absent
            found = await self._mesh_versions(did, None, edges)
            if not found["descendants"]:
                raise absent
            return found
        if mesh:
            return await self._mesh_versions(did, author, edges)
        return summarize_versions(did, author, edges)

    # mesh-wide versions (spec 5.7 item 2; docs/protocol.md 31.6) ------------------------------

    async def _mesh_versions(self, did: str, author: str | None, edges: list[tuple[str, str, str]]) -> dict[str, Any]:
        """Ask the connected peers' indexes for containers whose previous_version is one of
        the versions known so far, round after round (what a round finds is asked about in
        the next) within one deadline; the union with the local versions, nothing fetched."""
        remote: dict[tuple[str, str], tuple[str, set[str]]] = {}
        asked: set[str] = set()
        answered: set[str] = set()
        complete = True
        known = {did} | {child for child, _, _ in edges}
        frontier = sorted(known)
        cap = IX.MAX_SELECTIONS * IX.MAX_LIST
        mesh = self.mesh
        deadline = time.monotonic() + (mesh.settings.mesh.index_query_seconds if mesh is not None else 0)
        for _ in range(MESH_VERSION_ROUNDS):
            if not frontier or mesh is None:
                break
            if len(frontier) > cap or time.monotonic() >= deadline:
                complete = False
                break
            selections = [{"related_to": frontier[i:i + IX.MAX_LIST], "relation": "previous_version"}
                          for i in range(0, len(frontier), IX.MAX_LIST)]
            answers = await mesh.queries.query_index(selections, timeout=deadline - time.monotonic(), pages=MESH_VERSION_PAGES)
            found: set[str] = set()
            for answer in answers:
                asked.add(answer.peer)
                if answer.status == "processed":
                    answered.add(answer.peer)
                complete = complete and answer.complete
                for child, parent, sender in IX.version_edges(answer.entries, frontier):
                    remote.setdefault((child, parent), (sender, set()))[1].add(answer.peer)
                    if child not in known:
                        found.add(child)
            known |= found
            frontier = sorted(found)
        if frontier and mesh is not None:
            complete = False  # rounds or time ran out with versions not asked about
        return merge_versions(did, author, edges, remote, asked=asked, answered=answered, complete=complete)

    async def _held_or_404(self, did: str, fn):
        def read(conn):
            return fn(conn) if db.is_held(conn, did) else None

        out = await self.db.read(read)
        if out is None:
            raise await self._absent(did)
        return out

    async def _absent(self, did: str) -> NodeError:
        """Why `did` is not served: 410 gone (forgotten: no content, ever again) or 404."""
        if await self.db.read(lambda conn: forget_db.is_forgotten(conn, did)):
            return NodeError("gone", "this container was forgotten", 410)
        return NodeError("not_found", f"no container {did}", 404)

    # -- search --------------------------------------------------------------------------

    def _full_text(self, text: str, query: search_db.SearchQuery | None,
                   **changes: Any) -> tuple[list[str], search_db.SearchQuery | None]:
        """The query words of `text` and `query` made to match them (None: no words)."""
        terms = query_terms(text)
        match = fts_query(terms)
        if match is None:
            return terms, None
        return terms, dataclasses.replace(query or search_db.SearchQuery(match=""), match=match, **changes)

    async def search(self, text: str, query: search_db.SearchQuery | None = None) -> dict[str, Any]:
        """Full-text search (BM25) with filters; each hit carries its lifecycle state."""
        terms, query = self._full_text(text, query)
        if query is None:
            return {"terms": [], "items": []}
        now_us = self.now_us()
        await self.indexer.caught_up()  # everything committed before this search is in the index
        found = await self.db.read(lambda conn: search_db.hits(conn, query, terms, now_us))
        items = []
        for hit in found:
            head = hit.row.hmp_container["head"]
            items.append({
                "did": hit.row.did, "seq": hit.row.seq, "class": head["class"], "sender": head["sender_did"],
                "timestamp": head["timestamp"], "tags": head.get("tags") or [], "state": hit.state,
                "score": round(-hit.score, 6), "matched": hit.matched, "snippet": hit.snippet,
            })
        return {"terms": terms, "items": items}

    # -- recall under a budget (hmpnode.memory.recall) -------------------------------------

    async def _recall_candidates(self, text: str, query: search_db.SearchQuery | None, *,
                                 want: int | None = None, include_contested: bool = False, relevant_only: bool = True,
                                 max_bytes: int | None = None) -> dict[str, Any]:
        """The keyword arguments of recall.recall: the best full-text hits lifecycle does not
        exclude (scanned until `want` of them, see search.recall_hits) that are relevant
        (unless not `relevant_only`), with what ranking needs and their opened payloads
        (`candidates`); the query's `terms` (its unknown names identifying, recall.unknown_terms)
        and `weights` (idf in the query's scope, or in the whole store without one); the hits
        `excluded` per state, the `irrelevant` ones and `known_terms`. Hits this agent
        cannot open are left out. A compressed JSON payload is decompressed up to
        `max_bytes` (the byte budget) only: one that is larger cannot be an item, and
        becomes recall.OVERSIZE (a store may hold many hits of 16 MiB each once decompressed)."""
        terms = recall_terms(text)
        if not terms:
            return {"candidates": [], "terms": [], "weights": {}}
        exprs = [fts_any(t.forms) for t in terms]
        words = [t.word for t in terms]
        excluded = tuple(recall_mod.excluded_states(include_contested))
        now_us = self.now_us()
        limits = self.recall_limits
        await self.indexer.caught_up()  # everything committed before this recall is in the index

        def read(conn):
            scope = query.scope if query else None
            indexed, dfs = search_db.document_frequencies(conn, exprs, scope=scope)
            named = recall_mod.unknown_terms(  # a near word held: "failovr" is a typo, not a name
                terms, dfs, lambda words: bool(words) and search_db.document_frequencies(
                    conn, [fts_any(words)], cap=1, scope=scope)[1] == [1])
            weights = {w: recall_mod.idf(df, indexed) for w, df in zip(words, dfs)}
            match = recall_mod.index_query(named, weights, limits.min_coverage)
            if match is None:
                return [], {}, {}, weights, dfs, named
            found, dropped = search_db.recall_hits(
                conn, dataclasses.replace(query or search_db.SearchQuery(match=""), match=match, states=None),
                words, exprs, now_us, want=want or limits.candidates, max_scan=limits.max_scan, excluded=excluded)
            return found, dropped, search_db.evaluation_sums(conn, [h.row.did for h in found]), weights, dfs, named

        found, dropped, totals, weights, dfs, terms = await self.db.read(read)
        candidates, irrelevant = [], 0
        for hit in found:
            if relevant_only and not recall_mod.relevant_terms(hit.matched, terms, weights, limits.min_coverage):
                irrelevant += 1  # never packed (recall.relevant): neither opened nor ranked, only counted
                continue
            row = hit.row
            head = row.hmp_container["head"]
            limit = self.limits.max_decompressed_bytes
            capped = (max_bytes is not None and max_bytes < limit
                      and parse_payload_type(head["payload_type"]).base == "json")
            try:
                payload = open_payload(row.hmp_container, self.identity, max_bytes=max_bytes if capped else limit)
            except PayloadError as exc:
                if not (capped and exc.code == "decompress_failed"):
                    continue  # sealed for someone else: nothing this agent can be given
                payload = recall_mod.OVERSIZE  # larger than the budget (an unopenable one was refused at ingest)
            if isinstance(payload, bytes):
                payload = {"binary_bytes": len(payload)}
            confidence = head.get("confidence")
            candidates.append(recall_mod.Candidate(
                row.did, row.seq, head["class"], head["sender_did"], head["timestamp"], row.ts_us, hit.state,
                float(hit.score), tuple(hit.matched), totals.get(row.did, 0.0),
                float(confidence) if isinstance(confidence, (int, float)) else None, head["payload_hash"], payload,
                hit.head,
            ))
        return {"candidates": candidates, "terms": terms, "weights": weights, "excluded": dropped,
                "irrelevant": irrelevant,
                "known_terms": sum(1 for df in dfs if df)}

    async def recall(self, text: str, *, max_tokens: int, max_bytes: int, include_contested: bool = False,
                     why: bool = False, query: search_db.SearchQuery | None = None) -> recall_mod.RecallOutcome:
        """One-step recall: the packed envelope (see hmpnode.memory.recall)."""
        gathered = await self._recall_candidates(text, query, include_contested=include_contested,
                                                 max_bytes=max_bytes)
        return recall_mod.recall(**gathered, now_us=self.now_us(), self_did=self.identity.did, max_tokens=max_tokens,
                                 max_bytes=max_bytes, include_contested=include_contested, why=why,
                                 min_coverage=self.recall_limits.min_coverage)

    async def recall_plan(self, text: str, *, explain: bool = False, **options: Any) -> dict[str, Any]:
        """A content-free plan (sealed token + receipt without items; with `explain`,
        the content-free explanation instead of the receipt)."""
        outcome = await self.recall(text, **options)
        scope = options["query"].scope if options.get("query") is not None else None
        token = recall_mod.seal_plan(self._plan_key, query=text, max_tokens=options["max_tokens"],
                                     max_bytes=options["max_bytes"],
                                     include_contested=options.get("include_contested", False), outcome=outcome,
                                     why=options.get("why", False), scope=scope)
        if explain:
            return {"plan": token, "explain": self.recall_explain(outcome, **options)}
        return {"plan": token, "receipt": outcome.receipt}

    @staticmethod
    def recall_explain(outcome: recall_mod.RecallOutcome, *, max_tokens: int, max_bytes: int,
                       query: search_db.SearchQuery | None = None, **_: Any) -> dict[str, Any]:
        """The `explain` answer of a recall: counts, reasons, budgets; no ids, no text."""
        return recall_mod.explain(outcome, max_tokens=max_tokens, max_bytes=max_bytes,
                                  scoped=query is not None and query.scope is not None)

    async def recall_resolve(self, token: Any) -> recall_mod.RecallOutcome:
        """The content of a plan if nothing it selected changed; NodeError stale_plan (409) otherwise.

        The planned rows are read again as candidates of the plan's query (their
        state and content hash now), and packed in the planned order; the counts are
        those of the query now (a memory forgotten since the plan is not counted)."""
        try:
            plan = recall_mod.open_plan(self._plan_key, token)
        except recall_mod.PlanError as exc:
            raise NodeError("bad_plan", str(exc), 400) from None
        items = plan["items"]
        only = search_db.SearchQuery(match="", seqs=tuple(i["seq"] for i in items), scope=plan["scope"])
        gathered = await self._recall_candidates(
            plan["query"], only, want=max(1, len(items)), include_contested=True, relevant_only=False,
            max_bytes=plan["max_bytes"])
        now = {c.seq: c for c in gathered["candidates"]}
        # a planned row no candidate any more: held in a state recall leaves out (superseded,
        # retracted, revoked, expired), which the refusal names, or not held
        left = [i["seq"] for i in items if i["seq"] not in now]
        held = await self.db.read(lambda conn: search_db.states_of(conn, left, self.now_us())) if left else {}
        stale, chosen = [], []
        for item in items:
            c = now.get(item["seq"])
            state = c.state if c is not None else held.get(item["seq"], (None,))[0]
            if state is None or (c is not None and c.did != item["did"]):
                stale.append(f"{item['did']}: no longer held")
            elif c is not None and c.payload_hash != item["payload_hash"]:
                stale.append(f"{item['did']}: changed")
            elif state != item["state"]:
                stale.append(f"{item['did']}: now {state}, planned {item['state']}")
            elif c is None:
                stale.append(f"{item['did']}: no longer selectable ({state})")
            chosen.append(c)
        if stale:
            missing = [i["did"] for i in items if i["seq"] not in now]
            if missing and await self.db.read(lambda conn: forget_db.forgotten_of(conn, missing)):
                raise NodeError("gone", "a memory this plan selected was forgotten; plan again", 410)
            raise NodeError("stale_plan", "; ".join(stale)[:1000], 409)
        scope = search_db.SearchQuery(match="", scope=plan["scope"]) if plan["scope"] is not None else None
        fresh = await self._recall_candidates(plan["query"], scope, include_contested=plan["include_contested"],
                                              max_bytes=plan["max_bytes"])
        counts = recall_mod.tally(**fresh, include_contested=plan["include_contested"],
                                  min_coverage=self.recall_limits.min_coverage)
        outcome = recall_mod.recall(chosen, terms=gathered["terms"], weights=gathered["weights"],
                                    now_us=self.now_us(),
                                    self_did=self.identity.did, max_tokens=plan["max_tokens"],
                                    max_bytes=plan["max_bytes"], include_contested=plan["include_contested"],
                                    why=plan.get("why", False), counts=counts, planned=True)
        if [c.did for c in outcome.selected] != [i["did"] for i in items]:
            raise NodeError("stale_plan", "the planned items no longer fit the budget", 409)
        return outcome

    # -- forget and scopes (hmpnode.store.forget) ------------------------------------------

    async def forget(self, *, did: str | None = None, source: str | None = None,
                     scope: str | None = None) -> dict[str, int]:
        """Erase one container, everything stored with a source label, or everything in a
        scope: one transaction, acknowledged once committed (durable); tombstones keep
        peers from handing the containers back. Forgetting a DID neither held nor
        forgotten is 404 (nothing is tombstoned on a guess); a selection holding an
        entry of the agent's journal is 409 journal_entry, nothing erased."""
        now_us = self.now_us()
        journal_of_agent = (journal.ENTRY_CLASS, journal.JOURNAL_TAG, self.identity.did)
        try:
            done = await self.db.write(lambda conn: forget_db.forget(conn, now_us, did=did, source=source, scope=scope,
                                                                     protected=journal_of_agent,
                                                                     scrub=self.forget_scrub))
        except forget_db.ForgetRefused:
            raise NodeError("journal_entry", "entries of the agent's journal are a signed chain (each one depends on "
                            "the ones before it) and cannot be forgotten; nothing was erased", 409) from None
        if did is not None and not done.erased and not done.already:
            raise NodeError("not_found", f"no container {did}", 404)
        self._backlink_blocks.clear()  # blocks naming a forgotten container as a source
        if done.erased and self.forget_scrub:
            # the old page images in the WAL held the text; the forget itself is committed
            # already, so a checkpoint that cannot run now (busy, I/O) only leaves them longer
            try:
                if (await self.db.checkpoint_truncate())[0]:
                    log.info("forget: the WAL is still in use; its old pages go at a later checkpoint")
            except sqlite3.Error as exc:
                log.warning("forget: the WAL could not be truncated now (%s)", exc)
        return done.to_json()

    async def accept_into_scope(self, scope: str, did: str) -> dict[str, Any]:
        """The agent takes a held container (its own or another sender's) into `scope`;
        nothing else ever places a container from someone else in a scope."""
        def write(conn):
            stored = db.get_by_did(conn, did)
            if stored is not None:
                forget_db.join_scope(conn, scope, [stored.seq])
            return stored

        if await self.db.write(write) is None:
            raise await self._absent(did)
        return {"scope": scope, "did": did, "status": "accepted"}

    # -- the journal (hmpnode.memory.journal) -------------------------------------------

    def _journal_query(self) -> db.ListQuery:
        """Every diary_entry of this agent tagged `journal`, expired or not."""
        return db.ListQuery(class_=journal.ENTRY_CLASS, tag=journal.JOURNAL_TAG, sender=self.identity.did,
                            expired=None, limit=1_000_000)

    async def _journal_containers(self) -> list[dict[str, Any]]:
        """The journal's entries as stored (full form)."""
        query = self._journal_query()
        rows = await self.db.read(lambda conn: db.list_containers(conn, query, self.now_us()))
        return [{"hmp_container": r.hmp_container} for r in rows]

    async def _journal_mark(self) -> tuple[int, int]:
        query = self._journal_query()
        return await self.db.read(lambda conn: db.list_mark(conn, query, self.now_us()))

    async def journal_verify(self, *, reuse: bool = False) -> journal.ChainReport:
        """Verify every entry and the links between them (on the verify threads, so the
        event loop keeps serving). With `reuse`, a report of this process stands while
        the journal's rows are unchanged (same count and highest seq): appends and
        loads cost O(1) verifications instead of O(n); the explicit check does not reuse."""
        mark = await self._journal_mark()  # before reading the rows: a row landing between makes the mark stale, never wrong
        if reuse and self._journal_checked is not None and self._journal_checked[0] == mark:
            return self._journal_checked[1]
        entries = await self._journal_containers()
        now = self.now()

        def check() -> journal.ChainReport:
            return journal.verify_chain(entries, identity_did=self.identity.did, verifier=self.verifier(), now=now)

        report = await self.offload(check)
        self._journal_checked = (mark, report, None)
        return report

    async def journal_add(self, text: str, *, title: str | None = None, tags: Sequence[str] = ()) -> dict[str, Any]:
        """Append an entry after the head of the verified chain (one append at a time);
        refused (409 journal_broken) while the chain has a problem."""
        async with self._journal_lock:
            report = await self.journal_verify(reuse=True)
            assert self._journal_checked is not None
            before, _, book = self._journal_checked
            if not report.ok:
                problem = report.first_problem
                raise NodeError("journal_broken", f"the journal has a problem: {problem.kind} at "
                                f"{problem.container_did} ({problem.detail})"[:500], 409)
            if book is None:
                book = journal.Journal(self.identity, report.chain)
            try:
                container = journal.build_entry(self.identity, text, previous=book.head, vocabulary=book.vocabulary,
                                                now=self.now(), title=title, tags=tags)
            except ValueError as exc:
                raise NodeError("invalid_entry", str(exc), 422) from None
            entry = journal.read_entry(container)
            (result,) = await self.ingest([container], source="agent")
            self._journal_checked = None
            if result.status == "stored":
                book.extend(entry)
                mark = await self._journal_mark()
                if mark == (before[0] + 1, result.seq):  # nothing else changed the journal meanwhile
                    extended = journal.ChainReport(True, report.count + 1, None, book.entries, entry.container_did)
                    self._journal_checked = (mark, extended, book)
            return {**result.to_json(), "journal_seq": entry.seq, "novelty": entry.novelty.cls}

    async def journal_load(self, max_tokens: int, *, include_routine: bool = False) -> list[dict[str, Any]]:
        """Selective load: the newest non-routine entries within `max_tokens`, oldest first."""
        report = await self.journal_verify(reuse=True)
        picked = journal.selective_load(report.chain, max_tokens=max_tokens, include_routine=include_routine,
                                        count_tokens=count_json_tokens)
        out = []
        for container in picked:
            e = journal.read_entry(container)
            out.append({"did": e.container_did, "journal_seq": e.seq, "novelty": e.novelty.cls,
                        "timestamp": format_time(e.timestamp), "title": e.title, "content": e.content})
        return out

    async def journal_anchor(self, day: date) -> dict[str, Any]:
        """Sign and store the anchor of one finished UTC day."""
        entries = await self._journal_containers()
        try:
            container = journal.build_anchor(self.identity, entries, day, now=self.now())
        except ValueError as exc:
            raise NodeError("invalid_anchor", str(exc), 422) from None
        (result,) = await self.ingest([container], source="agent")
        return {**result.to_json(), "anchor": container["hmp_container"]["payload"]}

    # -- events ----------------------------------------------------------------------------

    async def events(self, query: db.ListQuery, *, batch: int = 256,
                     spliced: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Containers matching `query`, from its cursor on, forever: first what is
        stored already, then each new one as it commits. Resuming with the last
        `seq` seen misses nothing and repeats nothing. `spliced` as in `describe`."""
        cursor = query.after_seq
        self.subscribers += 1
        try:
            while True:
                tick = self._tick
                page = dataclasses.replace(query, after_seq=cursor, limit=batch, descending=False)
                items, _ = await self.list(page, spliced=spliced)
                for item in items:
                    cursor = item["seq"]
                    yield item
                if len(items) < batch and tick is not None:
                    await asyncio.shield(tick)
                else:  # a page read on the loop (loop_read_rows >= batch) does not suspend
                    await asyncio.sleep(0)
        finally:
            self.subscribers -= 1

    def refuse(self, area: str, reason: str, n: int = 1) -> None:
        """Count a refusal (shown in `status` and as `hmpnode_refused_total` in /metrics).

        `area` is where it happened (peer, lan, dht, relay, api, import, ...) and
        `reason` a code the node chose, never text from the other side, so the
        label set stays bounded."""
        self.refusals[(area, reason)] += n

    # -- status ---------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        counts = await self.db.read(lambda conn: {**db.counts(conn), "tombstones": forget_db.tombstones(conn)})
        return {
            "did": self.identity.did,
            "public_key": self.identity.public_key_b58,
            "uptime_seconds": round(time.time() - self.started_at, 3) if self.started_at else 0,
            "last_seq": self.last_seq,
            "store": {**counts, "schema_version": self.db.schema_version, "commits": self.db.commits,
                      "index_lag": self.indexer.lag,
                      # GETs and list pages answered on the event loop / moved to a reader thread
                      "loop_reads": self.db.loop_reads, "loop_reads_moved": self.db.loop_reads_moved},
            "ingest": dict(self.counters),
            "rejected": dict(self.rejections),
            "refused": {f"{area}:{reason}": n for (area, reason), n in sorted(self.refusals.items())},
            "event_subscribers": self.subscribers,
            "inflight_decompressed": self.inflight.stats(),
            "verify_processes": self.verify_procs.stats(),
            "loop_lag_seconds": {k: round(v, 4) for k, v in self.loop_lag.items()},
        }


#: Items of a batch the event loop handles between two yields to other tasks. The
#: per-item passes over an import of 500 (head_view ~1.4 us, the cost bound, the
#: answer) held the loop 1-2 ms each, longer when it waited for the GIL, and every
#: API read waits for the loop (issue 15, session 5 round 2: docs/benchmarks-journal.md).
LOOP_SLICE = 100


async def in_slices(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """[fn(x) for x in items], yielding to the event loop before every LOOP_SLICE
    items (the first too: what ran before in the same step -- the body's split, the
    bookkeeping after a commit -- takes ~1 ms of its own); a batch of at most
    LOOP_SLICE runs in one step, as before."""
    if len(items) <= LOOP_SLICE:
        return [fn(x) for x in items]
    out: list[Any] = []
    for start in range(0, len(items), LOOP_SLICE):
        await asyncio.sleep(0)
        out.extend([fn(x) for x in items[start:start + LOOP_SLICE]])
    return out


def _for_index(hmp: dict[str, Any], text: Any) -> dict[str, Any]:
    """What the indexer keeps of a stored container until it indexes it: with the payload's
    text already taken out, the head alone (`searchable` reads nothing else then)."""
    return {"head": hmp["head"]} if text is not None else hmp


def _head_of(raw: Any) -> dict[str, Any] | None:
    """The head a parsed (unverified) container, full or bare form, claims."""
    if isinstance(raw, dict):
        hmp = raw.get("hmp_container", raw)
        head = hmp.get("head") if isinstance(hmp, dict) else None
        if isinstance(head, dict):
            return head
    return None


def _did_of(raw: Any) -> str | None:
    """The container_did a (refused, unverified) container claims, if it is a string."""
    did = (_head_of(raw) or {}).get("container_did")
    return did if isinstance(did, str) and len(did) <= 512 else None


def duplicate_key(raw: Any) -> tuple[str, str] | None:
    """(container_did, signature) of a parsed container (or its `head_view`) that may be
    answered from the store before verification; None for anything else (a container
    carrying evaluations or referenced-by, a DID or signature that is no short string),
    which is verified in full."""
    # blocks outside the signature that ingest takes from a container it holds already:
    # a container carrying one is verified in full, as before (its blocks are applied)
    if not isinstance(raw, dict) or "evaluations" in raw or "referenced-by" in raw:
        return None
    head = _head_of(raw)
    if head is None:
        return None
    did, signature = head.get("container_did"), head.get("signature")
    if not isinstance(did, str) or len(did) > 512 or not isinstance(signature, str) or len(signature) > 128:
        return None
    return did, signature


def answer_held(keys: dict[int, tuple[str, str]], held: dict[str, db.Held], now_us: int) -> dict[int, IngestResult]:
    """The `duplicate` answers for the inputs (index -> (DID, signature)) whose DID the
    store holds with the same signature. A held DID with another signature is not
    answered here (verified in full: a conflict, or a copy signed again). The answer
    is the held row's: its seq, expiry and flags, never anything of the copy sent."""
    out: dict[int, IngestResult] = {}
    for i, (did, signature) in keys.items():
        row = held.get(did)
        if row is not None and row.signature == signature:
            out[i] = IngestResult("duplicate", did, seq=row.seq,
                                  expired=row.ttl_us is not None and row.ttl_us <= now_us,
                                  store_and_forward=row.flags.split(",") if row.flags else [])
    return out


#: rounds of a mesh-wide versions query (each asks about what the previous one found), and
#: pages of one peer's answer followed in a round
MESH_VERSION_ROUNDS = 8
MESH_VERSION_PAGES = 4


def merge_versions(did: str, author: str | None, local: list[tuple[str, str, str]],
                   remote: dict[tuple[str, str], tuple[str, set[str]]], *, asked: set[str], answered: set[str],
                   complete: bool) -> dict[str, Any]:
    """`summarize_versions` over the local edges and those peers reported ((child, parent)
    -> (sender, peers)): each descendant marked `local` (held here) and with the `peers`
    whose index lists it; `mesh` says who was asked and answered, `complete` whether every
    peer asked answered in full."""
    held = {child for child, _, _ in local}
    pairs = {(child, parent) for child, parent, _ in local}
    merged = list(local) + [(c, p, s) for (c, p), (s, _) in sorted(remote.items()) if (c, p) not in pairs]
    out = summarize_versions(did, author, merged)
    for item in out["descendants"]:
        item["local"] = item["did"] in held
        peers = remote.get((item["did"], item["parent"]))
        if peers is not None:
            item["peers"] = sorted(peers[1])
    out["mesh"] = {"asked": sorted(asked), "answered": sorted(answered)}
    out["complete"] = complete
    return out


def summarize_versions(did: str, author: str | None, edges: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Versions of `did` (spec 3.12) from its previous_version descendants.

    `latest`: the newest versions by the same author (descendants with no
    same-author child, or `did` itself); `forks`: containers with more than one
    direct descendant; `foreign`: descendants by other authors (forks, not
    supersessions, unless local policy says otherwise). With `author` None (the
    root is not held here, only its descendants are known): `latest` are the
    descendants without a child, `foreign` is empty (nobody is known to be foreign)."""
    children: dict[str, list[str]] = {}
    sender_of: dict[str, str] = {}
    for child, parent, sender in edges:
        children.setdefault(parent, []).append(child)
        sender_of[child] = sender
    same_author = {c for c, s in sender_of.items() if author is None or s == author}
    reachable, frontier = set(), [did]
    while frontier:
        node = frontier.pop()
        for child in children.get(node, ()):
            if child in same_author and child not in reachable:
                reachable.add(child)
                frontier.append(child)
    latest = sorted(c for c in reachable if not any(k in same_author for k in children.get(c, ()))) or [did]
    return {
        "did": did,
        "author": author,
        "descendants": [{"did": c, "parent": p, "sender": s} for c, p, s in edges],
        "latest": latest,
        "forks": {p: sorted(set(cs)) for p, cs in sorted(children.items()) if len(set(cs)) > 1},
        "foreign": sorted({c for c, s in sender_of.items() if author is not None and s != author}),
    }
