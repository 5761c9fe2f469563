"""Rows the mesh keeps: known peers, relay holdings, the outbox.

Plain functions over a sqlite3 connection, like `records`; the caller picks
the thread and the transaction. Relay holdings and outbox entries are written
in the same transaction as the container they concern (a store hook of the
node), so an acknowledged container is never stored without them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from hmpnode.net.relayquota import RelayUsage
from hmpnode.store import records
from hmpnode.store.records import StoredContainer, get_by_seq

__all__ = [
    "PeerRow",
    "upsert_peer",
    "load_peers",
    "touch_peer",
    "delete_peers",
    "Stored",
    "stored_after",
    "provided_after",
    "containers_after",
    "sync_rows",
    "relay_hold",
    "relay_usage",
    "relay_usage_of",
    "relay_clamp",
    "relay_release",
    "relay_expired",
    "relay_held_for",
    "relay_counts",
    "save_relay_chain",
    "relay_chain_of",
    "delete_containers",
    "outbox_add",
    "outbox_due",
    "outbox_done",
    "outbox_retry",
    "outbox_count",
    "provide_add",
    "provide_due",
    "provide_done",
    "provide_next_us",
    "provide_count",
    "Facts",
    "facts_of",
    "expiring",
    "revoked_held",
    "relay_drop",
]


@dataclass(slots=True)
class PeerRow:
    did: str
    announce: bytes | None
    addresses: list[str]
    roles: list[str]
    mailman: list[str]
    announced_us: int
    source: str
    last_seen_us: int
    last_contact_us: int | None = None


def upsert_peer(conn: sqlite3.Connection, row: PeerRow) -> None:
    """Insert or refresh a peer; an older announce never replaces a newer one,
    and the contact time survives a refresh."""
    conn.execute(
        "INSERT INTO peers (did, announce, addresses, roles, mailman, announced_us, source, last_seen_us,"
        " last_contact_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (did) DO UPDATE SET"
        "  announce = CASE WHEN excluded.announced_us >= peers.announced_us THEN excluded.announce ELSE peers.announce END,"
        "  addresses = CASE WHEN excluded.announced_us >= peers.announced_us THEN excluded.addresses ELSE peers.addresses END,"
        "  roles = CASE WHEN excluded.announced_us >= peers.announced_us THEN excluded.roles ELSE peers.roles END,"
        "  mailman = CASE WHEN excluded.announced_us >= peers.announced_us THEN excluded.mailman ELSE peers.mailman END,"
        "  announced_us = MAX(peers.announced_us, excluded.announced_us),"
        "  last_seen_us = MAX(peers.last_seen_us, excluded.last_seen_us),"
        "  last_contact_us = NULLIF(MAX(COALESCE(excluded.last_contact_us, 0), COALESCE(peers.last_contact_us, 0)), 0)",
        (row.did, row.announce, orjson.dumps(row.addresses).decode(), orjson.dumps(row.roles).decode(),
         orjson.dumps(row.mailman).decode(), row.announced_us, row.source, row.last_seen_us, row.last_contact_us),
    )


def load_peers(conn: sqlite3.Connection) -> list[PeerRow]:
    rows = conn.execute(
        "SELECT did, announce, addresses, roles, mailman, announced_us, source, last_seen_us, last_contact_us"
        " FROM peers"
    )
    return [
        PeerRow(did, announce, orjson.loads(addrs), orjson.loads(roles), orjson.loads(mailman), announced_us,
                source, seen, contact)
        for did, announce, addrs, roles, mailman, announced_us, source, seen, contact in rows
    ]


def touch_peer(conn: sqlite3.Connection, did: str, now_us: int) -> None:
    conn.execute("UPDATE peers SET last_contact_us = ?, last_seen_us = MAX(last_seen_us, ?) WHERE did = ?",
                 (now_us, now_us, did))


def delete_peers(conn: sqlite3.Connection, dids: Sequence[str]) -> None:
    """Forget peers (the table is bounded: hmpnode.net.dialing.peers_to_drop)."""
    if dids:
        conn.executemany("DELETE FROM peers WHERE did = ?", [(d,) for d in dids])


@dataclass(slots=True)
class Stored:
    """What the forward loop needs to know of a new row before reading its body."""

    seq: int
    did: str
    source: str
    network: str
    broadcast: bool


def stored_after(conn: sqlite3.Connection, after_seq: int, limit: int) -> list[Stored]:
    return [Stored(seq, did, source, network, bool(broadcast)) for seq, did, source, network, broadcast in conn.execute(
        "SELECT seq, did, source, network, broadcast FROM containers WHERE seq > ? AND conflict = 0"
        " ORDER BY seq LIMIT ?", (after_seq, limit))]


def provided_after(conn: sqlite3.Connection, after_seq: int, limit: int) -> tuple[int, list[Stored]]:
    """`stored_after` for a node without peers: (the seq up to which every row was looked
    at, the agent's unscoped broadcasts among them, the only rows the forward loop then
    acts on: hmpnode.net.provide); no Python object per other row (issue 15)."""
    top = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM containers").fetchone()[0]
    marks = [Stored(seq, did, "agent", "", True) for seq, did in conn.execute(
        "SELECT seq, did FROM containers WHERE seq > ? AND conflict = 0 AND source = 'agent' AND broadcast = 1"
        " AND network = '' ORDER BY seq LIMIT ?", (after_seq, limit))]
    return (marks[-1].seq if len(marks) == limit else max(top, after_seq)), marks


def containers_after(conn: sqlite3.Connection, after_seq: int, limit: int) -> list[StoredContainer]:
    """Held containers in ingest order after `after_seq` (the delta a peer asks for)."""
    seqs = [s for (s,) in conn.execute(
        "SELECT seq FROM containers WHERE seq > ? AND conflict = 0 ORDER BY seq LIMIT ?", (after_seq, limit)
    )]
    return get_by_seq(conn, seqs)


def sync_rows(conn: sqlite3.Connection, after_ttl_us: int, after_seq: int = 0) -> tuple[int, list]:
    """(last seq, held broadcast containers stored after `after_seq` whose ttl is after
    `after_ttl_us`): what catch-up
    reconciles (hmpnode.net.syncset); call it in one read transaction (Database.read) so
    that the seq matches the rows."""
    from hmpnode.net.syncset import SyncRow

    last = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM containers").fetchone()[0]
    rows = [SyncRow(*r) for r in conn.execute(
        "SELECT seq, did, ts_us, ttl_us, network FROM containers WHERE broadcast = 1 AND conflict = 0"
        " AND seq > ? AND (ttl_us IS NULL OR ttl_us > ?)", (after_seq, after_ttl_us))]
    return last, rows


# -- relay holdings ----------------------------------------------------------------


#: until_us of a holding that never ends by itself (given no end and no ttl)
NEVER_US = 2**63 - 1


def relay_hold(conn: sqlite3.Connection, entries: Iterable[tuple]) -> None:
    """Rows held until that recipient acknowledges or `until_us`: (recipient, seq, did,
    size, sender, sender_addr, known, until_us); the last four may be left off
    (no sender, a known recipient, until the container's ttl or for ever)."""
    conn.executemany(
        "INSERT OR IGNORE INTO relay_queue (recipient, seq, did, size, sender, sender_addr, known, until_us)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, COALESCE(?, (SELECT ttl_us FROM containers WHERE seq = ?), ?))",
        ((*e[:4], *(e[4:] if len(e) > 4 else ("", "", 1, None)), e[1], NEVER_US) for e in entries),
    )


def relay_usage(conn: sqlite3.Connection, recipient: str | None = None) -> tuple[int, int]:
    """(containers, bytes) held for one recipient, or in all."""
    if recipient is None:
        row = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM relay_queue").fetchone()
    else:
        row = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM relay_queue WHERE recipient = ?",
                           (recipient,)).fetchone()
    return row[0], row[1]


