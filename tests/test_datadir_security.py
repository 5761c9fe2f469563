"""Issue 10, "local takeover": what another local user can plant in or around the data
dir, a store that lost its data, and a full disk - against real `hmpnode run` processes.

Several cases need root (chown to another user, mount a small tmpfs). CI runs as
root; elsewhere they skip, unless HMPNODE_REQUIRE_ROOT or HMPNODE_REQUIRE_NETNS is set,
which turns the skip into a failure."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import threading
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nacl.utils
import pytest

from hmpnode.container.build import build_container
from hmpnode.container.verify import encode_wire
from hmpnode.identity import Identity, save_keystore
from tests.nodeproc import hmp

DB = "hmpnode.sqlite3"
MARKER = "store-state.json"


def _root_only() -> None:
    if os.geteuid() != 0:
        if os.environ.get("HMPNODE_REQUIRE_ROOT") or os.environ.get("HMPNODE_REQUIRE_NETNS"):
            pytest.fail("this test needs root (HMPNODE_REQUIRE_ROOT/HMPNODE_REQUIRE_NETNS is set)")
        pytest.skip("needs root (chown to another user / mount)")


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _refused(nodes, data: Path, *args: str) -> str:
    """Start a node on `data`; it must exit 2 at once with one `hmpnode:` line and no
    traceback. Returns that line."""
    node = nodes(data, *args)
    code = node.wait(timeout=20)
    log = node.log()
    assert code == 2, log
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if line.startswith("hmpnode:")]
    assert len(lines) == 1, log
    assert not (data / "node.json").exists()
    return lines[0]


def _first_start(nodes, data: Path) -> dict:
    node = nodes(data)
    info = node.wait_ready()
    assert node.stop() == 0
    return info


def _call(url: str, token: str, method: str = "GET", body: bytes | None = None, timeout: float = 20):
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _containers(n: int, start: int = 0, pad: int = 0) -> list[tuple[str, bytes]]:
    sender = Identity(bytes([9]) * 32)
    now = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=30)
    out = []
    for i in range(start, start + n):
        container = build_container(sender, "note", {"text": f"item {i}", "pad": "x" * pad}, now=now,
                                    rng=nacl.utils.random, tags=["datadir"])
        out.append((container["hmp_container"]["head"]["container_did"], encode_wire(container)))
    return out


def _import(url: str, token: str, batch: list[tuple[str, bytes]]):
    body = b'{"containers":[' + b",".join(wire for _, wire in batch) + b"]}"
    return _call(url + "/v1/containers/import", token, "POST", body)


def _store(url: str, token: str, items: list[tuple[str, bytes]], per: int = 100) -> None:
    for i in range(0, len(items), per):
        status, answer = _import(url, token, items[i:i + per])
        assert status == 200, answer
        assert all(r["status"] == "stored" for r in answer["results"]), answer


def _status(url: str, token: str) -> dict:
    status, body = _call(url + "/v1/status", token)
    assert status == 200, body
    return body


# -- files another user could have planted ------------------------------------------------


def test_world_writable_data_dir_is_refused(nodes, tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    os.chmod(data, 0o777)
    line = _refused(nodes, data)
    assert str(data) in line and "writable by group and others" in line and "777" in line, line
    assert not (data / "api.token").exists() and not (data / "identity.json").exists()
    # the same directory, fixed, is fine
    os.chmod(data, 0o700)
    _first_start(nodes, data)


def test_symlinked_data_dir_and_writable_parent_are_refused(nodes, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    line = _refused(nodes, link)
    assert str(link) in line and "symlink" in line, line

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may rename the data dir away and put theirs there
    line = _refused(nodes, shared / "d")
    assert str(shared) in line and "parent of the data dir" in line, line


def test_identity_owned_by_another_user_is_refused(nodes, tmp_path):
    _root_only()
    data = tmp_path / "d"
    _first_start(nodes, data)
    os.chown(data / "identity.json", _nobody(), -1)
    line = _refused(nodes, data)
    assert str(data / "identity.json") in line and f"owned by uid {_nobody()}" in line, line


def test_group_writable_token_is_refused(nodes, tmp_path):
    data = tmp_path / "d"
    _first_start(nodes, data)
    os.chmod(data / "api.token", 0o620)
    line = _refused(nodes, data)
    assert str(data / "api.token") in line and "writable by group" in line, line
    assert _mode(data / "api.token") == 0o620  # refused, not "fixed"


def test_symlinked_identity_is_refused_and_its_target_untouched(nodes, tmp_path):
    """Today the node chmods the target of identity.json: as root, any file."""
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    victim = tmp_path / "victim.json"  # a valid keystore, so that nothing else stops the node
    save_keystore(victim, Identity.generate())
    os.chmod(victim, 0o644)
    (data / "identity.json").symlink_to(victim)
    line = _refused(nodes, data)
    assert str(data / "identity.json") in line and "symlink" in line, line
    assert _mode(victim) == 0o644


def test_symlinked_lock_file_does_not_truncate_its_target(nodes, tmp_path):
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    victim = tmp_path / "precious"
    victim.write_bytes(b"keep me\n")
    (data / "lock").symlink_to(victim)
    line = _refused(nodes, data)
    assert "lock" in line and "symlink" in line, line
    assert victim.read_bytes() == b"keep me\n"


def test_planted_token_and_identity_are_refused(nodes, tmp_path):
    """Another user wrote api.token and identity.json (so knows the token and the node's
    private key) while the directory let them; the owner fixed the directory's mode
    afterwards. Today both are used; now neither is."""
    _root_only()
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    attacker = Identity.generate()
    save_keystore(data / "identity.json", attacker)
    (data / "api.token").write_text("planted-token-known-to-the-attacker\n")
    os.chmod(data / "api.token", 0o600)
    for name in ("identity.json", "api.token"):
        os.chown(data / name, _nobody(), -1)
    line = _refused(nodes, data)
    assert "identity.json" in line and f"owned by uid {_nobody()}" in line, line
    (data / "identity.json").unlink()  # the identity is fixed; the token is still planted
    line = _refused(nodes, data)
    assert str(data / "api.token") in line and f"owned by uid {_nobody()}" in line, line


class _Listener:
    """A TCP listener on 127.0.0.1 that counts connections and keeps what they send."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(1)
            try:
                self.received += conn.recv(65536)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def test_client_does_not_follow_a_planted_node_file(nodes, tmp_path):
    """A node.json planted by another user points the client at that user's server:
    the client would send the real token there. Now it refuses to use such a file,
    and a symlinked api.token."""
    _root_only()
    data = tmp_path / "d"
    info = _first_start(nodes, data)
    token = (data / "api.token").read_text().strip()
    trap = _Listener()
    try:
        planted = {**info, "pid": os.getpid(), "api": {"host": "127.0.0.1", "port": trap.port,
                                                        "url": f"http://127.0.0.1:{trap.port}"}}
        (data / "node.json").write_text(json.dumps(planted))
        os.chmod(data / "node.json", 0o600)
        os.chown(data / "node.json", _nobody(), -1)
        proc = hmp("status", "--data-dir", str(data), timeout=30)
        assert proc.returncode == 2, proc.stderr  # an unsafe file, as `run` refuses it
        assert b"refusing to use data dir" in proc.stderr and b"node.json" in proc.stderr, proc.stderr
        assert trap.connections == 0 and token.encode() not in trap.received
    finally:
        trap.close()

    # a node running, its token swapped for a symlink to a file of the attacker's choice
    node = nodes(data)
    node.wait_ready()
    other = tmp_path / "other-token"
    other.write_text("attacker-token-000000000000000\n")
    (data / "api.token").unlink()
    (data / "api.token").symlink_to(other)
    proc = hmp("status", "--data-dir", str(data), timeout=30)
    assert proc.returncode == 2 and b"api.token" in proc.stderr and b"symlink" in proc.stderr, proc.stderr
    assert node.stop() == 0


