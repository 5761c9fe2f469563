"""SQLite schema of the node's store, versioned; each migration runs once, in order.

Every container row has an integer `seq` (its rowid, in ingest order): list
cursors and the event stream resume from it, and an FTS5 index can later use
it as its rowid (`content=''` table keyed by seq) without a rewrite.
"""

from __future__ import annotations

import sqlite3

from hmpnode.store.records import sql_functions

MIGRATIONS: list[str] = [
    # 1: containers, their searchable columns, links, evaluations, keys
    """
    CREATE TABLE containers (
        seq          INTEGER PRIMARY KEY AUTOINCREMENT,
        did          TEXT    NOT NULL,
        signature    TEXT    NOT NULL,
        payload_hash TEXT    NOT NULL,
        class        TEXT    NOT NULL,
        subclass     TEXT,
        sender       TEXT    NOT NULL,
        timestamp    TEXT    NOT NULL,
        ts_us        INTEGER NOT NULL,
        ttl_us       INTEGER,
        network      TEXT    NOT NULL DEFAULT '',
        broadcast    INTEGER NOT NULL DEFAULT 0,
        encrypted    INTEGER NOT NULL DEFAULT 0,
        flags        TEXT    NOT NULL DEFAULT '',
        conflict     INTEGER NOT NULL DEFAULT 0,
        size         INTEGER NOT NULL,
        received_us  INTEGER NOT NULL,
        source       TEXT    NOT NULL,
        body         BLOB    NOT NULL
    );
    CREATE INDEX containers_by_did    ON containers (did);
    CREATE INDEX containers_by_class  ON containers (class, seq);
    CREATE INDEX containers_by_sender ON containers (sender, seq);
    CREATE INDEX containers_by_time   ON containers (ts_us, seq);
    CREATE TABLE tags (tag TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (tag, seq)) WITHOUT ROWID;
    CREATE TABLE recipients (did TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (did, seq)) WITHOUT ROWID;
    -- related: source container -relation-> target DID (the target may not be held yet)
    CREATE TABLE links (
        target   TEXT NOT NULL,
        relation TEXT NOT NULL,
        source   TEXT NOT NULL,
        PRIMARY KEY (target, relation, source)
    ) WITHOUT ROWID;
    CREATE INDEX links_by_source ON links (source);
    -- backlinks reported by other nodes whose referencing container we do not hold yet
    CREATE TABLE backlink_hints (
        target   TEXT NOT NULL,
        relation TEXT NOT NULL,
        source   TEXT NOT NULL,
        reporter TEXT NOT NULL,
        PRIMARY KEY (target, relation, source)
    ) WITHOUT ROWID;
    -- one active evaluation item per (container, agent); pending ones wait for their target
    CREATE TABLE evaluations (
        container TEXT    NOT NULL,
        agent     TEXT    NOT NULL,
        ts_us     INTEGER NOT NULL,
        signature TEXT    NOT NULL,
        value     REAL    NOT NULL,
        item      BLOB    NOT NULL,
        PRIMARY KEY (container, agent)
    ) WITHOUT ROWID;
    CREATE TABLE evaluations_pending (
        container TEXT NOT NULL,
        target    TEXT NOT NULL,
        agent     TEXT NOT NULL,
        signature TEXT NOT NULL,
        item      BLOB NOT NULL,
        PRIMARY KEY (container, agent, signature)
    ) WITHOUT ROWID;
    CREATE INDEX evaluations_pending_by_target ON evaluations_pending (target);
    -- key registry: pinned keys (TOFU) and revocations (profile section 4)
    CREATE TABLE keys (
        did        TEXT PRIMARY KEY,
        public_key BLOB,
        pinned_us  INTEGER,
        revoked_us INTEGER
    );
    """,
    # 2: the mesh: known peers, per-peer sync cursors, relay holdings, the sender's outbox
    """
    -- peers this node learned of (LAN, DHT, connections); survives restarts
    CREATE TABLE peers (
        did            TEXT PRIMARY KEY,
        announce       BLOB,
        addresses      TEXT    NOT NULL DEFAULT '[]',
        roles          TEXT    NOT NULL DEFAULT '[]',
        mailman        TEXT    NOT NULL DEFAULT '[]',
        announced_us   INTEGER NOT NULL DEFAULT 0,
        source         TEXT    NOT NULL,
        last_seen_us   INTEGER NOT NULL,
        last_contact_us INTEGER,
        sync_cursor    TEXT    NOT NULL DEFAULT ''
    );
    -- relay role: containers held for recipients other than this node's agent
    CREATE TABLE relay_queue (
        recipient TEXT    NOT NULL,
        seq       INTEGER NOT NULL,
        did       TEXT    NOT NULL,
        size      INTEGER NOT NULL,
        PRIMARY KEY (recipient, seq)
    ) WITHOUT ROWID;
    CREATE INDEX relay_queue_by_did ON relay_queue (did);
    -- unsigned relay_chain carried by a container when it arrived (profile section 11)
    CREATE TABLE relay_chains (seq INTEGER PRIMARY KEY, chain BLOB NOT NULL);
    -- directed containers of this node's agent not yet handed to a recipient or a relay
    CREATE TABLE outbox (
        did       TEXT    NOT NULL,
        recipient TEXT    NOT NULL,
        seq       INTEGER NOT NULL,
        tries     INTEGER NOT NULL DEFAULT 0,
        next_us   INTEGER NOT NULL,
        PRIMARY KEY (did, recipient)
    ) WITHOUT ROWID;
    CREATE INDEX outbox_by_next ON outbox (next_us);
    """,
    # 3: full-text search (FTS5, BM25) over the text of stored containers, rowid = seq;
    # filled by the node (hmpnode.memory.index), also for rows stored before this version
    """
    CREATE VIRTUAL TABLE search USING fts5(
        text, tags, class,
        tokenize = 'porter unicode61 remove_diacritics 2'
    );
    """,
    # 4: peers (DIDs) and addresses the mesh ignores for a while, kept across restarts
    """
    CREATE TABLE bans (key TEXT PRIMARY KEY, until_us INTEGER NOT NULL) WITHOUT ROWID;
    """,
    # 5: relay holdings say whose they are and when they end (docs/protocol.md 24.1): the
    # sending peer and its address (quotas per sender), whether the recipient was known
    # (a node-wide pool for never-seen recipients) and the end of the hold (ttl, at most
    # relay.max_hold_seconds; holdings of older versions get 7 days from their receipt)
    """
    ALTER TABLE relay_queue ADD COLUMN sender TEXT NOT NULL DEFAULT '';
    ALTER TABLE relay_queue ADD COLUMN sender_addr TEXT NOT NULL DEFAULT '';
    ALTER TABLE relay_queue ADD COLUMN known INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE relay_queue ADD COLUMN until_us INTEGER NOT NULL DEFAULT 0;
    UPDATE relay_queue SET until_us = COALESCE((SELECT COALESCE(c.ttl_us, c.received_us + 604800000000)
                                                FROM containers c WHERE c.seq = relay_queue.seq), 0);
    CREATE INDEX relay_queue_by_sender ON relay_queue (sender, size);
    CREATE INDEX relay_queue_by_addr ON relay_queue (sender_addr, size);
    CREATE INDEX relay_queue_by_known ON relay_queue (known, size);
    CREATE INDEX relay_queue_by_until ON relay_queue (until_us);
    """,
    # 6: the agent's containers that have a DHT provider record, and when each is signed
    # and stored next (hmpnode.store.mesh.provide_*: the newest few, kept here, not in memory)
    """
    CREATE TABLE dht_provide (seq INTEGER PRIMARY KEY, did TEXT NOT NULL, next_us INTEGER NOT NULL);
    CREATE INDEX dht_provide_by_next ON dht_provide (next_us, seq);
    """,
    # 7: per-peer catch-up cursors are gone (v2 catches up by reconciliation, docs/protocol.md 22.4)
    """
    ALTER TABLE peers DROP COLUMN sync_cursor;
    """,
    # 8: forget, sources, scopes (hmpnode.store.forget): node-local, never signed nor sent.
    # The source label the agent named when it stored a container; scope membership (the
    # agent's own when stored with a scope, others only when accepted); tombstones of
    # forgotten DIDs (ingest refuses them, reads answer 410)
    """
    CREATE TABLE memory_sources (seq INTEGER PRIMARY KEY, label TEXT NOT NULL);
    CREATE INDEX memory_sources_by_label ON memory_sources (label);
    CREATE TABLE scope_members (scope TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (scope, seq)) WITHOUT ROWID;
    CREATE INDEX scope_members_by_seq ON scope_members (seq);
    CREATE TABLE tombstones (did TEXT PRIMARY KEY, forgotten_us INTEGER NOT NULL, what TEXT NOT NULL) WITHOUT ROWID;
    """,
    # 9: containers are looked up by an integer key of their DID (hmpnode.store.records.did_key,
    # a 64-bit hash; the DID text is compared after it): the random text index on `did` made
    # every insert slower (issue 15). No constraint needs that index (conflict rows share a DID).
    """
    ALTER TABLE containers ADD COLUMN did_key INTEGER NOT NULL DEFAULT 0;
    UPDATE containers SET did_key = did_key(did);
    CREATE INDEX containers_by_did_key ON containers (did_key);
    DROP INDEX containers_by_did;
    """,
    # 10 (issue 14, container_delta `removed`): the containers
    # whose ttl passes, found by an index range each flush (hmpnode.net.delta) instead of a
    # scan of the whole table; only rows with a ttl are in it
    """
    CREATE INDEX containers_by_ttl ON containers (ttl_us) WHERE ttl_us IS NOT NULL;
    """,
    # 11: what waits in the outbox for one recipient, read when it connects (hmpnode.net.outbox,
    # protocol.md 23.3): an index range instead of a scan of the outbox on every connection
    """
    CREATE INDEX outbox_by_recipient ON outbox (recipient, next_us);
    """,
    # 12: the full-text index merges its segments 8 at a time, not 4 (FTS5 `automerge`): each
    # indexer step writes a small segment, and with 4 every row was rewritten by merges about
    # half again as often; a FTS5 query visits a few more segments (issue 15, docs/benchmarks-journal.md)
    """
    INSERT INTO search (search, rank) VALUES ('automerge', 8);
    """,
    # 13: when an outbox entry was last handed to a peer (hmpnode.net.outbox): woken when a
    # path to its recipient comes back, it is sent again on a connection that carried it
    # only once its acknowledgement is overdue (peer ack_timeout)
    """
    ALTER TABLE outbox ADD COLUMN pushed_us INTEGER NOT NULL DEFAULT 0;
    """,
    # 14: where each token of the full-text index is (row, column, offset): FTS5's vocabulary
    # view of `search`, no storage of its own; a scope's BM25 counts the query's phrases in
    # its rows from it (hmpnode.store.search.scope_bm25, issue 21)
    """
    CREATE VIRTUAL TABLE search_instances USING fts5vocab(search, instance);
    """,
]


def current_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


class NewerSchema(RuntimeError):
    """The store was written by a newer hmpnode: this one cannot use it."""


def migrate(conn: sqlite3.Connection, upto: int | None = None) -> int:
    """Bring the database to the newest schema (or to version `upto`, for tests of a
    migration); returns the version reached."""
    sql_functions(conn)  # migration 9 fills did_key
    version = current_version(conn)
    if version > len(MIGRATIONS):
        raise NewerSchema(
            f"database schema version {version} is newer than this hmpnode ({len(MIGRATIONS)}); upgrade hmpnode"
        )
    for number in range(version, len(MIGRATIONS) if upto is None else upto):
        # One transaction per migration: the schema and its version move together.
        conn.executescript("BEGIN IMMEDIATE;" + MIGRATIONS[number] + f"PRAGMA user_version = {number + 1};COMMIT;")
    return current_version(conn)