def relay_usage_of(conn: sqlite3.Connection, recipients: Iterable[str], sender: str,
                   sender_addr: str | None) -> RelayUsage:
    """What the relay quotas (hmpnode.net.relayquota) are checked against, each an
    index lookup but the total: held for these recipients, for this sender and its
    address, for unknown recipients, and in all."""
    def one(sql: str, *args) -> list[int]:
        count, size = conn.execute(sql, args).fetchone()
        return [count, size]

    usage = RelayUsage(total=list(relay_usage(conn)),
                       unknown=one("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM relay_queue WHERE known = 0"))
    usage.recipients = {r: list(relay_usage(conn, r)) for r in recipients}
    usage.senders[sender] = one("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM relay_queue WHERE sender = ?", sender)
    if sender_addr is not None:
        usage.addresses[sender_addr] = one(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM relay_queue WHERE sender_addr = ?", sender_addr)
    return usage


def relay_held_for(conn: sqlite3.Connection, recipient: str, after_seq: int, limit: int) -> list[StoredContainer]:
    seqs = [s for (s,) in conn.execute(
        "SELECT seq FROM relay_queue WHERE recipient = ? AND seq > ? ORDER BY seq LIMIT ?", (recipient, after_seq, limit)
    )]
    return get_by_seq(conn, seqs)


def relay_counts(conn: sqlite3.Connection) -> dict[str, int]:
    count, size = relay_usage(conn)
    recipients = conn.execute("SELECT COUNT(DISTINCT recipient) FROM relay_queue").fetchone()[0]
    unknown = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM relay_queue WHERE known = 0").fetchone()
    senders = conn.execute("SELECT COUNT(DISTINCT sender) FROM relay_queue WHERE sender != ''").fetchone()[0]
    return {"held": count, "bytes": size, "recipients": recipients, "senders": senders,
            "unknown_recipients_held": unknown[0], "unknown_recipients_bytes": unknown[1]}


def relay_release(conn: sqlite3.Connection, recipient: str, dids: Sequence[str], own_did: str) -> int:
    """`recipient` acknowledged `dids`: drop its holdings, then delete every
    container held only for others that nobody waits for any more. Returns
    how many holdings were released."""
    released = 0
    orphans: list[str] = []
    for did in dids:
        cur = conn.execute("DELETE FROM relay_queue WHERE recipient = ? AND did = ?", (recipient, did))
        if cur.rowcount:
            released += cur.rowcount
            orphans.append(did)
    delete_containers(conn, [d for d in orphans if _only_for_others(conn, d, own_did)])
    return released


def relay_expired(conn: sqlite3.Connection, now_us: int, own_did: str) -> int:
    """Drop holdings whose end has come: the container's ttl (profile section 12: never
    forwarded) or the relay's longest hold, whichever is first (an index range)."""
    rows = conn.execute("SELECT recipient, did FROM relay_queue WHERE until_us <= ?", (now_us,)).fetchall()
    dids = sorted({did for _, did in rows})
    conn.executemany("DELETE FROM relay_queue WHERE recipient = ? AND did = ?", rows)
    delete_containers(conn, [d for d in dids if _only_for_others(conn, d, own_did)])
    return len(rows)


def relay_ending(conn: sqlite3.Connection, until_us: int) -> dict[str, int]:
    """Recipient -> its holdings that end by `until_us` (an index range)."""
    return dict(conn.execute(
        "SELECT recipient, COUNT(*) FROM relay_queue WHERE until_us <= ? GROUP BY recipient", (until_us,)))


def relay_clamp(conn: sqlite3.Connection, until_us: int) -> int:
    """No holding ends after `until_us` (now + relay.max_hold_seconds, when that setting
    was lowered since they were made); returns how many were shortened."""
    return conn.execute("UPDATE relay_queue SET until_us = ? WHERE until_us > ?", (until_us, until_us)).rowcount


def _only_for_others(conn: sqlite3.Connection, did: str, own_did: str) -> bool:
    """Held only as a relay: nobody waits for it, it is not ours, not for us, not a broadcast."""
    if conn.execute("SELECT 1 FROM relay_queue WHERE did = ? LIMIT 1", (did,)).fetchone():
        return False
    row = conn.execute("SELECT seq, source, broadcast FROM containers WHERE did_key = ? AND did = ? AND conflict = 0",
                       (records.did_key(did), did)).fetchone()
    if row is None:
        return False
    seq, source, broadcast = row
    if source == "agent" or broadcast:
        return False
    return conn.execute("SELECT 1 FROM recipients WHERE did = ? AND seq = ?", (own_did, seq)).fetchone() is None


def delete_containers(conn: sqlite3.Connection, dids: Sequence[str]) -> int:
    """Remove containers held only for others (a relay after hand-over), with
    everything derived from them."""
    deleted = 0
    for did in dids:
        seqs = records.seqs_of(conn, did)
        for seq in seqs:
            conn.execute("DELETE FROM tags WHERE seq = ?", (seq,))
            conn.execute("DELETE FROM recipients WHERE seq = ?", (seq,))
            conn.execute("DELETE FROM relay_chains WHERE seq = ?", (seq,))
            conn.execute("DELETE FROM search WHERE rowid = ?", (seq,))
            conn.execute("DELETE FROM containers WHERE seq = ?", (seq,))
            deleted += 1
        conn.execute("DELETE FROM links WHERE source = ?", (did,))
    return deleted


# -- bans -------------------------------------------------------------------------------


def save_bans(conn: sqlite3.Connection, rows: Iterable[tuple[str, int]], now_us: int, max_rows: int) -> None:
    """(key, until_us) rows: a DID or an IP address ignored until then. Ended bans are
    dropped and at most `max_rows` kept (those ending first go), as in memory."""
    conn.executemany("INSERT OR REPLACE INTO bans (key, until_us) VALUES (?, ?)", rows)
    conn.execute("DELETE FROM bans WHERE until_us <= ?", (now_us,))
    conn.execute("DELETE FROM bans WHERE key NOT IN (SELECT key FROM bans ORDER BY until_us DESC LIMIT ?)",
                 (max_rows,))


def load_bans(conn: sqlite3.Connection, now_us: int) -> list[tuple[str, int]]:
    """The bans still running at `now_us` (the ended ones are deleted)."""
    conn.execute("DELETE FROM bans WHERE until_us <= ?", (now_us,))
    return conn.execute("SELECT key, until_us FROM bans ORDER BY until_us").fetchall()


def save_relay_chain(conn: sqlite3.Connection, seq: int, chain: list) -> None:
    conn.execute("INSERT OR REPLACE INTO relay_chains (seq, chain) VALUES (?, ?)", (seq, orjson.dumps(chain)))


def relay_chain_of(conn: sqlite3.Connection, seq: int) -> list:
    row = conn.execute("SELECT chain FROM relay_chains WHERE seq = ?", (seq,)).fetchone()
    return orjson.loads(row[0]) if row else []


# -- outbox ------------------------------------------------------------------------------


def outbox_add(conn: sqlite3.Connection, rows: Iterable[tuple[str, str, int, int]]) -> None:
    """(did, recipient, seq, next_us) rows."""
    conn.executemany("INSERT OR IGNORE INTO outbox (did, recipient, seq, next_us) VALUES (?, ?, ?, ?)", rows)


def outbox_due(conn: sqlite3.Connection, now_us: int, limit: int) -> list[tuple[str, str, int, int, int]]:
    """(did, recipient, seq, tries, pushed_us) due at `now_us`, oldest first."""
    return conn.execute(
        "SELECT did, recipient, seq, tries, pushed_us FROM outbox WHERE next_us <= ? ORDER BY next_us LIMIT ?",
        (now_us, limit)).fetchall()


def outbox_wake(conn: sqlite3.Connection, now_us: int, recipients: Iterable[str] | None) -> int:
    """Make what waits for these recipients (None: for anyone) due at `now_us`, whatever
    its retry time: a path to them came back. How many entries were woken."""
    if recipients is None:
        return conn.execute("UPDATE outbox SET next_us = ? WHERE next_us > ?", (now_us, now_us)).rowcount
    woken = 0
    recipients = list(recipients)
    for i in range(0, len(recipients), 900):
        chunk = recipients[i:i + 900]
        woken += conn.execute(f"UPDATE outbox SET next_us = ? WHERE next_us > ? AND recipient IN "
                              f"({','.join('?' * len(chunk))})", (now_us, now_us, *chunk)).rowcount
    return woken


def outbox_done(conn: sqlite3.Connection, pairs: Iterable[tuple[str, str]]) -> None:
    conn.executemany("DELETE FROM outbox WHERE did = ? AND recipient = ?", pairs)


def outbox_retry(conn: sqlite3.Connection, rows: Iterable[tuple[int, str, str]]) -> None:
    """(next_us, did, recipient): one more failed try."""
    conn.executemany("UPDATE outbox SET tries = tries + 1, next_us = ? WHERE did = ? AND recipient = ?", rows)


def outbox_sent(conn: sqlite3.Connection, rows: Iterable[tuple[int, int, str, str]]) -> None:
    """(next_us, pushed_us, did, recipient): handed to a peer at pushed_us; tried again at
    next_us unless acknowledged by then."""
    conn.executemany("UPDATE outbox SET tries = tries + 1, next_us = ?, pushed_us = ? WHERE did = ? AND recipient = ?",
                     rows)


def outbox_wait(conn: sqlite3.Connection, rows: Iterable[tuple[int, str, str]]) -> None:
    """(next_us, did, recipient): handed over already, its acknowledgement awaited until next_us."""
    conn.executemany("UPDATE outbox SET next_us = ? WHERE did = ? AND recipient = ?", rows)


def outbox_count(conn: sqlite3.Connection) -> int:
    return conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]


