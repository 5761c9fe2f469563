"""The full-text index (FTS5 table `search`, rowid = container seq) and lifecycle in SQL.

Plain functions over a sqlite3 connection, like `records`. What is indexed and
the lifecycle rules: hmpnode.memory.index. A search or recall in a scope counts
its statistics in the scope alone (`ranked`, `scope_bm25`, `document_frequencies`).
"""

from __future__ import annotations

import math
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hmpnode.store.records import StoredContainer, get_by_seq

__all__ = ["LIFECYCLE_SQL", "SearchQuery", "Hit", "states_of", "index_rows", "unindex", "unindexed", "search", "hits",
           "matched_terms", "evaluation_sums", "recall_hits", "document_frequencies", "DF_CAP", "ranked", "scope_bm25"]

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
    # row (issue 15: 15.7-19.5 against 18.2-24.2 us a row with the commit, docs/benchmarks-journal.md);
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


#: a row of the index that is a member of scope :scope (node-local membership,
#: hmpnode.store.forget, never the container's own tags)
_IN_SCOPE = "EXISTS (SELECT 1 FROM scope_members m WHERE m.scope = :scope AND m.seq = search.rowid)"


def _match_sql(query: SearchQuery, params: dict[str, object], *, bm25: bool, newest_first: bool = False) -> str:
    """The filtered hits of `query` (seq); with `bm25`, their FTS5 BM25 too, the best `:k`
    of them (ties: oldest first, or newest first). Fills `params` with the filter values."""
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
    # the scope is checked per match on the index's rowid, so a scope alone still runs inside
    # the index (at 30 000 rows, 1 in 10 in the scope, p50 of 30 queries: 0.6 ms; joined to
    # containers 19.8 ms; as `rowid IN (members)` 416 ms: FTS5 then probes the index once per member)
    in_scope = ""
    if query.scope is not None:
        in_scope = " AND " + _IN_SCOPE
        params["scope"] = query.scope
    if query.seqs is not None:
        filters.append(f"c.seq IN ({', '.join(f':seq{i}' for i in range(len(query.seqs)))})")
        params.update({f"seq{i}": seq for i, seq in enumerate(query.seqs)})
    score = ", bm25(search) AS score" if bm25 else ""
    ranking = (" ORDER BY score, seq DESC LIMIT :k" if newest_first else " ORDER BY score, seq LIMIT :k") if bm25 else ""
    if filters:
        where = " AND ".join(["search MATCH :match", "c.conflict = 0", *filters])
        return (f"SELECT c.seq AS seq{score} FROM search JOIN containers c ON c.seq = search.rowid"
                f" WHERE {where}{in_scope}{ranking}")
    # Only the full-text match: rank inside the index and join the best k alone
    # (a common word matches much of the store; joining every match cost 2-3x the
    # ranking). Conflict rows are never indexed; the callers' joins still drop one.
    return f"SELECT rowid AS seq{score} FROM search WHERE search MATCH :match{in_scope}{ranking}"


def ranked(conn: sqlite3.Connection, query: SearchQuery, k: int, *, newest_first: bool = False) -> list[tuple[int, float]]:
    """The best `k` hits of `query`: (seq, BM25 score, lower is better), best first, ties
    oldest first (or newest first). Without a scope FTS5 ranks them inside the index, with
    the whole index's statistics; in a scope, `scope_bm25` scores the scope's hits with the
    scope's own: what other memories hold never changes a scoped answer (a caller confined
    to one scope cannot probe another's words through the weights)."""
    params: dict[str, object] = {"match": query.match}
    if query.scope is None:
        return conn.execute(_match_sql(query, params, bm25=True, newest_first=newest_first), {**params, "k": k}).fetchall()
    seqs = [seq for (seq,) in conn.execute(_match_sql(query, params, bm25=False), params)]
    scores = scope_bm25(conn, query.match, seqs, query.scope)
    seqs.sort(key=(lambda s: (scores[s], -s)) if newest_first else (lambda s: (scores[s], s)))
    return [(seq, scores[seq]) for seq in seqs[:k]]


