"""The store's own record of itself, kept outside the database: `<data-dir>/store-state.json`.

SQLite opens a missing or 0-byte file as a new, empty database, so without a
record elsewhere a store that was deleted, truncated or swapped for an older
copy would start silently fresh (issue 10: 1 000 containers gone, `last_seq`
back to 0, no warning). The marker says "this data dir had a store, and it had
assigned sequence numbers up to `high_seq`":

    {"format": "hmpnode-store-state", "version": 1, "file": "hmpnode.sqlite3",
     "created": "<RFC 3339>", "high_seq": <int>, "updated": "<RFC 3339>"}

It is written atomically (0600 temp file, fsync, rename, directory fsync) when
the node starts, every MARKER_EVERY seconds while the sequence moved, and at a
clean stop - never per ingest, so it costs nothing on the write path. It can
lag behind the store (a kill -9 between updates), never run ahead of it, so a
store behind the marker has lost data.

`store_problem` (pure) decides; the daemon refuses to start on a problem
unless the operator passed `--accept-store-loss` (or deleted the marker).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import orjson

from hmpnode.fsutil import read_secret, write_private_file

__all__ = ["MARKER_FILE", "MARKER_EVERY", "MarkerError", "StoreMarker", "read_marker", "write_marker",
           "store_problem", "high_seq", "db_size"]

MARKER_FILE = "store-state.json"
#: seconds between marker updates while containers are being stored (and at a clean stop)
MARKER_EVERY = 60.0
_FORMAT = "hmpnode-store-state"
_VERSION = 1
_MAX_BYTES = 4096


class MarkerError(ValueError):
    """The marker file exists but cannot be read or understood."""


@dataclass(frozen=True, slots=True)
class StoreMarker:
    file: str
    created: str
    high_seq: int
    updated: str

    def to_bytes(self) -> bytes:
        return orjson.dumps({"format": _FORMAT, "version": _VERSION, "file": self.file, "created": self.created,
                             "high_seq": self.high_seq, "updated": self.updated}, option=orjson.OPT_INDENT_2) + b"\n"


def read_marker(path: Path) -> StoreMarker | None:
    """The marker at `path`, None if there is none. UnsafePath (hmpnode.fsutil) if
    another user could have written it, MarkerError if it is not a marker."""
    try:
        raw = read_secret(path, "store marker", _MAX_BYTES)
    except FileNotFoundError:
        return None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise MarkerError(f"{path} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
        raise MarkerError(f"{path} is not an hmpnode store marker (version {_VERSION})")
    seq = doc.get("high_seq")
    if type(seq) is not int or seq < 0 or not all(isinstance(doc.get(k), str) for k in ("file", "created", "updated")):
        raise MarkerError(f"{path} has missing or mistyped fields")
    return StoreMarker(doc["file"], doc["created"], seq, doc["updated"])


def write_marker(path: Path, marker: StoreMarker) -> None:
    write_private_file(path, marker.to_bytes(), replace=True)


def store_problem(marker: StoreMarker | None, db_path: Path, db_size: int | None,
                  db_high_seq: int | None = None) -> str | None:
    """Why the store at `db_path` cannot be what this data dir held, or None.

    `db_size`: bytes of the database file, None if it does not exist (checked
    before the database is opened, which would create it). `db_high_seq`: the
    highest sequence number the opened store ever assigned (after opening).
    No marker: nothing to compare with (first start, or a data dir from before
    markers), never a problem."""
    if marker is None:
        return None
    held = f"held containers up to seq {marker.high_seq}" if marker.high_seq else "was initialised"
    since = f"store marker {MARKER_FILE} says it {held} (created {marker.created}, updated {marker.updated})"
    if db_size is None:
        return f"the store {db_path} is missing, but the {since}"
    if db_size == 0:
        return f"the store {db_path} is empty (0 bytes), but the {since}"
    if db_high_seq is not None and db_high_seq < marker.high_seq:
        return (f"the store {db_path} went back to seq {db_high_seq} (an older copy, or its -wal file lost), "
                f"but the {since}")
    return None


def high_seq(conn: sqlite3.Connection) -> int:
    """The highest container seq the store ever assigned (AUTOINCREMENT's counter:
    deleting the newest containers does not lower it)."""
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'containers'").fetchone()
    counted = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM containers").fetchone()[0]
    return max(int(row[0]) if row else 0, int(counted))


def db_size(path: Path) -> int | None:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return None
