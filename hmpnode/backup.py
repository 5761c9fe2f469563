"""Backup and restore: `hmpnode backup`, `hmpnode restore`, `hmpnode export`, `hmpnode import`.

`backup` copies a node's data dir into a new directory a node can start from:
the store as one consistent snapshot (SQLite's online backup API, all pages in one
step inside one read transaction, so a node writing meanwhile neither blocks nor
tears it), checked with `PRAGMA quick_check`, and the identity keystore and
settings file beside it. Not copied: api.token, node.json, the lock (a node
starting there makes its own) and store-state.json (the copy starts its own history).

`restore` puts a backup's store in place in a data dir no node runs on, with the
checks a start makes: the backup's identity must be the data dir's, its store sound
and of a schema this hmpnode knows, and not older than the data dir's record (the
store marker store-state.json, and the store in place, which the marker may lag)
unless the operator allows it. The store it replaces is moved aside, not deleted;
the marker is set to the restored store, so that the node starts on it.

`export` writes every container the running node holds, oldest first, as JSON
lines: {"did", "seq", "received", "source", "store_and_forward", "expired",
"container"}, where "container" is the full form (hmp_container with its relay
chain, referenced-by and evaluations blocks). `import` sends the full forms to a
running node's import route in batches: each is verified as ingest verifies what
a peer sends, evaluations and links come back with it; what a node does not
accept is reported line by line."""

from __future__ import annotations

import os
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from hmpnode.fsutil import UnsafePath

STORE_FILE = "hmpnode.sqlite3"
#: beside the store: what a node started on the copy needs to be the same agent
COPIED = ("identity.json", "identity.keystore", "hmpnode.toml")
#: containers per import request, and their bytes (under api.max_batch and api.max_body_bytes defaults)
IMPORT_BATCH = 200
IMPORT_BATCH_BYTES = 4 * 1024 * 1024
#: the export record's fields besides the container (node-local; a restore does not need them)
EXPORT_FIELDS = ("did", "seq", "received", "source", "store_and_forward", "expired")


class BackupError(Exception):
    """A backup that cannot go on: one line for the operator; `usage`: the request is
    what is wrong (a destination that exists or cannot be made, another user's store),
    not the run."""

    def __init__(self, message: str, *, usage: bool = False):
        super().__init__(message)
        self.usage = usage


# -- backup ---------------------------------------------------------------------------------


def backup(data_dir: Path, dest: Path) -> dict[str, Any]:
    """Copy the store of `data_dir` (a node may be running on it) and its identity
    and settings into the new directory `dest`; returns what was copied."""
    source = data_dir / STORE_FILE
    if not source.is_file():
        raise BackupError(f"no store at {source}")
    owner = source.stat().st_uid
    if owner != os.geteuid():
        # SQLite may create the -wal/-shm files beside the store: another user's would
        # lock the node out of its own data dir at its next start (hmpnode.fsutil)
        raise BackupError(f"{source} belongs to uid {owner}: run the backup as that user (e.g. sudo -u)",
                          usage=True)
    try:
        dest.mkdir(mode=0o700)
    except FileExistsError:
        raise BackupError(f"{dest} exists; give a new directory", usage=True) from None
    except OSError as exc:
        raise BackupError(f"cannot create {dest}: {exc.strerror or exc}", usage=True) from None
    target = dest / STORE_FILE
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # 0600 before any byte is in it
        containers, last_seq = _snapshot(source, target)
        copied = [STORE_FILE]
        for name in COPIED:
            data = _read_if_there(data_dir / name)
            if data is not None:
                _write_new(dest / name, data)
                copied.append(name)
        _fsync_dir(dest)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot copy the store {source}: {exc}") from None
    except OSError as exc:
        raise BackupError(f"cannot write {dest}: {exc.strerror or exc}") from None
    return {"dest": str(dest), "files": copied, "containers": containers, "last_seq": last_seq,
            "bytes": target.stat().st_size}


def _snapshot(source: Path, target: Path) -> tuple[int, int]:
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    try:
        dst = sqlite3.connect(target)
        try:
            src.backup(dst)  # pages=-1: every page in one step, one read transaction: consistent
            check = dst.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"the copy fails its check: {check}")
            containers, last_seq = dst.execute(
                "SELECT COUNT(*), COALESCE(MAX(seq), 0) FROM containers WHERE conflict = 0").fetchone()
            dst.commit()
        finally:
            dst.close()
    finally:
        src.close()
    with open(target, "rb") as fh:
        os.fsync(fh.fileno())
    return containers, last_seq


def _read_if_there(path: Path) -> bytes | None:
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
            return fh.read(1024 * 1024)
    except FileNotFoundError:
        return None


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- restore --------------------------------------------------------------------------------

