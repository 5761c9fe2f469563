"""The full-text index (FTS5 table `search`, rowid = container seq) and lifecycle in SQL.

Plain functions over a sqlite3 connection, like `records`. What is indexed and
the lifecycle rules: hmpnode.memory.index.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hmpnode.store.records import StoredContainer, get_by_seq

__all__ = ["LIFECYCLE_SQL", "SearchQuery", "Hit", "states_of", "index_rows", "unindex", "unindexed", "search", "hits",
           "matched_terms", "evaluation_sums", "recall_hits", "document_frequencies", "DF_CAP"]

#: hits looked at per result when searching for some lifecycle states only
STATE_FILTER_FACTOR = 5

#: the lifecycle state of container row `c` at :now (precedence as in hmpnode.memory.index);
#: CROSS JOIN keeps SQLite on the links primary key first (without it, the planner walked
#: every container of the sender: 75 ms for 100 rows at 5 000 containers; the unary + keeps it
#: on containers_by_did_key)
LIFECYCLE_SQL = """
CASE
  WHEN EXISTS (SELECT 1 FROM keys k WHERE k.did = c.sender AND k.revoked_us IS NOT NULL) THEN 'revoked'
  WHEN EXISTS (SELECT 1 FROM links l CROSS JOIN containers n
               ON n.did_key = did_key(l.source) AND n.did = l.source AND n.conflict = 0
               WHERE l.target = c.did AND l.relation = 'contradicts' AND +n.sender = c.sender) THEN 'retracted'
  WHEN EXISTS (SELECT 1 FROM links l CROSS JOIN containers n
               ON n.did_key = did_key(l.source) AND n.did = l.source AND n.conflict = 0
               WHERE l.target = c.did AND l.relation = 'previous_version' AND +n.sender = c.sender) THEN 'superseded'
  WHEN c.ttl_us IS NOT NULL AND c.ttl_us <= :now THEN 'expired'
  WHEN EXISTS (SELECT 1 FROM links l CROSS JOIN containers n
               ON n.did_key = did_key(l.source) AND n.did = l.source AND n.conflict = 0
               WHERE l.target = c.did AND l.relation = 'contradicts')
    OR COALESCE((SELECT SUM(e.value) FROM evaluations e WHERE e.container = c.did), 0) < 0 THEN 'contested'
  ELSE 'active'