def search(conn: sqlite3.Connection, query: SearchQuery, now_us: int) -> list[tuple[int, float, str, str]]:
    """(seq, bm25 score (lower is better), state, snippet), best first, then by seq.

    The BM25 ranking and the filters run first; lifecycle states and snippets are
    computed for the best rows only (a common word can match most of the store).
    With a state filter, the best `STATE_FILTER_FACTOR * limit` hits are looked at."""
    best = ranked(conn, query, query.limit * (STATE_FILTER_FACTOR if query.states is not None else 1))
    states = states_of(conn, [seq for seq, _ in best], now_us)
    rows = [(seq, score, states[seq][0]) for seq, score in best
            if seq in states and (query.states is None or states[seq][0] in query.states)][: query.limit]
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
        conn.execute("CREATE VIRTUAL TABLE probe_instances USING fts5vocab(probe, instance)")  # `_phrase_counts`
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
    out: dict[int, tuple[str, bool]] = {}
    for i in range(0, len(seqs), 900):
        chunk = list(seqs[i:i + 900])
        marks = ", ".join(f":s{j}" for j in range(len(chunk)))
        sql = (f"SELECT c.seq, {LIFECYCLE_SQL}, EXISTS (SELECT 1 FROM links l WHERE l.source = c.did"
               f" AND l.relation = 'previous_version') FROM containers c WHERE c.conflict = 0 AND c.seq IN ({marks})")
        out.update((seq, (state, bool(head))) for seq, state, head in
                   conn.execute(sql, {"now": now_us, **{f"s{j}": seq for j, seq in enumerate(chunk)}}))
    return out


def recall_hits(conn: sqlite3.Connection, query: SearchQuery, terms: Sequence[str], exprs: Sequence[str],
                now_us: int, *, want: int, max_scan: int, excluded: Sequence[str]) -> tuple[list[Hit], Counter]:
    """The best full-text hits (ties newest first) with their state: ranked (at most
    `max_scan`), then their states read in growing windows (`want`, then 4x as many, ...)
    until `want` of them are in a state not in `excluded`: excluded hits (a long supersede
    chain) cannot crowd out the current ones (issue 12). Each hit says whether it lists a
    previous_version (`head`) and which `terms` (as `exprs`) it matches. Excluded hits are
    only counted, per state (no body read): (hits not excluded, excluded counts)."""
    # ranked once: the best 4 * want first (usually enough), all `max_scan` only when not; a
    # scope's ranking scores every hit of the scope anyway: all `max_scan` at once
    first = min(max_scan, 4 * max(1, want)) if query.scope is None else max_scan
    best = ranked(conn, query, first, newest_first=True)
    ranked_all = len(best) < first
    found: list[tuple[int, float, str, bool]] = []
    eligible, off, k = 0, 0, max(1, want)
    while eligible < want:
        if off + k > len(best) and not ranked_all:
            best = ranked(conn, query, max_scan, newest_first=True)
            ranked_all = True
        if off >= len(best):
            break
        window = best[off:off + k]
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
    hits = [Hit(stored[seq], score, state, "", matched[seq], head) for seq, score, state, head in found
            if seq in stored]
    return hits, Counter(state for _, _, state, _ in found if state in excluded)


def document_frequencies(conn: sqlite3.Connection, exprs: Sequence[str], cap: int = DF_CAP,
                         scope: str | None = None) -> tuple[int, list[int]]:
    """(indexed rows, the rows matching each FTS5 expression, counted up to `cap`), of the
    whole index or of `scope` alone."""
    if scope is None:
        total = conn.execute("SELECT count(*) FROM search_docsize").fetchone()[0]  # FTS5's own row table
        in_scope = ""
    else:
        total = _scope_size(conn, scope)
        in_scope = " AND " + _IN_SCOPE
    counts = [conn.execute(f"SELECT count(*) FROM (SELECT 1 FROM search WHERE search MATCH :e{in_scope} LIMIT :cap)",
                           {"e": e, "cap": cap, "scope": scope}).fetchone()[0] for e in exprs]
    return total, counts