# -- a store that lost its data ------------------------------------------------------------


def test_store_truncated_to_zero_is_refused_and_the_way_out_works(nodes, tmp_path):
    data = tmp_path / "d"
    node = nodes(data)
    info = node.wait_ready()
    url, token = info["api"]["url"], (data / "api.token").read_text().strip()
    _store(url, token, _containers(1000))
    assert _status(url, token)["last_seq"] == 1000
    assert node.stop() == 0

    with open(data / DB, "r+b") as fh:  # truncated to 0 bytes
        fh.truncate(0)
    for suffix in ("-wal", "-shm"):
        (data / (DB + suffix)).unlink(missing_ok=True)
    line = _refused(nodes, data)
    assert str(data / DB) in line and "empty (0 bytes)" in line and "seq 1000" in line, line
    assert "--accept-store-loss" in line, line
    assert (data / DB).stat().st_size == 0  # the refusal did not touch it

    # the operator's way out: accept the loss once; then it is the store of record
    node = nodes(data, "--accept-store-loss")
    info = node.wait_ready()
    url = info["api"]["url"]
    assert _status(url, token)["last_seq"] == 0
    assert "accepted with --accept-store-loss" in node.log()
    _store(url, token, _containers(5, start=5000))
    assert node.stop() == 0
    node = nodes(data)
    info = node.wait_ready()
    assert _status(info["api"]["url"], token)["last_seq"] == 5
    assert node.stop() == 0