END"""


def index_rows(conn: sqlite3.Connection, rows: Iterable[tuple[int, str, str, str]], *, held_only: bool = False) -> None:
    """(seq, text, tags, class) rows; with `held_only`, only of rows still held (the text
    was read before this transaction: the row may have been forgotten since)."""
    rows = list(rows)
    if held_only:  # one lookup for the batch (INSERT ... SELECT ... WHERE EXISTS per row cost FTS5 2x)
        held: set[int] = set()
        for i in range(0, len(rows), 900):
            chunk = [r[0] for r in rows[i:i + 900]]
            held.update(s for (s,) in conn.execute(
                f"SELECT seq FROM containers WHERE conflict = 0 AND seq IN ({','.join('?' * len(chunk))})", chunk))
        rows = [r for r in rows if r[0] in held]
    # a plain INSERT: FTS5 then skips the look for an existing row that OR REPLACE makes per
    # row (issue 15: 15.7-19.5 against 18.2-24.2 us a row with the commit, docs/BENCHMARKS.md);
    # the indexer only hands over rows without an index row, and should one have it after
    # all, the batch is replaced instead
    conn.execute("SAVEPOINT index_rows")
    try:
        conn.executemany("INSERT INTO search (rowid, text, tags, class) VALUES (?, ?, ?, ?)", rows)
    except sqlite3.IntegrityError:
        conn.execute("ROLLBACK TO index_rows")
        conn.executemany("INSERT OR REPLACE INTO search (rowid, text, tags, class) VALUES (?, ?, ?, ?)", rows)
    conn.execute("RELEASE index_rows")


def unindex(conn: sqlite3.Connection, seqs: Sequence[int]) -> None:
    conn.executemany("DELETE FROM search WHERE rowid = ?", [(s,) for s in seqs])


def unindexed(conn: sqlite3.Connection, after_seq: int, limit: int) -> list[int]:
    """Seqs of held containers not in the index yet (rows stored before it existed)."""
    return [s for (s,) in conn.execute(
        "SELECT c.seq FROM containers c WHERE c.seq > ? AND c.conflict = 0"
        " AND NOT EXISTS (SELECT 1 FROM search WHERE rowid = c.seq) ORDER BY c.seq LIMIT ?", (after_seq, limit))]


@dataclass(slots=True)
class SearchQuery:
    match: str  # an FTS5 expression from hmpnode.memory.index.fts_query
    class_: str | None = None
    tag: str | None = None
    sender: str | None = None
    since_us: int | None = None
    until_us: int | None = None
    states: tuple[str, ...] | None = None  # None: every state
    seqs: tuple[int, ...] | None = None  # only these rows (None: all)
    limit: int = 20
    scope: str | None = None  # only members of this scope (hmpnode.store.forget)


def _best_sql(query: SearchQuery, params: dict[str, object], *, newest_first: bool = False) -> str:
    """The BM25-ranked, filtered hits, the best `:k` of them (ties: oldest first, or
    newest first); fills `params` with the filter values."""
    filters: list[str] = []  # on container columns
    for value, name, clause in (
        (query.class_, "class", "c.class = :class"),
        (query.sender, "sender", "c.sender = :sender"),
        (query.since_us, "since", "c.ts_us >= :since"),
        (query.until_us, "until", "c.ts_us < :until"),
        (query.tag, "tag", "EXISTS (SELECT 1 FROM tags t WHERE t.tag = :tag AND t.seq = c.seq)"),
    ):
        if value is not None:
            filters.append(clause)
            params[name] = value
    # scope: node-local membership (hmpnode.store.forget), never the container's own tags;
    # checked per match on the index's rowid, so a scope alone still ranks inside the index
    # (at 30 000 rows, 1 in 10 in the scope, p50 of 30 queries: 0.6 ms; joined to containers
    # 19.8 ms; as `rowid IN (members)` 416 ms: FTS5 then probes the index once per member)
    in_scope = ""
    if query.scope is not None:
        in_scope = " AND EXISTS (SELECT 1 FROM scope_members m WHERE m.scope = :scope AND m.seq = search.rowid)"
        params["scope"] = query.scope
    if query.seqs is not None:
        filters.append(f"c.seq IN ({', '.join(f':seq{i}' for i in range(len(query.seqs)))})")
        params.update({f"seq{i}": seq for i, seq in enumerate(query.seqs)})
    order = "score, seq DESC" if newest_first else "score, seq"
    if filters:
        where = " AND ".join(["search MATCH :match", "c.conflict = 0", *filters])
        return (f"SELECT c.seq AS seq, bm25(search) AS score FROM search JOIN containers c ON c.seq = search.rowid"
                f" WHERE {where}{in_scope} ORDER BY {order} LIMIT :k")
    # Only the full-text match: rank inside the index and join the best k alone
    # (a common word matches much of the store; joining every match cost 2-3x the
    # ranking). Conflict rows are never indexed; the join below still drops one.
    return (f"SELECT rowid AS seq, bm25(search) AS score FROM search WHERE search MATCH :match{in_scope}"
            f" ORDER BY {order} LIMIT :k")


def search(conn: sqlite3.Connection, query: SearchQuery, now_us: int) -> list[tuple[int, float, str, str]]:
    """(seq, bm25 score (lower is better), state, snippet), best first, then by seq.

    The BM25 ranking and the filters run first; lifecycle states and snippets are
    computed for the best rows only (a common word can match most of the store).
    With a state filter, the best `STATE_FILTER_FACTOR * limit` hits are looked at."""
    params: dict[str, object] = {"match": query.match, "now": now_us}
    best = _best_sql(query, params)
    params["k"] = query.limit * (STATE_FILTER_FACTOR if query.states is not None else 1)
    sql = (f"SELECT c.seq, b.score, {LIFECYCLE_SQL} AS state FROM ({best}) b JOIN containers c ON c.seq = b.seq"
           " AND c.conflict = 0")
    if query.states is not None:
        marks = ", ".join(f":state{i}" for i in range(len(query.states)))
        sql = f"SELECT * FROM ({sql}) WHERE state IN ({marks})"
        params.update({f"state{i}": st for i, st in enumerate(query.states)})
    rows = conn.execute(sql + " ORDER BY 2, 1", params).fetchall()[: query.limit]
    out = []
    for seq, score, state in rows:
        snip = conn.execute("SELECT snippet(search, 0, '[', ']', '…', 12) FROM search"
                            " WHERE search MATCH ? AND rowid = ?", (query.match, seq)).fetchone()[0]
        out.append((seq, score, state, snip))
    return out


@dataclass(slots=True)
class Hit:
    row: StoredContainer
    score: float  # bm25, lower is better
    state: str
    snippet: str
    matched: list[str]  # the query terms it matches, in query order
    head: bool = False  # it lists a previous_version (recall_hits only)


def hits(conn: sqlite3.Connection, query: SearchQuery, terms: Sequence[str], now_us: int) -> list[Hit]:
    """`search` with each hit's stored row and matched terms (what search and recall show)."""
    found = search(conn, query, now_us)
    seqs = [seq for seq, *_ in found]
    rows = {r.seq: r for r in get_by_seq(conn, seqs)}
    matched = matched_terms(conn, terms, seqs)
    return [Hit(rows[seq], score, state, snip, matched[seq]) for seq, score, state, snip in found]


