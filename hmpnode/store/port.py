"""The mesh core's store port on SQLite (`hmpnode.net.core.StorePort`).

One object per read or write: it wraps the connection of that transaction and maps
each port method onto the store's queries (`hmpnode.store.mesh`, `records`, `forget`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence

from hmpnode.net.relayquota import RelayUsage
from hmpnode.store import mesh as ms
from hmpnode.store import records as db
from hmpnode.store.forget import forgotten_of

__all__ = ["SqlitePort"]


class SqlitePort:
    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def settled(self, dids: Sequence[str]) -> set[str]:
        return {d for d in dids if db.is_held(self.conn, d)} | forgotten_of(self.conn, dids)

    def rows_by_did(self, dids: Sequence[str]) -> list[db.StoredContainer]:
        return [r for r in (db.get_by_did(self.conn, d) for d in dids) if r is not None]

    def rows_by_seq(self, seqs: Sequence[int]) -> list[db.StoredContainer]:
        return db.get_by_seq(self.conn, seqs)

    def containers_after(self, after: int, limit: int) -> list[db.StoredContainer]:
        return ms.containers_after(self.conn, after, limit)

    def sync_rows(self, after_ttl_us: int, after_seq: int) -> tuple[int, list]:
        return ms.sync_rows(self.conn, after_ttl_us, after_seq)

    def evaluations_of(self, dids: Sequence[str]) -> dict[str, list]:
        return {d: items for d in dids if (items := db.evaluations_of(self.conn, d))}

    def backlinks_of(self, dids: Sequence[str]) -> dict[str, list]:
        return {d: db.backlinks_of(self.conn, d) for d in dids}

    def relay_usage(self, recipients: Iterable[str], sender: str, address: str | None) -> RelayUsage:
        return ms.relay_usage_of(self.conn, recipients, sender, address)

    def relay_hold(self, entries: list[tuple]) -> None:
        ms.relay_hold(self.conn, entries)

    def relay_held_for(self, recipient: str, after: int, limit: int) -> list[db.StoredContainer]:
        return ms.relay_held_for(self.conn, recipient, after, limit)

    def relay_release(self, recipient: str, dids: Sequence[str], own: str) -> int:
        return ms.relay_release(self.conn, recipient, dids, own)

    def relay_expire(self, now_us: int, soon_us: int, own: str) -> tuple[dict[str, int], dict[str, int], int]:
        expired, ending = ms.relay_ending(self.conn, now_us), ms.relay_ending(self.conn, soon_us)
        return expired, ending, ms.relay_expired(self.conn, now_us, own)

    def relay_chains(self, seqs: Sequence[int]) -> dict[int, list]:
        return {seq: ms.relay_chain_of(self.conn, seq) for seq in seqs}

    def save_relay_chains(self, chains: list[tuple[int, list]]) -> None:
        for seq, chain in chains:
            ms.save_relay_chain(self.conn, seq, chain)

    def outbox_add(self, rows: list[tuple[str, str, int, int]]) -> None:
        ms.outbox_add(self.conn, rows)

    def outbox_due(self, now_us: int, limit: int) -> list[tuple[str, str, int, int, int]]:
        return ms.outbox_due(self.conn, now_us, limit)

    def outbox_wake(self, now_us: int, recipients: Iterable[str] | None) -> int:
        return ms.outbox_wake(self.conn, now_us, recipients)

    def outbox_done(self, pairs: Iterable[tuple[str, str]]) -> None:
        ms.outbox_done(self.conn, pairs)

    def outbox_retry(self, rows: Iterable[tuple[int, str, str]]) -> None:
        ms.outbox_retry(self.conn, rows)

    def outbox_sent(self, sent: Iterable[tuple[int, int, str, str]], waiting: Iterable[tuple[int, str, str]]) -> None:
        ms.outbox_sent(self.conn, sent)
        ms.outbox_wait(self.conn, waiting)
