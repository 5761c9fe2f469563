"""Forgetting, sources and scopes: node-local data about containers (schema version 8).

Plain functions over a sqlite3 connection, like `records`; the caller picks the
thread and the transaction. None of this is signed or sent to peers:

- `memory_sources (seq, label)`: the source the agent named when it stored a
  container (a document, a tool, a URL), so that `forget --source` can find
  everything from it;
- `scope_members (scope, seq)`: which containers are in a scope (task, user,
  thread, as the agent names it). The agent's own containers join when it
  stores them with a scope; any other container only when the agent accepts it;
- `tombstones (did, forgotten_us, what)`: DIDs the agent forgot. Their rows are
  gone; ingest refuses them (`FORGOTTEN`), reads answer 410 gone.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hmpnode.store.mesh import delete_containers
from hmpnode.store import records

__all__ = ["FORGOTTEN", "Forgotten", "ForgetRefused", "forget", "forgotten_of", "is_forgotten", "tombstones", "label", "join_scope", "in_scope"]

#: the refusal reason of a container whose DID this node forgot (ingest, peers:
#: docs/protocol.md#rule-forgetting)
FORGOTTEN = "forgotten"


@dataclass(slots=True)
class Forgotten:
    """What one forget did: containers erased, DIDs newly tombstoned, DIDs forgotten before."""

    erased: int = 0
    tombstoned: int = 0
    already: int = 0

    def to_json(self) -> dict[str, int]:
        return {"forgotten": self.erased, "tombstoned": self.tombstoned, "already_forgotten": self.already}


class ForgetRefused(Exception):
    """The selection holds a container that must not be erased (nothing was)."""


def forgotten_of(conn: sqlite3.Connection, dids: Sequence[str]) -> set[str]:
    """The DIDs among `dids` that this node forgot."""
    out: set[str] = set()
    if not conn.execute("SELECT EXISTS (SELECT 1 FROM tombstones)").fetchone()[0]:
        return out  # nothing forgotten (the usual case): no lookup per DID
    for i in range(0, len(dids), 900):
        chunk = list(dids[i:i + 900])
        out.update(d for (d,) in conn.execute(
            f"SELECT did FROM tombstones WHERE did IN ({','.join('?' * len(chunk))})", chunk))
    return out


def is_forgotten(conn: sqlite3.Connection, did: str) -> bool:
    return bool(forgotten_of(conn, [did]))


def tombstones(conn: sqlite3.Connection) -> int:
    """How many DIDs this node forgot (status)."""
    return conn.execute("SELECT COUNT(*) FROM tombstones").fetchone()[0]


def _dids_of(conn: sqlite3.Connection, *, did: str | None, source: str | None, scope: str | None) -> list[str]:
    if did is not None:
        return [did] if records.seqs_of(conn, did) else []
    if source is not None:
        sql = "SELECT DISTINCT c.did FROM memory_sources m JOIN containers c ON c.seq = m.seq WHERE m.label = ?"
        arg = source
    else:
        sql = "SELECT DISTINCT c.did FROM scope_members m JOIN containers c ON c.seq = m.seq WHERE m.scope = ?"
        arg = scope
    return [d for (d,) in conn.execute(sql + " ORDER BY c.did", (arg,))]


def forget(conn: sqlite3.Connection, now_us: int, *, did: str | None = None, source: str | None = None,
           scope: str | None = None, protected: tuple[str, str, str] | None = None,
           scrub: bool = False) -> Forgotten:
    """Erase one container, every container stored with `source`, or every one in
    `scope` (exactly one is given), inside the caller's transaction: the rows, the
    index text, tags, links it made, evaluations of it, relay holdings, outbox and
    DHT entries, sources and scope memberships; then tombstone the DIDs. With
    `secure_delete` the freed pages are zeroed, so the payload is not left in the
    database file either.

    With `scrub`, the full-text index is rewritten (FTS5 `optimize`): a deleted
    row's words otherwise stay in the index's older segments until a merge.

    `protected` (class, tag, sender): containers of that class, tag and sender are
    never erased (the agent's journal: a signed chain whose later entries depend
    on every earlier one); ForgetRefused when the selection holds one."""
    assert sum(x is not None for x in (did, source, scope)) == 1
    dids = _dids_of(conn, did=did, source=source, scope=scope)
    if protected is not None and dids:
        class_, tag, sender = protected
        for i in range(0, len(dids), 900):
            chunk = dids[i:i + 900]
            # the unary + keep SQLite on containers_by_did_key (by class or sender it walked every
            # container of the agent: forget p50 189 ms at 100 000, 2.3 ms now)
            marks = ','.join('?' * len(chunk))
            if conn.execute(
                f"SELECT 1 FROM containers c WHERE c.did_key IN ({marks}) AND c.did IN ({marks}) AND +c.class = ?"
                " AND +c.sender = ? AND EXISTS (SELECT 1 FROM tags t WHERE t.tag = ? AND t.seq = c.seq) LIMIT 1",
                (*map(records.did_key, chunk), *chunk, class_, sender, tag)).fetchone():
                raise ForgetRefused("the selection holds entries of the agent's journal")
    out = Forgotten()
    if did is not None and not dids and is_forgotten(conn, did):
        out.already = 1
        return out
    (was,) = conn.execute("PRAGMA secure_delete").fetchone()
    conn.execute("PRAGMA secure_delete = ON")
    try:
        for d in dids:
            seqs = records.seqs_of(conn, d)
            for table in ("memory_sources", "scope_members", "relay_queue", "dht_provide", "outbox"):
                conn.executemany(f"DELETE FROM {table} WHERE seq = ?", [(s,) for s in seqs])
            for sql in ("DELETE FROM evaluations WHERE container = ?", "DELETE FROM evaluations_pending WHERE container = ?",
                        "DELETE FROM backlink_hints WHERE target = ? OR source = ?"):
                conn.execute(sql, (d,) * sql.count("?"))
            out.erased += delete_containers(conn, [d])
            out.tombstoned += conn.execute("INSERT OR IGNORE INTO tombstones (did, forgotten_us, what) VALUES (?, ?, ?)",
                                           (d, now_us, "did" if did else "source" if source else "scope")).rowcount
        if scrub and out.erased:
            conn.execute("INSERT INTO search (search) VALUES ('optimize')")
    finally:
        conn.execute(f"PRAGMA secure_delete = {int(was)}")
    return out


def label(conn: sqlite3.Connection, rows: Iterable[tuple[int, str]]) -> None:
    """(seq, source label) of containers the agent stored."""
    conn.executemany("INSERT OR IGNORE INTO memory_sources (seq, label) VALUES (?, ?)", rows)


def join_scope(conn: sqlite3.Connection, scope: str, seqs: Iterable[int]) -> None:
    conn.executemany("INSERT OR IGNORE INTO scope_members (scope, seq) VALUES (?, ?)", [(scope, s) for s in seqs])


def in_scope(conn: sqlite3.Connection, scope: str, seqs: Sequence[int]) -> set[int]:
    """The seqs among `seqs` that are in `scope`."""
    out: set[int] = set()
    for i in range(0, len(seqs), 900):
        chunk = list(seqs[i:i + 900])
        out.update(s for (s,) in conn.execute(
            f"SELECT seq FROM scope_members WHERE scope = ? AND seq IN ({','.join('?' * len(chunk))})",
            (scope, *chunk)))
    return out