def test_deleted_store_is_refused_even_after_a_kill(nodes, tmp_path):
    """The marker is written when the store is first created: a node killed with
    SIGKILL (no clean stop, no later marker update) still knows it had a store."""
    data = tmp_path / "d"
    node = nodes(data)
    info = node.wait_ready()
    _store(info["api"]["url"], (data / "api.token").read_text().strip(), _containers(50))
    node.kill()
    node.wait()
    for suffix in ("", "-wal", "-shm"):
        (data / (DB + suffix)).unlink(missing_ok=True)
    line = _refused(nodes, data)
    assert str(data / DB) in line and "missing" in line and MARKER in line, line
    assert not (data / DB).exists()
    # deleting the marker is the other way out, named in the line
    assert str(data / MARKER) in line
    (data / MARKER).unlink()
    _first_start(nodes, data)


def test_store_rolled_back_to_an_older_copy_is_refused(nodes, tmp_path):
    data = tmp_path / "d"
    node = nodes(data)
    info = node.wait_ready()
    url, token = info["api"]["url"], (data / "api.token").read_text().strip()
    _store(url, token, _containers(10))
    assert node.stop() == 0
    backup = tmp_path / "backup.sqlite3"
    shutil.copy2(data / DB, backup)
    node = nodes(data)
    info = node.wait_ready()
    _store(info["api"]["url"], token, _containers(200, start=100))
    assert node.stop() == 0
    shutil.copy2(backup, data / DB)
    line = _refused(nodes, data)
    assert "went back to seq 10" in line and "seq 210" in line, line


# -- disk full -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs, unmounted at the end (after the test's nodes are gone)."""
    _root_only()
    mount = tmp_path / "disk"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, timeout=20)
    if done.returncode != 0:
        if os.environ.get("HMPNODE_REQUIRE_ROOT") or os.environ.get("HMPNODE_REQUIRE_NETNS"):
            pytest.fail(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace')}")
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace')}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=20)


def test_disk_full_is_said_and_the_node_recovers(nodes, small_disk):
    data = small_disk / "d"
    node = nodes(data)
    info = node.wait_ready()
    url, token = info["api"]["url"], (data / "api.token").read_text().strip()
    filler = small_disk / "filler"
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * max(0, free - 400 * 1024))  # leave ~400 KiB

    acked: list[str] = []
    full = None
    items = _containers(400, pad=3000)  # ~4 KB each
    for i in range(0, len(items), 20):
        batch = items[i:i + 20]
        status, answer = _import(url, token, batch)
        if status != 200:
            full = (status, answer)
            break
        acked += [did for did, _ in batch]
    assert full is not None, "the disk never filled up"
    status, answer = full
    assert status == 507 and answer["reason"] == "storage_full", full
    assert _status(url, token)["refused"].get("api:storage_full") == 1
    log = node.log()
    assert "disk full" in log and "no such savepoint" not in log, log
    assert node.alive()
    status, _ = _call(url + "/v1/health", token)
    assert status == 200

    # free the space: writes work again, nothing acknowledged was lost
    filler.unlink()
    status, answer = _import(url, token, items[-20:])
    assert status == 200 and all(r["status"] == "stored" for r in answer["results"]), answer
    acked += [did for did, _ in items[-20:]]
    assert "writes to the store" in node.log() and "work again" in node.log()
    assert node.stop() == 0

    node = nodes(data)
    info = node.wait_ready()
    for did in acked:
        status, body = _call(f"{info['api']['url']}/v1/containers/{did}", token)
        assert status == 200, (did, body)
    assert node.stop() == 0


# -- the pieces, without processes ------------------------------------------------------


def test_store_problem_decisions(tmp_path):
    from hmpnode.store.marker import StoreMarker, store_problem

    db = tmp_path / DB
    marker = StoreMarker(DB, "2026-12-01T10:00:00Z", 1000, "2026-12-01T11:00:00Z")
    assert store_problem(None, db, None) is None  # first start
    assert store_problem(None, db, 0) is None  # no marker: nothing to compare with
    assert "missing" in store_problem(marker, db, None)
    assert "empty (0 bytes)" in store_problem(marker, db, 0)
    assert store_problem(marker, db, 4096) is None  # before open: not judged on seq yet
    assert "went back to seq 999" in store_problem(marker, db, 4096, 999)
    assert store_problem(marker, db, 4096, 1000) is None
    assert store_problem(marker, db, 4096, 1500) is None  # ahead: the marker lags, by design
    fresh = StoreMarker(DB, "2026-12-01T10:00:00Z", 0, "2026-12-01T10:00:00Z")
    assert "was initialised" in store_problem(fresh, db, 0)