#: the store's files in a data dir (the database and SQLite's companions): moved aside together
STORE_FILES = (STORE_FILE, f"{STORE_FILE}-wal", f"{STORE_FILE}-shm", f"{STORE_FILE}-journal")
SETTINGS_FILE = "hmpnode.toml"


def _keystore_identity(path: Path) -> tuple[str, str] | None:
    """(did, public_key) a keystore names in the clear (sealed or not), None if there is none."""
    try:
        data = _read_if_there(path)
    except OSError as exc:  # a symlink (O_NOFOLLOW), a directory, unreadable
        raise BackupError(f"cannot read the keystore {path}: {exc.strerror or exc}", usage=True) from None
    if data is None:
        return None
    try:
        doc = orjson.loads(data)
        did, key = doc["did"], doc["public_key"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        raise BackupError(f"{path} is not an identity keystore", usage=True) from None
    if not isinstance(did, str) or not isinstance(key, str):
        raise BackupError(f"{path} is not an identity keystore", usage=True)
    return did, key


def _store_facts(path: Path) -> tuple[int, int]:
    """(schema version, highest seq ever assigned) of the store at `path`, read-only;
    BackupError when it is not a sound store of a schema this hmpnode can open."""
    from hmpnode.store.marker import high_seq
    from hmpnode.store.schema import MIGRATIONS, current_version

    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise BackupError(f"the store {path} fails its check: {check}", usage=True)
            version = current_version(conn)
            if version > len(MIGRATIONS):
                raise BackupError(f"the store {path} has schema version {version}, newer than this hmpnode "
                                  f"({len(MIGRATIONS)}); upgrade hmpnode", usage=True)
            return version, high_seq(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise BackupError(f"the store {path} cannot be read: {exc}", usage=True) from None


def restore(source: Path, data_dir: Path, keystore: Path, *, allow_older: bool, now: datetime) -> dict[str, Any]:
    """Put the backup in `source` (made by `backup`) in place as the store of `data_dir`,
    whose identity keystore is `keystore`. The caller holds the data dir's lock (no node
    runs on it). Refused (BackupError, usage) when the backup is another agent's, not a
    sound store, a newer hmpnode's, or older than the data dir's record without
    `allow_older`; then nothing in `data_dir` changed."""
    from hmpnode.store import marker as m

    store = source / STORE_FILE
    if not store.is_file():
        raise BackupError(f"{source} is not a backup: no {STORE_FILE} in it", usage=True)
    names = dict.fromkeys((keystore.name, *(n for n in COPIED if n != SETTINGS_FILE)))
    their_file = next((source / n for n in names if os.path.lexists(source / n)), None)
    theirs = _keystore_identity(their_file) if their_file is not None else None
    ours = _keystore_identity(keystore)
    if theirs is not None and ours is not None and theirs[1] != ours[1]:
        raise BackupError(f"the backup is of agent {theirs[0]}, this data dir's identity ({keystore}) is "
                          f"{ours[0]}; restore it into a new data dir", usage=True)
    version, high = _store_facts(store)

    # the node's record: the marker, and the store in place (the marker may lag it by MARKER_EVERY)
    marker_path = data_dir / m.MARKER_FILE
    try:
        record = m.read_marker(marker_path)
    except m.MarkerError as exc:
        raise BackupError(f"{exc}; delete it to restore without the data dir's record", usage=True) from None
    except UnsafePath as exc:  # as a start refuses it
        raise BackupError(f"refusing to restore: {exc}", usage=True) from None
    held, why = (record.high_seq, f"{m.MARKER_FILE}, updated {record.updated}") if record else (0, "")
    current = data_dir / STORE_FILE
    if m.db_size(current):
        try:
            _, in_place = _store_facts(current)
        except BackupError:
            in_place = 0  # a damaged store is a reason to restore, not a record to keep
        if in_place > held:
            held, why = in_place, f"the store in place, {current}"
    if high < held and not allow_older:
        raise BackupError(f"refusing to restore: the backup holds containers up to seq {high}, older than this "
                          f"data dir's record (seq {held}, {why}); pass --allow-older to go back to it", usage=True)

    stamp = time.strftime("%Y%m%dT%H%M%SZ", now.utctimetuple())
    incoming = data_dir / f"{STORE_FILE}.restoring"
    try:
        incoming.unlink(missing_ok=True)  # a restore interrupted before: we hold the lock
        os.close(os.open(incoming, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        containers, _ = _snapshot(store, incoming)
        aside = None
        present = [name for name in STORE_FILES if os.path.lexists(data_dir / name)]
        if present:
            aside = data_dir / f"before-restore-{stamp}"
            aside.mkdir(mode=0o700)
            for name in present:
                os.rename(data_dir / name, aside / name)
        os.replace(incoming, current)
        copied = [STORE_FILE]
        if ours is None and theirs is not None:
            _write_new(keystore, _read_if_there(their_file))
            copied.append(keystore.name)
        settings = _read_if_there(source / SETTINGS_FILE)
        if settings is not None and not os.path.lexists(data_dir / SETTINGS_FILE):
            _write_new(data_dir / SETTINGS_FILE, settings)
            copied.append(SETTINGS_FILE)
        moment = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        m.write_marker(marker_path, m.StoreMarker(STORE_FILE, record.created if record else moment, high, moment))
        _fsync_dir(data_dir)
    except sqlite3.Error as exc:
        incoming.unlink(missing_ok=True)
        raise BackupError(f"cannot copy the store {store}: {exc}") from None
    except OSError as exc:
        raise BackupError(f"cannot restore into {data_dir}: {exc.strerror or exc}") from None
    return {"data_dir": str(data_dir), "from": str(source), "files": copied, "containers": containers,
            "high_seq": high, "schema_version": version, "previous_high_seq": held,
            "moved_aside": str(aside) if aside else None}


# -- export / import ------------------------------------------------------------------------


async def export_lines(client) -> AsyncIterator[bytes]:
    """Every container the node holds (expired ones too), oldest first, one JSON line each."""
    async for item in client.iterate(expired="any", order="asc"):
        record = {k: item.get(k) for k in EXPORT_FIELDS}
        record["container"] = item["container"]
        yield orjson.dumps(record) + b"\n"


#: what an import counts, in the order it reports them
IMPORT_COUNTS = ("read", "stored", "duplicate", "conflict", "rejected")


@dataclass
class ImportReport:
    #: IMPORT_COUNTS: lines read, then how each ended
    counts: Counter[str] = field(default_factory=Counter)
    #: (line number, did or None, reason, detail) of each line not taken
    problems: list[tuple[int, str | None, str, str]] = field(default_factory=list)

    def refuse(self, number: int, did: str | None, reason: str, detail: str) -> None:
        self.counts["rejected"] += 1
        self.problems.append((number, did, reason, detail))

    def to_json(self) -> dict[str, int]:
        return {k: self.counts[k] for k in IMPORT_COUNTS}


def read_lines(fh: BinaryIO, limit: int) -> Iterator[bytes]:
    """The lines of `fh`, each at most `limit` bytes: a longer one is read through in
    pieces (never held whole) and given as b"\0" (not JSON: reported as a bad line)."""
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := fh.readline(limit)) and not rest.endswith(b"\n"):
                pass
            line = b"\0"
        yield line


def parse_lines(lines: Iterable[bytes], report: ImportReport) -> Iterator[tuple[int, bytes]]:
    """(line number, container JSON) for each line: an export record's "container",
    or a container (full form) as it is. A line that is neither is a problem
    (`bad_line`), reported, and skipped; blank lines are skipped."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        report.counts["read"] += 1
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            report.refuse(number, None, "bad_line", f"not JSON ({exc})")
            continue
        if isinstance(value, dict) and isinstance(value.get("container"), dict):
            yield number, orjson.dumps(value["container"])
        elif isinstance(value, dict) and "hmp_container" in value:
            yield number, line.strip()
        else:
            report.refuse(number, None, "bad_line", "neither an export record nor a container")


def batches(items: Iterable[tuple[int, bytes]], count: int = IMPORT_BATCH,
            size: int = IMPORT_BATCH_BYTES) -> Iterator[list[tuple[int, bytes]]]:
    """Import requests: at most `count` containers and about `size` bytes each (one
    larger container goes alone; the node says whether it takes it)."""
    batch: list[tuple[int, bytes]] = []
    held = 0
    for item in items:
        if batch and (len(batch) >= count or held + len(item[1]) > size):
            yield batch
            batch, held = [], 0
        batch.append(item)
        held += len(item[1])
    if batch:
        yield batch


async def import_lines(client, lines: Iterable[bytes], report: ImportReport) -> ImportReport:
    """Send the containers in `lines` to the node; counts and problems go to `report`."""
    from hmpnode.client import ApiError

    for batch in batches(parse_lines(lines, report)):
        try:
            answer = await client.import_containers([raw for _, raw in batch])
        except ApiError as exc:
            if exc.status != 413:  # a refusal of this request (too large) is about these lines; else stop
                raise
            for number, _ in batch:
                report.refuse(number, None, exc.reason, exc.detail)
            continue
        for (number, _), result in zip(batch, answer["results"], strict=True):
            status = result.get("status")
            if status in ("stored", "duplicate", "conflict"):
                report.counts[status] += 1
            else:
                report.refuse(number, result.get("did"), result.get("reason") or "rejected", result.get("detail") or "")
    return report