# -- BM25 over a scope's statistics ----------------------------------------------------------


def _scope_size(conn: sqlite3.Connection, scope: str) -> int:
    """The rows of `scope`: its members (each indexed once the indexer caught up, which
    search and recall wait for; counting the index rows of 10 000 members cost 8x more)."""
    return conn.execute("SELECT count(*) FROM scope_members WHERE scope = ?", (scope,)).fetchone()[0]


#: FTS5's bm25() constants
BM25_K1, BM25_B = 1.2, 0.75
#: a scope's mean row length (BM25) is that of its newest rows, at most this many: reading
#: the size of every member per query cost 96 ms at 100 000 members (issue 21)
MEAN_LENGTH_ROWS = 1000
_TOKEN = re.compile(r'\s*(?:"((?:[^"]|"")*)"|(\()|(\))|(AND|OR))')


def _parse(match: str) -> tuple:
    """The tree of an FTS5 expression as the node writes them (quoted phrases, AND, OR,
    parentheses; AND binds tighter than OR): ("phrase", text) or ("AND" | "OR", children)."""
    tokens = [m.groups() for m in _TOKEN.finditer(match)]
    pos = 0

    def joined(op: str) -> tuple:  # an OR of ANDs of atoms
        nonlocal pos
        parts = [joined("AND") if op == "OR" else atom()]
        while pos < len(tokens) and tokens[pos][3] == op:
            pos += 1
            parts.append(joined("AND") if op == "OR" else atom())
        return parts[0] if len(parts) == 1 else (op, parts)

    def atom() -> tuple:
        nonlocal pos
        phrase, opening = tokens[pos][0], tokens[pos][1]
        pos += 1
        if opening:
            inner = joined("OR")
            pos += 1  # ")"
            return inner
        return ("phrase", phrase.replace('""', '"'))

    return joined("OR")


def _phrases(tree: tuple) -> list[str]:
    """The phrases of an expression tree, in order, repeats included (FTS5's phrase list)."""
    return [tree[1]] if tree[0] == "phrase" else [p for child in tree[1] for p in _phrases(child)]


def _counted(tree: tuple, present: dict[str, int], start: int = 0) -> tuple[bool, list[int]]:
    """Whether the expression matches a row holding the phrases `present`, and the indexes
    (in `_phrases` order) of the phrases whose instances FTS5 counts in it: those of the
    sub-expressions that match (a phrase in an AND that fails, or an OR branch that does
    not match, counts nothing, however often the row holds it)."""
    if tree[0] == "phrase":
        return (True, [start]) if tree[1] in present else (False, [])
    found, counted = [], []
    for child in tree[1]:
        ok, indexes = _counted(child, present, start)
        start += len(_phrases(child))
        found.append(ok)
        if ok:
            counted += indexes
    ok = all(found) if tree[0] == "AND" else any(found)
    return ok, counted if ok else []


def _tokens(size: bytes) -> int:
    """The tokens of a row (all columns) from its FTS5 docsize record, one varint per column."""
    if max(size, default=0) < 0x80:
        return sum(size)  # every column under 128 tokens: one byte each
    total = value = 0
    for byte in size:
        value = value << 7 | byte & 0x7F
        if byte < 0x80:
            total, value = total + value, 0
    return total