def test_read_secret_refuses_links_fifos_and_writable_files(tmp_path):
    from hmpnode.fsutil import UnsafePath, read_secret

    good = tmp_path / "good"
    good.write_bytes(b"secret")
    os.chmod(good, 0o640)
    assert read_secret(good, "secret", 100) == b"secret"
    assert _mode(good) == 0o600  # read access taken away, on the opened file
    link = tmp_path / "link"
    link.symlink_to(good)
    os.chmod(good, 0o644)
    with pytest.raises(UnsafePath, match="symlink"):
        read_secret(link, "secret", 100)
    assert _mode(good) == 0o644  # a link's target is never chmodded
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(UnsafePath, match="not a regular file"):
        read_secret(fifo, "secret", 100)  # and it does not block
    os.chmod(good, 0o602)
    with pytest.raises(UnsafePath, match="writable by others"):
        read_secret(good, "secret", 100)
    os.chmod(good, 0o600)
    with pytest.raises(UnsafePath, match="larger than 3 bytes"):
        read_secret(good, "secret", 3)
    with pytest.raises(FileNotFoundError):
        read_secret(tmp_path / "none", "secret", 100)


async def test_database_full_fails_the_batch_cleanly_and_recovers(tmp_path, caplog):
    """PRAGMA max_page_count gives SQLITE_FULL like a full disk: the writes fail with
    StorageFull, the log says "disk full", the writer thread keeps going, and once
    the limit is raised the same writes succeed."""
    import asyncio

    from hmpnode.store.db import Database, StorageFull

    database = Database(tmp_path / "t.sqlite3", batch_wait_ms=20)
    database.open()
    try:
        await database.write(lambda c: c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB)"))
        pages, page_size = await database.write(
            lambda c: (c.execute("PRAGMA page_count").fetchone()[0], c.execute("PRAGMA page_size").fetchone()[0]))
        # room for ~32 KiB more whatever the page size (16 KiB by default): one of the six 20 KB rows
        await database.write(lambda c: c.execute(f"PRAGMA max_page_count = {pages + max(2, 32768 // page_size)}"))

        def insert(conn, size=20000):
            conn.execute("INSERT INTO t (b) VALUES (randomblob(?))", (size,))

        outcomes = await asyncio.gather(*(database.write(insert) for _ in range(6)), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert failed and all(isinstance(o, StorageFull) for o in failed), outcomes
        assert "disk full" in caplog.text and "no such savepoint" not in caplog.text
        assert database.full and database.full_refused >= len(failed)
        stored = await database.read(lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0])
        assert stored == len(outcomes) - len(failed)  # exactly the acknowledged ones

        await database.write(lambda c: c.execute("PRAGMA max_page_count = 1000000"))
        await database.write(insert)
        assert not database.full
        assert await database.read(lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0]) == stored + 1
    finally:
        await database.close()


async def test_disk_full_on_the_peer_path_rejects_without_blaming_the_peer(nodes, small_disk):
    """A peer's containers that meet a full disk: `container_ack` rejects them with
    `storage_full` (not acknowledged, so the peer offers them again), the peer is
    neither struck nor cut off, and after space is freed the same frame is stored."""
    import aiohttp
    import orjson

    from tests.peerclient import authenticate
    from tests.test_mesh_hostile import _ack

    data = small_disk / "d"
    node = nodes(data)
    info = node.wait_ready()
    url, token = info["api"]["url"], (data / "api.token").read_text().strip()
    peer = Identity.generate()
    now = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=30)
    items = [build_container(peer, "note", {"text": f"peer item {i}", "pad": "y" * 3000}, now=now,
                             rng=nacl.utils.random, broadcast=True) for i in range(120)]
    frame = orjson.dumps({"type": "containers", "items": items}).decode()

    async def send_and_ack(ws) -> dict:
        await ws.send_str(frame)
        return await _ack(ws, 20)

    filler = small_disk / "filler"
    async with aiohttp.ClientSession() as http:
        ws = await authenticate(http, info["peer"]["port"], peer)
        assert not isinstance(ws, (int, str)), ws
        try:
            filler.write_bytes(b"\0" * max(0, shutil.disk_usage(small_disk).free - 64 * 1024))
            ack = await send_and_ack(ws)
            reasons = {r["reason"] for r in ack.get("rejected", [])}
            assert reasons == {"storage_full"} and not ack.get("acknowledged"), ack
            status = _status(url, token)
            assert status["refused"].get("store:storage_full") == len(items), status["refused"]
            filler.unlink()
            ack = await send_and_ack(ws)  # the same session: not cut off
            assert len(ack["acknowledged"]) == len(items) and not ack.get("rejected"), ack
        finally:
            await ws.close()
    assert "Traceback" not in node.log() and "disk full" in node.log()
    assert node.stop() == 0
