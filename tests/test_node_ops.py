"""Running a node from the CLI, against real node processes: `hmpnode stop`, the log level
changed at run time (`hmpnode log-level`, `/v1/log-level`, SIGHUP) and `hmpnode restore`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hmpnode.client import ApiError, Client
from hmpnode.identity import Identity, save_keystore
from tests.meshutil import MeshNode
from tests.nodeproc import hmp


def lock_holder(data_dir: Path) -> int | None:
    """hmpnode.daemon.lock_holder, imported here: a test fails on its own where it is missing."""
    from hmpnode import daemon

    return daemon.lock_holder(data_dir)


def _wait_for_log(node, text: str, timeout: float = 20.0) -> str:
    """The node's log once it holds `text` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = node.log()
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the node's log within {timeout} s:\n{node.log()}")


def _access_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "hmpnode.access" in line]


# -- stop -----------------------------------------------------------------------------------


async def _shutdown_refused(data: Path, body: dict) -> tuple[int, str]:
    async with Client.from_data_dir(data) as client:
        with pytest.raises(ApiError) as refused:
            await client.request("POST", "/v1/shutdown", body=body)
    return refused.value.status, refused.value.reason


def test_stop_waits_until_the_node_is_gone_and_its_lock_is_free(nodes, tmp_path):
    data = tmp_path / "n"
    node = nodes(data)
    info = node.wait_ready()
    assert lock_holder(data) == node.pid
    assert asyncio.run(_shutdown_refused(data, {"reason": "x", "now": True})) == (400, "unknown_field")
    assert asyncio.run(_shutdown_refused(data, {"reason": ""})) == (400, "bad_request")
    assert node.alive()  # a refused request stops nothing

    out = hmp("stop", "--data-dir", str(data), "--timeout", "60")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"stopped": True, "data_dir": str(data), "pid": info["pid"], "how": "api"}
    # when stop returns, the lock is free and node.json gone: a new node may start at once
    assert lock_holder(data) is None
    assert not (data / "node.json").exists()
    assert node.wait(20) == 0
    assert "shutdown requested (POST /v1/shutdown: hmpnode stop, pid " in node.log()

    again = hmp("stop", "--data-dir", str(data))
    assert again.returncode == 1
    assert again.stderr.decode() == f"hmpnode: no node is running on {data}\n"
    never = hmp("stop", "--data-dir", str(tmp_path / "never"))
    assert (never.returncode, never.stderr.decode()) == (1, f"hmpnode: no node is running on {tmp_path / 'never'}\n")


def _write_lock_pid(data: Path, pid: int) -> None:
    """Overwrite the pid the lock file names (the node's flock stays)."""
    fd = os.open(data / "lock", os.O_WRONLY)
    try:
        os.pwrite(fd, f"{pid}\n".encode().ljust(16), 0)
    finally:
        os.close(fd)


def test_stop_signals_the_lock_holder_when_the_api_does_not_answer_and_only_it(nodes, tmp_path):
    data = tmp_path / "n"
    node = nodes(data)
    node.wait_ready()
    (data / "node.json").unlink()  # the API cannot be found: as while a node starts
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        # a lock file naming another process: that one is not the lock's holder, not signalled
        _write_lock_pid(data, bystander.pid)
        refused = hmp("stop", "--data-dir", str(data), "--timeout", "5")
        assert refused.returncode == 1
        assert "not the lock's holder: not signalled" in refused.stderr.decode()
        assert bystander.poll() is None and node.alive()

        _write_lock_pid(data, node.pid)
        out = hmp("stop", "--data-dir", str(data), "--timeout", "60")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["how"] == "signal"
        assert lock_holder(data) is None
        assert node.wait(20) == 0
        assert "SIGTERM received; shutting down" in node.log()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(10)


