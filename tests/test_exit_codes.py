"""Every case of README.md's exit-code table, run as a real `hmpnode` process: the
code, and stderr at most one `hmpnode:` line (`run` may log before it), never a
traceback. One node serves the commands that talk to one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from tests.nodeproc import Nodes, node_env

#: a DID no agent evaluated and no peer has: `trust` knows nothing of it, `peer-index` finds no peer
NOBODY = "did:hmp:agent:nobody"
EVENT_TIMEOUT = 60.0


def _run(*args: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hmpnode", *args], input=stdin, capture_output=True,
                          env=node_env(), timeout=timeout, stdin=None if stdin is not None else subprocess.DEVNULL)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """The placeholders of CASES: a running node's data dir and what it holds, and
    directories made for the refusals."""
    base = tmp_path_factory.mktemp("exit")
    factory = Nodes()
    try:
        data = base / "node"
        info = factory(data, env=node_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false")).wait_ready()
        made = _run("remember", "a memory to evaluate and vote on", "--data-dir", str(data))
        assert made.returncode == 0, made.stderr
        for name in ("notadb", "newer", "lockdir", "lockro", "unsafe", "existing"):
            (base / name).mkdir(mode=0o700)
        (base / "notadb" / "hmpnode.sqlite3").write_bytes(b"this is not a database\n" * 512)
        with contextlib.closing(sqlite3.connect(base / "newer" / "hmpnode.sqlite3")) as conn:
            conn.execute("PRAGMA user_version = 9999")  # a schema of a later hmpnode
        (base / "lockdir" / "lock").mkdir()  # a lock the node cannot open, for root too
        (base / "lockro" / "lock").write_bytes(b"")
        os.chmod(base / "lockro" / "lock", 0o400)
        os.chmod(base / "unsafe", 0o777)
        yield {"data": str(data), "did": json.loads(made.stdout)["did"], "base": str(base),
               "api_port": str(info["api"]["port"])}
    finally:
        factory.cleanup()


#: (id, argv with {placeholders} of ctx, stdin, exit code, what its stderr line says (None: no line))
CASES = [
    ("success", ["status", "--data-dir", "{data}"], None, 0, None),
    # 1: refused, rejected or failed
    ("invalid container", ["container", "verify", "-"], b'{"hmp_container": {}}', 1, None),
    ("node refusal", ["get", "did:hmp:container:nothere", "--data-dir", "{data}"], None, 1, "not_found"),
    ("no node on the data dir", ["status", "--data-dir", "{base}/none"], None, 1, "no node is running"),
    ("wait timed out", ["wait", "--timeout", "0.5", "--data-dir", "{base}/none"], None, 1, "no node answered"),
    ("busy port", ["run", "--data-dir", "{base}/busy", "--api-port", "{api_port}"], None, 2, "cannot listen"),
    ("another node on the data dir", ["run", "--data-dir", "{data}"], None, 1, "another node is running"),
    ("nothing recalled", ["recall", "zeppelinxylophone", "--tokens", "100", "--bytes", "1000", "--data-dir", "{data}"],
     None, 1, "nothing recalled"),
    ("trust: no evaluations", ["trust", NOBODY, "--data-dir", "{data}"], None, 1, f"nothing is known of {NOBODY}"),
    ("peer-index: no such peer", ["peer-index", NOBODY, "--data-dir", "{data}"], None, 1,
     f"peer_not_connected: {NOBODY} is not a connected peer"),
    ("stop: no node on the data dir", ["stop", "--data-dir", "{base}/none"], None, 1, "no node is running on"),
    ("restore while a node runs", ["restore", "{base}/newer", "--data-dir", "{data}"], None, 1,
     "another node is running"),
    # 2: usage
    ("a bad flag", ["list", "--bogus", "--data-dir", "{data}"], None, 2, "unrecognized arguments"),
    ("evaluate --value out of range", ["evaluate", "{did}", "--type", "support", "--value", "7",
                                       "--data-dir", "{data}"], None, 2, "--value"),
    ("vote value out of range", ["vote", "{did}", "7", "--data-dir", "{data}"], None, 2, "--value"),
    ("recall --tokens too large", ["recall", "x", "--tokens", "100000000", "--bytes", "100", "--data-dir", "{data}"],
     None, 2, "--tokens"),
    ("unknown --class", ["send", "--class", "gaol", "--data-dir", "{data}"], None, 2, "--allow-unknown-class"),
    ("unreadable file", ["container", "verify", "{base}/none.hmp"], None, 2, "cannot read"),
    ("unsafe data dir", ["status", "--data-dir", "{base}/unsafe"], None, 2, "refusing to use data dir"),
    ("invalid settings", ["run", "--data-dir", "{base}/settings", "--peer-port", "70000"], None, 2, "peer.port"),
    ("export --out unwritable", ["export", "--out", "{base}/none/dump.jsonl", "--data-dir", "{data}"], None, 2,
     "--out"),
    ("backup into an existing dir", ["backup", "{base}/existing", "--data-dir", "{data}"], None, 2, "exists"),
    ("run: a store that is not a database", ["run", "--data-dir", "{base}/notadb"], None, 2, "not a database"),
    ("run: a store of a newer hmpnode", ["run", "--data-dir", "{base}/newer"], None, 2, "newer than this hmpnode"),
    ("run: a lock it cannot open", ["run", "--data-dir", "{base}/lockdir"], None, 2, "lock"),
    ("log-level: not a level", ["log-level", "loud", "--data-dir", "{data}"], None, 2, "invalid choice: 'loud'"),
    ("restore: a store of a newer hmpnode", ["restore", "{base}/newer", "--data-dir", "{base}/restored"], None, 2,
     "newer than this hmpnode"),
    ("restore: not a backup", ["restore", "{base}/existing", "--data-dir", "{base}/restored"], None, 2,
     "is not a backup"),
    pytest.param("run: an unwritable lock", ["run", "--data-dir", "{base}/lockro"], None, 2, "Permission denied",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file")),
]


@pytest.mark.parametrize("name, argv, stdin, code, says", CASES, ids=[
    c.values[0] if hasattr(c, "values") else c[0] for c in CASES])
def test_exit_code_follows_the_table(ctx, name, argv, stdin, code, says):
    proc = _run(*[a.format(**ctx) for a in argv], stdin=stdin)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == code, (name, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hmpnode:")]
    if argv[0] != "run":  # the daemon may log before its one line
        assert len(err.splitlines()) == len(lines), err
    if says is None:
        assert lines == [], err
    else:
        assert len(lines) == 1 and says in lines[0], err
    assert "DID:" not in err  # a field-to-flag rename never touches a DID


def test_watch_interrupted_by_ctrl_c_exits_130(ctx):
    """`watch` ends on Ctrl-C like every command, 130; SIGTERM ends it with 0."""
    tag = "exitcodes"
    for text in ("first", "second"):
        assert _run("remember", text, "--tag", tag, "--data-dir", ctx["data"]).returncode == 0
    page = _run("list", "--tag", tag, "--limit", "1", "--data-dir", ctx["data"])
    cursor = page.stderr.decode().split("--cursor ", 1)[1].split()[0]  # "more: --cursor C (or --all)"
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 0)):
        before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child
        try:
            watch = subprocess.Popen([sys.executable, "-m", "hmpnode", "watch", "--tag", tag, "--cursor", cursor,
                                      "--data-dir", ctx["data"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=node_env(), start_new_session=True)
        finally:
            signal.signal(signal.SIGINT, before)
        try:
            line = watch.stdout.readline()  # the second memory: watching is under way
            assert line and json.loads(line)["event"], watch.stderr.read()
            watch.send_signal(sig)
            assert watch.wait(timeout=EVENT_TIMEOUT) == code
            err = watch.stderr.read()
            assert b"Traceback" not in err and err.count(b"\n") <= 1, err
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait(timeout=10)

