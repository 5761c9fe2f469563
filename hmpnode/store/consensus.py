"""Store reads for consensus and trust (hmpnode.consensus, hmpnode.trust)."""

from __future__ import annotations

import sqlite3

from hmpnode.store.records import StoredContainer, _COLUMNS, row_to_stored

__all__ = ["replies_of", "trust_rows", "proposals_to_close"]


def replies_of(conn: sqlite3.Connection, did: str, class_: str, limit: int) -> list[StoredContainer]:
    """Held containers of `class_` whose related.in_reply_to names `did`, oldest first."""
    columns = ", ".join(f"c.{c.strip()}" for c in _COLUMNS.split(","))
    rows = conn.execute(
        f"SELECT {columns} FROM links l JOIN containers c ON c.did_key = did_key(l.source) AND c.did = l.source"
        " AND c.conflict = 0"
        " WHERE l.target = ? AND l.relation = 'in_reply_to' AND c.class = ? ORDER BY c.seq LIMIT ?",
        (did, class_, limit))
    return [row_to_stored(r) for r in rows]


def trust_rows(conn: sqlite3.Connection, agent: str) -> list[tuple[str, float, int]]:
    """(evaluator, mean value, count) of active evaluations of `agent`'s containers by
    other agents: one row per evaluator."""
    return conn.execute(
        "SELECT e.agent, AVG(e.value), COUNT(*) FROM containers c JOIN evaluations e ON e.container = c.did"
        " WHERE c.sender = ? AND c.conflict = 0 AND e.agent <> c.sender GROUP BY e.agent ORDER BY e.agent",
        (agent,)).fetchall()


def proposals_to_close(conn: sqlite3.Connection, proposer: str, due_us: int, limit: int = 100) -> list[str]:
    """`proposer`'s proposals whose ttl is at or before `due_us` and that no
    consensus_result of `proposer` answers yet."""
    rows = conn.execute(
        "SELECT p.did FROM containers p WHERE p.class = 'proposal' AND p.sender = ? AND p.conflict = 0"
        " AND p.ttl_us IS NOT NULL AND p.ttl_us <= ? AND NOT EXISTS ("
        "  SELECT 1 FROM links l JOIN containers r ON r.did_key = did_key(l.source) AND r.did = l.source"
        "  WHERE l.target = p.did AND l.relation = 'in_reply_to' AND r.class = 'consensus_result'"
        "  AND r.sender = p.sender) ORDER BY p.ttl_us LIMIT ?",
        (proposer, due_us, limit))
    return [r[0] for r in rows]