def _phrase_counts(conn: sqlite3.Connection, phrases: Sequence[str], seqs: Sequence[int]) -> dict[int, dict[str, int]]:
    """seq -> phrase -> its instances in that row (its tokens one after the other in a column),
    as FTS5 counts them: the phrases are tokenized by the probe index (`_probe_index`), and
    where their tokens are is read from the index's instance vocabulary (schema migration 13;
    copying the rows into the probe to tokenize them again made `scope_bm25` 2-3.6x slower:
    161 against 76 ms for 3 000 hits)."""
    probe = _probe_index()
    try:
        with probe:  # the phrases as rows 1, 2, ...: the index's tokens of each, in order
            probe.executemany("INSERT INTO probe (rowid, text) VALUES (?, ?)", [(1 + i, p) for i, p in enumerate(phrases)])
        tokens: dict[int, list[tuple[int, str]]] = {}
        for doc, offset, term in probe.execute("SELECT doc, offset, term FROM probe_instances"):
            tokens.setdefault(doc - 1, []).append((offset, term))
    finally:
        with probe:
            probe.execute("INSERT INTO probe (probe) VALUES ('delete-all')")
    wanted = set(seqs)
    where: dict[str, dict[tuple[int, str], set[int]]] = {}  # token -> (seq, column) -> offsets
    for term in sorted({term for found in tokens.values() for _, term in found}):
        at = where[term] = {}
        for doc, col, offset in conn.execute("SELECT doc, col, offset FROM search_instances WHERE term = ?", (term,)):
            if doc in wanted:
                at.setdefault((doc, col), set()).add(offset)
    out: dict[int, dict[str, int]] = {}
    for i, phrase in enumerate(phrases):
        parts = [term for _, term in sorted(tokens.get(i, []))]
        for (doc, col), starts in where.get(parts[0], {}).items() if parts else ():
            n = sum(1 for o in starts if all(o + k in where[t].get((doc, col), ()) for k, t in enumerate(parts)))
            if n:
                found = out.setdefault(doc, {})
                found[phrase] = found.get(phrase, 0) + n
    return out


def scope_bm25(conn: sqlite3.Connection, match: str, seqs: Sequence[int], scope: str) -> dict[int, float]:
    """seq -> FTS5's bm25() of that row for the expression `match`, computed over the
    statistics of `scope` alone where FTS5 uses the whole index's: its rows, their mean
    length (of its newest `MEAN_LENGTH_ROWS` rows: every one in a smaller scope) and, per
    phrase of `match`, the rows of the scope holding it. The same formula in the same order
    of operations, and the same phrases counted (`_counted`), so a scope holding every row
    of a smaller store scores exactly as FTS5 does (tests/test_search.py)."""
    if not seqs:
        return {}
    rows = _scope_size(conn, scope)
    newest = [_tokens(size) for (size,) in conn.execute(
        "SELECT d.sz FROM scope_members m JOIN search_docsize d ON d.id = m.seq WHERE m.scope = ?"
        " ORDER BY m.seq DESC LIMIT ?", (scope, MEAN_LENGTH_ROWS))]
    avgdl = sum(newest) / max(1, len(newest))
    sizes: dict[int, int] = {}
    for i in range(0, len(seqs), 900):
        chunk = list(seqs[i:i + 900])
        sizes.update((seq, _tokens(size)) for seq, size in conn.execute(
            f"SELECT id, sz FROM search_docsize WHERE id IN ({', '.join('?' * len(chunk))})", chunk))
    tree = _parse(match)
    phrases = _phrases(tree)
    idf: dict[str, float] = {}
    for phrase in dict.fromkeys(phrases):
        hits = conn.execute(f"SELECT count(*) FROM search WHERE search MATCH :p AND {_IN_SCOPE}",
                            {"p": '"' + phrase.replace('"', '""') + '"', "scope": scope}).fetchone()[0]
        value = math.log((rows - hits + 0.5) / (hits + 0.5))
        idf[phrase] = value if value > 0 else 1e-6
    counts = _phrase_counts(conn, list(idf), seqs)
    out = {}
    for seq in seqs:
        found, length = counts.get(seq, {}), float(sizes.get(seq, 0))
        score = 0.0
        for i in _counted(tree, found)[1]:
            f = float(found[phrases[i]])
            score += idf[phrases[i]] * ((f * (BM25_K1 + 1.0)) / (f + BM25_K1 * (1 - BM25_B + BM25_B * length / avgdl)))
        out[seq] = -1.0 * score
    return out