#: the full-text index's tokenizer (schema migration 3): the in-memory probe index of
#: `matched_terms` must tokenize exactly as the index does
TOKENIZE = "porter unicode61 remove_diacritics 2"
_probe = threading.local()


def _probe_index() -> sqlite3.Connection:
    """A per-thread in-memory FTS5 table with the columns and tokenizer of `search`."""
    conn = getattr(_probe, "conn", None)
    if conn is None:
        conn = sqlite3.connect(":memory:", check_same_thread=True)
        conn.execute(f"CREATE VIRTUAL TABLE probe USING fts5(text, tags, class, content = '',"
                     f" tokenize = '{TOKENIZE}')")  # contentless: emptied at once by 'delete-all'
        _probe.conn = conn
    return conn


def matched_terms(conn: sqlite3.Connection, terms: Sequence[str], seqs: Sequence[int],
                  exprs: Sequence[str] | None = None) -> dict[int, list[str]]:
    """seq -> the query terms (in order) that its indexed text matches, as FTS5 matches them
    (term i as the FTS5 expression `exprs[i]` when given, else as a quoted literal).

    The rows' indexed text is copied into a small in-memory FTS5 table with the same
    tokenizer and each term is matched there: asking the store's index whether a common
    term matches 100 given rows cost 5-50 ms per term at 100 000 rows (issue 12)."""
    out: dict[int, list[str]] = {s: [] for s in seqs}
    if not seqs:
        return out
    rows = conn.execute(f"SELECT rowid, text, tags, class FROM search WHERE rowid IN ({', '.join('?' * len(seqs))})",
                        list(seqs)).fetchall()
    probe = _probe_index()
    try:
        with probe:
            probe.executemany("INSERT INTO probe (rowid, text, tags, class) VALUES (?, ?, ?, ?)", rows)
        for i, term in enumerate(terms):
            literal = exprs[i] if exprs is not None else '"' + term.replace('"', '""') + '"'
            for (seq,) in probe.execute("SELECT rowid FROM probe WHERE probe MATCH ?", (literal,)):
                out[seq].append(term)
    finally:
        with probe:
            probe.execute("INSERT INTO probe (probe) VALUES ('delete-all')")
    return out