def test_stop_says_so_when_the_node_still_runs_at_the_deadline(nodes, tmp_path):
    data = tmp_path / "n"
    node = nodes(data)
    node.wait_ready()
    node.signal(signal.SIGSTOP)  # neither its API nor its signal handlers run
    try:
        out = hmp("stop", "--data-dir", str(data), "--timeout", "1")
        assert out.returncode == 3
        assert out.stderr.decode() == f"hmpnode: the node on {data} (pid {node.pid}) still runs after 1 s\n"
        assert lock_holder(data) == node.pid
    finally:
        node.signal(signal.SIGCONT)
    assert node.wait(30) == 0  # the SIGTERM stop sent when the API did not answer, handled now


# -- log level ------------------------------------------------------------------------------


async def test_sighup_reads_the_log_level_from_the_settings_again(nodes, tmp_path):
    data = tmp_path / "n"
    node = MeshNode(nodes(data))  # no --log-level: info, the default
    try:
        await node.client.status()
        assert (await node.client.log_level())["level"] == "info"
        assert _access_lines(node.proc.log()) == []  # the access log is written at debug only
        config = data / "hmpnode.toml"
        config.write_text('[node]\nlog_level = "debug"\n')
        config.chmod(0o600)
        node.proc.signal(signal.SIGHUP)
        log = _wait_for_log(node.proc, "SIGHUP: log level debug (was info; from ")
        assert "only the log level is reloaded" in log
        assert " DEBUG " not in log.split("SIGHUP: log level debug")[0]
        assert _access_lines(log) == []
        assert (await node.client.log_level())["level"] == "debug"
        _wait_for_log(node.proc, "GET /v1/log-level")  # a debug-only line, after the SIGHUP only

        config.write_text('[node]\nlog_level = "loud"\n')  # invalid: the level in force stays
        node.proc.signal(signal.SIGHUP)
        _wait_for_log(node.proc, "SIGHUP: the log level stays debug: invalid configuration: ")
        assert (await node.client.log_level())["level"] == "debug"
        assert node.proc.alive()
    finally:
        await node.close()


async def test_the_log_level_set_over_the_api_and_the_cli(nodes, tmp_path):
    data = tmp_path / "n"
    node = MeshNode(nodes(data))
    try:
        shown = hmp("log-level", "--data-dir", str(data))
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout) == {"level": "info", "levels": ["debug", "info", "warning", "error"]}
        assert _access_lines(node.proc.log()) == []

        made = hmp("log-level", "--data-dir", str(data), "debug")
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["level"] == "debug" and json.loads(made.stdout)["previous"] == "info"
        await node.client.status()
        _wait_for_log(node.proc, "GET /v1/status")  # the access log, now that it logs at debug

        bad = hmp("log-level", "--data-dir", str(data), "loud")
        assert bad.returncode == 2 and len(bad.stderr.decode().splitlines()) == 1
        for body, reason in (({"level": "loud"}, "bad_log_level"), ({"level": 3}, "bad_log_level"),
                             ({}, "bad_request"), ({"level": "info", "persist": True}, "unknown_field")):
            with pytest.raises(ApiError) as refused:
                await node.client.request("PUT", "/v1/log-level", body=body)
            assert (refused.value.status, refused.value.reason) == (400, reason), body
        assert (await node.client.log_level())["level"] == "debug"

        assert (await node.client.set_log_level("warning"))["previous"] == "debug"
        node.proc.signal(signal.SIGHUP)  # back to what the settings say: the default
        _wait_for_log(node.proc, "SIGHUP: log level info (was warning; from default)")
        assert (await node.client.log_level())["level"] == "info"
    finally:
        await node.close()


# -- restore --------------------------------------------------------------------------------


