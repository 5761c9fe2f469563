"""Reading and writing container rows and everything derived from them.

Plain functions over a sqlite3 connection; the caller (hmpnode.store.db)
decides the thread and the transaction. Nothing here verifies signatures:
only containers that passed `Verifier` are handed to `insert_container`.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import orjson

from hmpnode.container.backlinks import links_from_related
from hmpnode.container.canonical import prepare
from hmpnode.container.did import is_content_addressed
from hmpnode.container.payload import recipients_of
from hmpnode.store.marker import high_seq

__all__ = [
    "StoredContainer",
    "did_key",
    "sql_functions",
    "Insert",
    "NewContainer",
    "to_us",
    "from_us",
    "insert_containers",
    "Held",
    "held_of",
    "row_to_stored",
    "get_by_did",
    "get_by_seq",
    "ContainerView",
    "view_by_did",
    "list_views",
    "seqs_of",
    "ListQuery",
    "list_containers",
    "backlinks_of",
    "descendants_of",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def did_key(did: str) -> int:
    """The indexed lookup key of a DID (schema 9): the first 8 bytes of its BLAKE2b
    digest as a signed 64-bit integer. Containers are looked up by `did_key = ? AND
    did = ?`: two DIDs with one key both work, the text comparison tells them apart.
    A random text index cost ~36 us per inserted row at 100 000 rows, this one ~28
    (issue 15), and it is a fifth of the size. Remembered for the last few thousand DIDs:
    the duplicate lookup before verification and the writer ask for the same ones."""
    key = _KEYS.get(did)
    if key is None:
        if len(_KEYS) >= _KEYS_KEPT:
            _KEYS.clear()
        key = _KEYS[did] = int.from_bytes(hashlib.blake2b(did.encode(), digest_size=8).digest(), "big", signed=True)
    return key


#: did -> did_key of recently seen DIDs (a plain dict: get/set/clear are atomic under the GIL)
_KEYS: dict[str, int] = {}
_KEYS_KEPT = 8192


def _sql_did_key(did: Any) -> int | None:
    return did_key(did) if isinstance(did, str) else None  # looked up at call time: tests swap `did_key`


def sql_functions(conn: sqlite3.Connection) -> None:
    """SQL functions the store's statements use (every connection): `did_key(text)`,
    for joins that look a container up by a DID held in another table."""
    conn.create_function("did_key", 1, _sql_did_key, deterministic=True)


def to_us(moment: datetime) -> int:
    # exact; `(moment - _EPOCH) // timedelta(microseconds=1)` is slower (0.87 against 0.74 us)
    delta = moment - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    """The inverse of `to_us` (exact, UTC)."""
    return _EPOCH + timedelta(microseconds=us)


@dataclass(slots=True)
class StoredContainer:
    seq: int
    did: str
    hmp_container: dict[str, Any]
    ts_us: int
    ttl_us: int | None
    received_us: int
    source: str
    flags: list[str]
    conflict: bool
    size: int

    def expired(self, now_us: int) -> bool:
        return self.ttl_us is not None and self.ttl_us <= now_us


@dataclass(slots=True)
class Insert:
    """Outcome of storing one verified container."""

    status: str  # "stored" | "duplicate" | "conflict"
    seq: int | None = None
    did: str = ""
    #: evaluation items that were waiting for this container (as a justification target);
    #: None: none (no list per stored row)
    released_evaluations: list[tuple[str, bytes]] | None = None


_COLUMNS = "seq, did, body, ts_us, ttl_us, received_us, source, flags, conflict, size"


def row_to_stored(row: Sequence[Any]) -> StoredContainer:
    seq, did, body, ts_us, ttl_us, received_us, source, flags, conflict, size = row
    return StoredContainer(
        seq, did, orjson.loads(body), ts_us, ttl_us, received_us, source,
        flags.split(",") if flags else [], bool(conflict), size,
    )


@dataclass(slots=True)
class NewContainer:
    """A verified container to store."""

    hmp: dict[str, Any]
    flags: Iterable[str]
    source: str
    #: the JSON text of `hmp` to store, when the verifier has it (VerifyResult.body);
    #: None: serialised here
    body: bytes | None = None


_INSERT_CONTAINER = (
    "INSERT INTO containers (seq, did, signature, payload_hash, class, subclass, sender, timestamp, ts_us, ttl_us,"
    " network, broadcast, encrypted, flags, conflict, size, received_us, source, body, did_key)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class Held(NamedTuple):
    """What the store holds for a DID (its non-conflict row): enough to dedupe and
    to answer a duplicate without reading the body."""

    seq: int
    signature: str
    payload_hash: str
    ttl_us: int | None
    flags: str


def held_of(conn: sqlite3.Connection, dids: Sequence[str], keys: dict[str, int] | None = None) -> dict[str, Held]:
    """did -> the (non-conflict) row held for each DID: one lookup in the `did_key` index
    per DID, 900 DIDs per statement (a row of another DID with the same key is dropped)."""
    held: dict[str, Held] = {}
    wanted = set(dids)
    for i in range(0, len(dids), 900):
        chunk = dids[i:i + 900]
        rows = conn.execute(
            f"SELECT did, seq, signature, payload_hash, ttl_us, flags FROM containers WHERE conflict = 0 AND did_key IN"
            f" ({','.join('?' * len(chunk))})",
            [keys[d] if keys is not None else did_key(d) for d in chunk],
        )
        held.update((row[0], Held(*row[1:])) for row in rows if row[0] in wanted)
    return held


def insert_containers(conn: sqlite3.Connection, items: Sequence[NewContainer], received_us: int) -> list[Insert]:
    """Store verified containers with their tags, recipients and links, in bulk.

    Dedupe (profile section 5): a content-addressed DID already held (or earlier
    in the batch) is a duplicate; an opaque DID held with the same signature and
    payload_hash is a duplicate, with another signature a conflict, stored apart
    (conflict=1) and never served in place of the first.
    """
    keys = {d: did_key(d) for d in {item.hmp["head"]["container_did"] for item in items}}
    held: dict[str, tuple] = held_of(conn, list(keys), keys)
    seen_conflicts: set[tuple[str, str, str]] = set()
    # AUTOINCREMENT's counter: a seq is never given twice, also when the newest row was
    # deleted (MAX(seq) then went back, and the next row took the deleted row's seq again)
    seq = high_seq(conn)
    rows, tag_rows, recipient_rows, link_rows = [], [], [], []
    out: list[Insert] = []
    for item in items:
        hmp = item.hmp
        head = hmp["head"]
        # the signature's text without padding: a re-padded copy is the same container
        # (padding is ignored on input, profile section 13), not a conflict; the verifier
        # decoded it already (decoding it again here cost ~4 % of the writer)
        did, signature, payload_hash = head["container_did"], head["signature"].rstrip("="), head["payload_hash"]
        conflict = 0
        existing = held.get(did)
        if existing is not None:
            # rows stored before schema 9 may hold the signature as received, padding included
            if is_content_addressed(did) or (existing[1].rstrip("="), existing[2]) == (signature, payload_hash):
                out.append(Insert("duplicate", existing[0], did))
                continue
            key = (did, signature, payload_hash)
            if key in seen_conflicts or conn.execute(
                "SELECT 1 FROM containers WHERE did_key = ? AND did = ? AND rtrim(signature, '=') = ? AND payload_hash = ?",
                (keys[did], *key),
            ).fetchone():
                out.append(Insert("duplicate", existing[0], did))
                continue
            seen_conflicts.add(key)
            conflict = 1
        seq += 1
        # orjson's own number text (1.0 stays 1.0) reads back to the same values, so
        # the canonical bytes, and with them the signature, are unchanged; the verifier's
        # text of it (item.body) reads back to the same values too
        body = item.body
        if body is None:
            body = orjson.dumps(hmp)
        timestamp, ttl, flags = head["timestamp"], head.get("ttl"), item.flags
        rows.append((
            seq, did, signature, payload_hash, head["class"], head.get("subclass"), head["sender_did"],
            timestamp, to_us(datetime.fromisoformat(timestamp)), to_us(datetime.fromisoformat(ttl)) if ttl else None,
            head.get("network", ""), 1 if head.get("broadcast", False) else 0,
            1 if head["payload_type"].startswith("encrypted+") else 0,
            ",".join(sorted(flags)) if flags else "", conflict, len(body), received_us, item.source, body, keys[did],
        ))
        if conflict:
            out.append(Insert("conflict", seq, did))
            continue
        held[did] = (seq, signature, payload_hash)  # the first two fields of a Held: all that is read here
        tags = head.get("tags")
        if tags:
            if len(tags) == 1:  # the usual case: no set, no list per row
                tag_rows.append((tags[0], seq))
            else:
                tag_rows.extend([(t, seq) for t in set(tags)])
        recipients = recipients_of(head)
        if recipients:
            recipient_rows.extend([(r, seq) for r in set(recipients)])
        related = hmp.get("related")
        if related:
            link_rows.extend([(target, relation, did) for relation, target in links_from_related(did, related)])
        out.append(Insert("stored", seq, did))
    conn.executemany(_INSERT_CONTAINER, rows)
    if tag_rows:
        conn.executemany("INSERT OR IGNORE INTO tags (tag, seq) VALUES (?, ?)", tag_rows)
    if recipient_rows:
        conn.executemany("INSERT OR IGNORE INTO recipients (did, seq) VALUES (?, ?)", recipient_rows)
    if link_rows:
        conn.executemany("INSERT OR IGNORE INTO links (target, relation, source) VALUES (?, ?, ?)", link_rows)
        if conn.execute("SELECT EXISTS (SELECT 1 FROM backlink_hints)").fetchone()[0]:
            conn.executemany("DELETE FROM backlink_hints WHERE target = ? AND relation = ? AND source = ?", link_rows)
    if rows and conn.execute("SELECT EXISTS (SELECT 1 FROM evaluations_pending)").fetchone()[0]:
        stored = {i.did: i for i in out if i.status == "stored"}
        for target in stored:
            for container, pending in conn.execute(
                "SELECT container, item FROM evaluations_pending WHERE target = ?", (target,)
            ):
                insert = stored[target]
                if insert.released_evaluations is None:
                    insert.released_evaluations = []
                insert.released_evaluations.append((container, pending))
    return out


def get_by_did(conn: sqlite3.Connection, did: str) -> StoredContainer | None:
    row = conn.execute(f"SELECT {_COLUMNS} FROM containers WHERE did_key = ? AND did = ? AND conflict = 0",
                       (did_key(did), did)).fetchone()
    return row_to_stored(row) if row else None


def get_by_seq(conn: sqlite3.Connection, seqs: Sequence[int]) -> list[StoredContainer]:
    if not seqs:
        return []
    marks = ",".join("?" * len(seqs))
    rows = conn.execute(f"SELECT {_COLUMNS} FROM containers WHERE seq IN ({marks}) ORDER BY seq", list(seqs))
    return [row_to_stored(r) for r in rows]


@dataclass(slots=True)
class ListQuery:
    """Filters of GET /v1/containers and of the event stream. All optional; AND-ed."""

    class_: str | None = None
    tag: str | None = None
    sender: str | None = None
    recipient: str | None = None
    related_to: str | None = None  # containers whose `related` points at this DID
    since: datetime | None = None  # head.timestamp >= since
    until: datetime | None = None  # head.timestamp < until
    expired: bool | None = False  # False: current only; True: expired only; None: both
    after_seq: int = 0  # cursor: rows with seq > after_seq (asc) or < (desc)
    descending: bool = False
    limit: int = 100

    def sql(self, now_us: int) -> tuple[str, str, list[Any], str]:
        """(FROM clause, WHERE clause, arguments, ordering column).

        A tag or recipient filter drives the query from its (key, seq) index, joined
        to containers: rows then come in seq order straight from the index, however
        rare or common the tag (an `IN (subquery)` built a temporary b-tree of every
        matching seq on each call: 22 ms at 100 000 containers, against 0.1 ms)."""
        tables, clauses, args = ["containers c"], ["c.conflict = 0"], []
        order = "c.seq"
        if self.tag is not None:
            tables.insert(0, "tags t")
            clauses.append("t.tag = ? AND c.seq = t.seq")
            args.append(self.tag)
            order = "t.seq"
        if self.recipient is not None:
            tables.insert(0, "recipients r")
            clauses.append("r.did = ? AND c.seq = r.seq")
            args.append(self.recipient)
            order = "r.seq"
        if self.class_ is not None:
            clauses.append("c.class = ?")
            args.append(self.class_)
        if self.sender is not None:
            clauses.append("c.sender = ?")
            args.append(self.sender)
        if self.related_to is not None:
            clauses.append("c.did_key IN (SELECT did_key(source) FROM links WHERE target = ?)"
                           " AND c.did IN (SELECT source FROM links WHERE target = ?)")
            args += [self.related_to, self.related_to]
        if self.since is not None:
            clauses.append("c.ts_us >= ?")
            args.append(to_us(self.since))
        if self.until is not None:
            clauses.append("c.ts_us < ?")
            args.append(to_us(self.until))
        if self.expired is False:
            clauses.append("(c.ttl_us IS NULL OR c.ttl_us > ?)")
            args.append(now_us)
        elif self.expired is True:
            clauses.append("c.ttl_us IS NOT NULL AND c.ttl_us <= ?")
            args.append(now_us)
        if self.after_seq:
            clauses.append(f"{order} < ?" if self.descending else f"{order} > ?")
            args.append(self.after_seq)
        return " CROSS JOIN ".join(tables), " AND ".join(clauses), args, order


def _list_rows(conn: sqlite3.Connection, query: ListQuery, now_us: int, columns: str) -> sqlite3.Cursor:
    tables, where, args, order = query.sql(now_us)
    direction = "DESC" if query.descending else "ASC"
    return conn.execute(f"SELECT {columns} FROM {tables} WHERE {where} ORDER BY {order} {direction} LIMIT ?",
                        [*args, query.limit])


def list_containers(conn: sqlite3.Connection, query: ListQuery, now_us: int) -> list[StoredContainer]:
    return [row_to_stored(r) for r in _list_rows(conn, query, now_us, _C_COLUMNS)]


_C_COLUMNS = ", ".join("c." + c.strip() for c in _COLUMNS.split(","))


@dataclass(slots=True)
class ContainerView:
    """A stored container as the API shows it (`Node.describe`): its row, its body as
    stored (JSON text of `hmp_container`, spliced into answers unparsed) and what its
    full form shows beside it (backlinks, evaluation items, relay chain)."""

    seq: int
    did: str
    body: bytes
    ttl_us: int | None
    received_us: int
    source: str
    flags: list[str]
    links: list[tuple[str, str]]  # (relation, source), sorted as backlinks_of returns them
    evaluations: list[dict[str, Any]]
    relay_chain: list

    def expired(self, now_us: int) -> bool:
        return self.ttl_us is not None and self.ttl_us <= now_us


#: A view's row and its blocks in ONE statement (one SQLite step per container; the
#: backlinks_of / evaluations_of / relay_chain_of statements per row cost 3 more, and
#: every statement and step releases and re-takes the GIL: while the node ingests each
#: re-take can wait behind a busy thread, issue 15). The subqueries use the tables'
#: primary keys, as those functions do.
_VIEW_COLUMNS = (
    "c.seq, c.did, c.body, c.ttl_us, c.received_us, c.source, c.flags,"
    " (SELECT json_group_array(json_array(relation, source)) FROM links WHERE target = c.did),"
    " (SELECT group_concat(CAST(item AS TEXT), ',') FROM evaluations WHERE container = c.did),"
    " (SELECT chain FROM relay_chains WHERE seq = c.seq)"
)


def _row_to_view(row: Sequence[Any]) -> ContainerView:
    seq, did, body, ttl_us, received_us, source, flags, links, items, chain = row
    return ContainerView(
        seq, did, body, ttl_us, received_us, source, flags.split(",") if flags else [],
        sorted(map(tuple, orjson.loads(links))) if links != "[]" else [],
        orjson.loads(f"[{items}]") if items else [],
        orjson.loads(chain) if chain else [],
    )


def view_by_did(conn: sqlite3.Connection, did: str) -> ContainerView | None:
    row = conn.execute(f"SELECT {_VIEW_COLUMNS} FROM containers c WHERE c.did_key = ? AND c.did = ?"
                       " AND c.conflict = 0", (did_key(did), did)).fetchone()
    return _row_to_view(row) if row else None


def list_views(conn: sqlite3.Connection, query: ListQuery, now_us: int) -> list[ContainerView]:
    """`list_containers` as views (Node.list)."""
    return [_row_to_view(r) for r in _list_rows(conn, query, now_us, _VIEW_COLUMNS)]


def list_mark(conn: sqlite3.Connection, query: ListQuery, now_us: int) -> tuple[int, int]:
    """(count, highest seq) of the rows `query` selects, whatever its limit: seqs are
    never reused (AUTOINCREMENT), so an unchanged mark means an unchanged set of rows
    unless a row was rewritten in place, which the store never does."""
    tables, where, args, _ = query.sql(now_us)
    count, top = conn.execute(f"SELECT count(*), max(c.seq) FROM {tables} WHERE {where}", args).fetchone()
    return count, top or 0


def backlinks_of(conn: sqlite3.Connection, did: str) -> list[tuple[str, str]]:
    """(relation, source DID) of every held container whose `related` points at `did`."""
    return conn.execute(
        "SELECT relation, source FROM links WHERE target = ? ORDER BY relation, source", (did,)
    ).fetchall()


def descendants_of(conn: sqlite3.Connection, did: str, limit: int = 10_000) -> list[tuple[str, str, str]]:
    """Every (child, parent, child's sender) reachable through previous_version links, breadth first."""
    rows = conn.execute(
        """
        WITH RECURSIVE chain(child, parent, depth) AS (
            SELECT source, target, 1 FROM links WHERE target = ? AND relation = 'previous_version'
            UNION
            SELECT l.source, l.target, chain.depth + 1 FROM links l JOIN chain ON l.target = chain.child
            WHERE l.relation = 'previous_version' AND chain.depth < 1000
        )
        SELECT chain.child, chain.parent, c.sender FROM chain
        JOIN containers c ON c.did_key = did_key(chain.child) AND c.did = chain.child AND c.conflict = 0
        LIMIT ?
        """,
        (did, limit),
    ).fetchall()
    return rows


# -- evaluations --------------------------------------------------------------


def evaluations_of(conn: sqlite3.Connection, container: str) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT item FROM evaluations WHERE container = ? ORDER BY agent", (container,))
    return [orjson.loads(r[0]) for r in rows]


def put_evaluation(conn: sqlite3.Connection, container: str, item: dict[str, Any]) -> bool:
    """Keep `item` if it wins against the agent's current one (profile section 9).
    Returns True when it became the active item. The item must be verified."""
    from hmpnode.container.evaluations import merge_evaluations

    row = conn.execute(
        "SELECT item FROM evaluations WHERE container = ? AND agent = ?", (container, item["agent_did"])
    ).fetchone()
    if row is not None:
        current = orjson.loads(row[0])
        if merge_evaluations([current, item])[0]["signature"] != item["signature"]:
            return False
    conn.execute(
        "INSERT OR REPLACE INTO evaluations (container, agent, ts_us, signature, value, item) VALUES (?, ?, ?, ?, ?, ?)",
        (
            container, item["agent_did"], to_us(datetime.fromisoformat(item["timestamp"])), item["signature"],
            float(item["value"]), orjson.dumps(prepare(item)),
        ),
    )
    conn.execute(
        "DELETE FROM evaluations_pending WHERE container = ? AND agent = ? AND signature = ?",
        (container, item["agent_did"], item["signature"]),
    )
    return True


def park_evaluation(conn: sqlite3.Connection, container: str, item: dict[str, Any]) -> None:
    """Keep a signature-checked item whose justification container is not held yet."""
    conn.execute(
        "INSERT OR IGNORE INTO evaluations_pending (container, target, agent, signature, item) VALUES (?, ?, ?, ?, ?)",
        (container, item["target"], item["agent_did"], item["signature"], orjson.dumps(prepare(item))),
    )


def drop_pending_evaluation(conn: sqlite3.Connection, container: str, item: dict[str, Any]) -> None:
    conn.execute(
        "DELETE FROM evaluations_pending WHERE container = ? AND agent = ? AND signature = ?",
        (container, item["agent_did"], item["signature"]),
    )


def resolver(conn: sqlite3.Connection):
    """`resolve(did) -> (sender_did, related) | None` over held containers (for verify_evaluation)."""

    def resolve(did: str) -> tuple[str, Any] | None:
        stored = get_by_did(conn, did)
        if stored is None:
            return None
        head = stored.hmp_container["head"]
        return head["sender_did"], stored.hmp_container.get("related") or {}

    return resolve


# -- backlink hints --------------------------------------------------------------


def add_backlink_hint(conn: sqlite3.Connection, target: str, relation: str, source: str, reporter: str) -> None:
    conn.execute(
        "INSERT OR IGNORE INTO backlink_hints (target, relation, source, reporter) VALUES (?, ?, ?, ?)",
        (target, relation, source, reporter),
    )


def link_exists(conn: sqlite3.Connection, target: str, relation: str, source: str) -> bool:
    return conn.execute(
        "SELECT 1 FROM links WHERE target = ? AND relation = ? AND source = ?", (target, relation, source)
    ).fetchone() is not None


def seqs_of(conn: sqlite3.Connection, did: str) -> list[int]:
    """Every row's seq for `did`, conflict rows included."""
    return [s for (s,) in conn.execute("SELECT seq FROM containers WHERE did_key = ? AND did = ?", (did_key(did), did))]


def is_held(conn: sqlite3.Connection, did: str) -> bool:
    return conn.execute("SELECT 1 FROM containers WHERE did_key = ? AND did = ? AND conflict = 0",
                        (did_key(did), did)).fetchone() is not None


# -- key registry -------------------------------------------------------------------


def load_keys(conn: sqlite3.Connection) -> tuple[dict[str, bytes], dict[str, int]]:
    pins, revoked = {}, {}
    for did, key, revoked_us in conn.execute("SELECT did, public_key, revoked_us FROM keys"):
        if key is not None:
            pins[did] = bytes(key)
        if revoked_us is not None:
            revoked[did] = revoked_us
    return pins, revoked


def pin_key(conn: sqlite3.Connection, did: str, key: bytes, now_us: int) -> bool:
    """Pin `key` for `did` unless another key is pinned; False when a different key is."""
    row = conn.execute("SELECT public_key FROM keys WHERE did = ?", (did,)).fetchone()
    if row is not None and row[0] is not None:
        return bytes(row[0]) == key
    conn.execute(
        "INSERT INTO keys (did, public_key, pinned_us) VALUES (?, ?, ?)"
        " ON CONFLICT (did) DO UPDATE SET public_key = excluded.public_key, pinned_us = excluded.pinned_us",
        (did, key, now_us),
    )
    return True


def revoke_key(conn: sqlite3.Connection, did: str, at_us: int) -> None:
    """Record a revocation; the earliest one wins."""
    conn.execute(
        "INSERT INTO keys (did, revoked_us) VALUES (?, ?)"
        " ON CONFLICT (did) DO UPDATE SET revoked_us = MIN(COALESCE(revoked_us, excluded.revoked_us), excluded.revoked_us)",
        (did, at_us),
    )


def counts(conn: sqlite3.Connection) -> dict[str, int]:
    return {
        "containers": conn.execute("SELECT COUNT(*) FROM containers WHERE conflict = 0").fetchone()[0],
        "conflicts": conn.execute("SELECT COUNT(*) FROM containers WHERE conflict = 1").fetchone()[0],
        "links": conn.execute("SELECT COUNT(*) FROM links").fetchone()[0],
        "evaluations": conn.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0],
        "evaluations_pending": conn.execute("SELECT COUNT(*) FROM evaluations_pending").fetchone()[0],
    }