def evaluation_sums(conn: sqlite3.Connection, dids: Sequence[str]) -> dict[str, float]:
    """container DID -> the sum of its active evaluations' values (held ones only)."""
    out: dict[str, float] = {}
    for i in range(0, len(dids), 500):
        chunk = list(dids[i:i + 500])
        out.update(conn.execute(
            f"SELECT container, SUM(value) FROM evaluations WHERE container IN ({', '.join('?' * len(chunk))})"
            " GROUP BY container", chunk).fetchall())
    return out


#: document frequencies are counted up to this many rows (a term in more is common: its
#: weight in recall is taken at this count, which bounds the cost of the count)
DF_CAP = 2000


def states_of(conn: sqlite3.Connection, seqs: Sequence[int], now_us: int) -> dict[int, tuple[str, bool]]:
    """{seq: (lifecycle state at `now_us`, whether it lists a previous_version)} of the
    held rows among `seqs` (a conflict row is not held)."""
    marks = ", ".join(f":s{i}" for i in range(len(seqs)))
    sql = (f"SELECT c.seq, {LIFECYCLE_SQL}, EXISTS (SELECT 1 FROM links l WHERE l.source = c.did"
           f" AND l.relation = 'previous_version') FROM containers c WHERE c.conflict = 0 AND c.seq IN ({marks})")
    return {seq: (state, bool(head)) for seq, state, head in
            conn.execute(sql, {"now": now_us, **{f"s{i}": seq for i, seq in enumerate(seqs)}})}


def recall_hits(conn: sqlite3.Connection, query: SearchQuery, terms: Sequence[str], exprs: Sequence[str],
                now_us: int, *, want: int, max_scan: int, excluded: Sequence[str]) -> tuple[list[Hit], Counter]:
    """The best full-text hits (ties newest first) with their state: ranked (at most
    `max_scan`), then their states read in growing windows (`want`, then 4x as many, ...)
    until `want` of them are in a state not in `excluded`: excluded hits (a long supersede
    chain) cannot crowd out the current ones (issue 12). Each hit says whether it lists a
    previous_version (`head`) and which `terms` (as `exprs`) it matches. Excluded hits are
    only counted, per state (no body read): (hits not excluded, excluded counts)."""
    # ranked once: the best 4 * want first (usually enough), all `max_scan` only when not
    params: dict[str, object] = {"match": query.match}
    best = _best_sql(query, params, newest_first=True)
    ranked = conn.execute(best, {**params, "k": min(max_scan, 4 * max(1, want))}).fetchall()
    ranked_all = len(ranked) < min(max_scan, 4 * max(1, want))
    found: list[tuple[int, float, str, int]] = []
    eligible, off, k = 0, 0, max(1, want)
    while eligible < want:
        if off + k > len(ranked) and not ranked_all:
            ranked = conn.execute(best, {**params, "k": max_scan}).fetchall()
            ranked_all = True
        if off >= len(ranked):
            break
        window = ranked[off:off + k]
        states = states_of(conn, [seq for seq, _ in window], now_us)
        for seq, score in window:
            if seq in states:
                state, head = states[seq]
                found.append((seq, score, state, head))
                eligible += state not in excluded
        off += k
        k *= 4
    # excluded hits are only counted: no body read, no term matching
    seqs = [r[0] for r in found if r[2] not in excluded]
    stored = {r.seq: r for r in get_by_seq(conn, seqs)}
    matched = matched_terms(conn, terms, seqs, exprs)
    hits = [Hit(stored[seq], score, state, "", matched[seq], bool(head)) for seq, score, state, head in found
            if seq in stored]
    return hits, Counter(state for _, _, state, _ in found if state in excluded)


def document_frequencies(conn: sqlite3.Connection, exprs: Sequence[str], cap: int = DF_CAP) -> tuple[int, list[int]]:
    """(indexed rows, the rows matching each FTS5 expression, counted up to `cap`)."""
    total = conn.execute("SELECT count(*) FROM search_docsize").fetchone()[0]  # FTS5's own row table
    counts = [conn.execute("SELECT count(*) FROM (SELECT 1 FROM search WHERE search MATCH ? LIMIT ?)",
                           (e, cap)).fetchone()[0] for e in exprs]
    return total, counts