def _seqs(data: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(f"file:{data / 'hmpnode.sqlite3'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT COUNT(*) FROM containers").fetchone()[0]
    finally:
        conn.close()


async def test_restore_checks_as_a_start_does_and_refuses_an_older_store_unless_allowed(nodes, tmp_path):
    data, saved = tmp_path / "n", tmp_path / "backup"
    node = MeshNode(nodes(data))
    try:
        for i in range(2):
            await node.client.create("note", {"text": f"kept {i}"})
        made = hmp("backup", "--data-dir", str(data), str(saved))
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["last_seq"] == 2

        running = hmp("restore", str(saved), "--data-dir", str(data), "--allow-older")
        assert running.returncode == 1
        assert running.stderr.decode().startswith(f"hmpnode: restore: another node is running on data dir {data}")
        assert len(running.stderr.decode().splitlines()) == 1

        for i in range(3):
            await node.client.create("note", {"text": f"later {i}"})
    finally:
        await node.close()
    assert hmp("stop", "--data-dir", str(data)).returncode == 0
    record = (data / "store-state.json").read_bytes()

    older = hmp("restore", str(saved), "--data-dir", str(data))
    assert older.returncode == 2
    assert older.stderr.decode() == (
        "hmpnode: refusing to restore: the backup holds containers up to seq 2, older than this data dir's record "
        f"(seq 5, store-state.json, updated {json.loads((data / 'store-state.json').read_bytes())['updated']}); "
        "pass --allow-older to go back to it\n")

    stranger = tmp_path / "stranger"  # the same store under another agent's keystore
    stranger.mkdir(mode=0o700)
    (stranger / "hmpnode.sqlite3").write_bytes((saved / "hmpnode.sqlite3").read_bytes())
    other = Identity.generate()
    save_keystore(stranger / "identity.json", other)
    theirs = hmp("restore", str(stranger), "--data-dir", str(data), "--allow-older")
    assert theirs.returncode == 2
    assert f"the backup is of agent {other.did}" in theirs.stderr.decode()

    broken = tmp_path / "broken"
    broken.mkdir(mode=0o700)
    (broken / "hmpnode.sqlite3").write_bytes(b"not a database" * 100)
    assert hmp("restore", str(broken), "--data-dir", str(data), "--allow-older").returncode == 2
    # a record others may write, a keystore that is a symlink: refused as a start refuses them (hmp: no traceback)
    (data / "store-state.json").chmod(0o666)
    unsafe = hmp("restore", str(saved), "--data-dir", str(data), "--allow-older")
    (data / "store-state.json").chmod(0o600)
    assert unsafe.returncode == 2 and unsafe.stderr.decode().startswith("hmpnode: refusing to restore: "), unsafe.stderr
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    (linked / "hmpnode.sqlite3").write_bytes((saved / "hmpnode.sqlite3").read_bytes())
    (linked / "identity.json").symlink_to(saved / "identity.json")
    symlinked = hmp("restore", str(linked), "--data-dir", str(data), "--allow-older")
    assert symlinked.returncode == 2 and "cannot read the keystore" in symlinked.stderr.decode(), symlinked.stderr
    # nothing changed by a refusal
    assert not list(data.glob("before-restore-*")) and (data / "store-state.json").read_bytes() == record
    assert _seqs(data) == 5

    done = hmp("restore", str(saved), "--data-dir", str(data), "--allow-older")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["high_seq"], report["previous_high_seq"], report["containers"]) == (2, 5, 2)
    assert _seqs(Path(report["moved_aside"])) == 5  # the store replaced is kept aside
    assert json.loads((data / "store-state.json").read_bytes())["high_seq"] == 2

    again = MeshNode(nodes(data))  # starts without --accept-store-loss: the record agrees with the store
    try:
        texts = sorted([item["container"]["hmp_container"]["payload"]["text"]
                        async for item in again.client.iterate(class_="note")])
        assert texts == ["kept 0", "kept 1"]
    finally:
        await again.close()

    fresh = tmp_path / "fresh"  # a new machine: the identity comes with the backup
    moved = hmp("restore", str(saved), "--data-dir", str(fresh))
    assert moved.returncode == 0, moved.stderr
    assert "identity.json" in json.loads(moved.stdout)["files"]
    assert json.loads((fresh / "identity.json").read_bytes())["did"] == again.did