def outbox_backlog(conn: sqlite3.Connection) -> tuple[int, int | None]:
    """(entries, received_us of the oldest container waiting) of the outbox: how far
    behind delivery is, for /metrics. None when the outbox is empty."""
    count, oldest = conn.execute(
        "SELECT COUNT(*), MIN(c.received_us) FROM outbox o JOIN containers c ON c.seq = o.seq").fetchone()
    return count, oldest


def outbox_list(conn: sqlite3.Connection, limit: int) -> list[tuple[str, str, int, int, int]]:
    """(did, recipient, seq, tries, next_us) of up to `limit` entries, the next due first (the dashboard)."""
    return conn.execute("SELECT did, recipient, seq, tries, next_us FROM outbox ORDER BY next_us LIMIT ?",
                        (limit,)).fetchall()


def relay_list(conn: sqlite3.Connection, limit: int) -> list[tuple[str, str, int, int, str, int]]:
    """(recipient, did, seq, size, sender, until_us) of up to `limit` holdings, the newest first (the dashboard)."""
    return conn.execute("SELECT recipient, did, seq, size, sender, until_us FROM relay_queue "
                        "ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()


# -- DHT provider records ------------------------------------------------------------------
# The agent's containers that have a provider record: at most `keep` rows, the newest
# by seq, each with the time its record is next signed and stored (0: never yet, first).
# The node keeps nothing per container in memory (docs/protocol.md 26.7).


def provide_add(conn: sqlite3.Connection, rows: Sequence[tuple[int, str]], keep: int) -> list[str]:
    """Give the containers `rows` ((seq, did)) a provider record, first publish due now,
    then keep only the `keep` newest by seq; returns the DIDs that lost theirs (their
    records are no longer republished)."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    newest = sorted(rows)[-keep:]  # more than `keep` at once: the older ones would go at once
    conn.executemany("INSERT OR IGNORE INTO dht_provide (seq, did, next_us) VALUES (?, ?, 0)", newest)
    edge = conn.execute("SELECT seq FROM dht_provide ORDER BY seq DESC LIMIT 1 OFFSET ?", (keep,)).fetchone()
    if edge is None:
        return []
    gone = [did for (did,) in conn.execute("SELECT did FROM dht_provide WHERE seq <= ?", (edge[0],))]
    conn.execute("DELETE FROM dht_provide WHERE seq <= ?", (edge[0],))
    return gone


def provide_due(conn: sqlite3.Connection, now_us: int, limit: int) -> tuple[list[tuple[int, str]], list[str]]:
    """(seq, did) of up to `limit` records due at `now_us`, never published first, then
    the longest due; and the DIDs among them whose container is no longer stored
    (their rows are deleted here, and they get no record)."""
    rows = conn.execute(
        "SELECT p.seq, p.did, c.seq IS NOT NULL FROM dht_provide p LEFT JOIN containers c ON c.seq = p.seq"
        " WHERE p.next_us <= ? ORDER BY p.next_us, p.seq DESC LIMIT ?", (now_us, limit)).fetchall()
    gone = [(seq, did) for seq, did, held in rows if not held]
    if gone:
        conn.executemany("DELETE FROM dht_provide WHERE seq = ?", [(seq,) for seq, _ in gone])
    return [(seq, did) for seq, did, held in rows if held], [did for _, did in gone]


def provide_done(conn: sqlite3.Connection, seqs: Iterable[int], next_us: int) -> list[int]:
    """The records of `seqs` were signed and stored: next time at `next_us`. Returns
    those of `seqs` no longer listed (they lost their record meanwhile)."""
    gone = []
    for seq in seqs:
        if conn.execute("UPDATE dht_provide SET next_us = ? WHERE seq = ?", (next_us, seq)).rowcount == 0:
            gone.append(seq)
    return gone


def provide_next_us(conn: sqlite3.Connection) -> int | None:
    """When the next record is due (None: no container has one)."""
    row = conn.execute("SELECT MIN(next_us) FROM dht_provide").fetchone()
    return row[0]


def provide_count(conn: sqlite3.Connection) -> int:
    return conn.execute("SELECT COUNT(*) FROM dht_provide").fetchone()[0]


# -- container_delta `modified` / `removed` (hmpnode.net.delta, docs/protocol.md 32) ----------------


class Facts(NamedTuple):
    """What judging a peer's `removed` needs of a held container (no body read)."""

    sender: str
    ts_us: int
    ttl_us: int | None


def facts_of(conn: sqlite3.Connection, dids: Sequence[str]) -> dict[str, Facts]:
    """did -> sender, timestamp and ttl of the held (non-conflict) row, 900 DIDs per statement."""
    out: dict[str, Facts] = {}
    for i in range(0, len(dids), 900):
        chunk = list(dids[i:i + 900])
        marks = ",".join("?" * len(chunk))
        # by the DID's integer key first (records.did_key: a bare `did IN` would scan the table)
        out.update((did, Facts(sender, ts_us, ttl_us)) for did, sender, ts_us, ttl_us in conn.execute(
            f"SELECT did, sender, ts_us, ttl_us FROM containers WHERE did_key IN ({marks}) AND did IN ({marks})"
            " AND conflict = 0", [*(records.did_key(d) for d in chunk), *chunk]))
    return out


def expiring(conn: sqlite3.Connection, after_us: int, until_us: int, limit: int) -> list[tuple[str, int]]:
    """(did, ttl_us) of the held containers whose ttl falls in (after_us, until_us], by ttl
    (an index range: containers_by_ttl)."""
    return conn.execute(
        "SELECT did, ttl_us FROM containers WHERE ttl_us > ? AND ttl_us <= ? AND conflict = 0"
        " ORDER BY ttl_us LIMIT ?", (after_us, until_us, limit)).fetchall()


def revoked_held(conn: sqlite3.Connection, sender: str, revoked_us: int, limit: int) -> tuple[list[str], str | None]:
    """The held containers of `sender` signed after its revocation instant (the verifier
    would refuse them now: they arrived before the revocation did), and the DID of the
    revoking `peer_announce` (signed at that instant), the proof a peer can fetch."""
    dids = [d for (d,) in conn.execute(
        "SELECT did FROM containers WHERE sender = ? AND ts_us > ? AND conflict = 0 ORDER BY seq LIMIT ?",
        (sender, revoked_us, limit))]
    proof = conn.execute("SELECT did FROM containers WHERE sender = ? AND ts_us = ? AND class = 'peer_announce'"
                         " AND conflict = 0 LIMIT 1", (sender, revoked_us)).fetchone()
    return dids, proof[0] if proof else None


def relay_drop(conn: sqlite3.Connection, dids: Sequence[str], own_did: str) -> int:
    """Stop holding these containers for anyone (revoked: never handed over), and delete
    those held only for others (never the agent's own, a broadcast or one for us).
    Returns how many holdings were dropped."""
    dropped = 0
    for did in dids:
        dropped += conn.execute("DELETE FROM relay_queue WHERE did = ?", (did,)).rowcount
    delete_containers(conn, [d for d in dids if _only_for_others(conn, d, own_did)])
    return dropped
