"""`hmpnode run` as a real process: files and modes, the token, the data-dir
lock, configuration errors, clean shutdown, restart, log formats."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time
import urllib.error
import urllib.request

import pytest

from tests.nodeproc import hmp, node_env




def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _get(url: str, token: str | None = None, timeout: float = 10):
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_first_start_files_token_and_shutdown(nodes, tmp_path):
    data = tmp_path / "state" / "node"
    node = nodes(data)
    info = node.wait_ready()

    # node.json: where the node listens
    assert set(info) == {"did", "public_key", "pid", "api", "peer", "started", "version"}
    assert info["did"].startswith("did:hmp:agent:") and info["public_key"]
    peer = info["peer"]  # the mesh side: where peers connect, as announced
    assert peer["port"] > 0 and peer["dht_port"] > 0 and peer["roles"] == []
    assert f"tcp://127.0.0.1:{peer['port']}" in peer["addresses"]
    assert f"udp://127.0.0.1:{peer['dht_port']}" in peer["addresses"]
    assert info["pid"] == node.pid
    api = info["api"]
    assert api["host"] == "127.0.0.1" and isinstance(api["port"], int) and api["port"] > 0
    assert api["url"] == f"http://127.0.0.1:{api['port']}"
    assert info["started"].endswith("Z") and "T" in info["started"]

    # files and modes
    assert _mode(data) == 0o700
    assert _mode(data / "api.token") == 0o600
    assert _mode(data / "identity.json") == 0o600
    assert _mode(data / "node.json") == 0o600
    token = (data / "api.token").read_text().strip()
    assert len(token) == 43 and all(c.isalnum() or c in "-_" for c in token)  # 32 bytes base64url
    keystore = json.loads((data / "identity.json").read_text())
    assert keystore["did"] == info["did"] and keystore["sealed"] is False
    assert (data / "hmpnode.sqlite3").exists()
    assert not [p for p in data.iterdir() if p.name.endswith(".tmp")]

    # the token guards the API
    status, body = _get(api["url"] + "/v1/health")
    assert status == 401, body
    assert "reason" in json.loads(body)
    status, _ = _get(api["url"] + "/v1/health", token="wrong-" + token)
    assert status == 401
    status, body = _get(api["url"] + "/v1/health", token=token)
    assert status == 200, body
    status, body = _get(api["url"] + "/v1/status", token=token)
    assert status == 200 and json.loads(body)["did"] == info["did"]

    # SIGTERM: clean exit, node.json gone, the lock free again
    assert node.stop() == 0
    assert not (data / "node.json").exists()
    assert "stopped" in node.log()

    # a restart keeps the identity and the token
    again = nodes(data)
    info2 = again.wait_ready()
    assert info2["did"] == info["did"] and info2["public_key"] == info["public_key"]
    assert (data / "api.token").read_text().strip() == token
    assert _get(info2["api"]["url"] + "/v1/health", token=token)[0] == 200
    assert again.stop() == 0


def test_sigint_is_a_clean_shutdown_too(nodes, tmp_path):
    node = nodes(tmp_path / "d")
    node.wait_ready()
    node.signal(signal.SIGINT)
    assert node.wait() == 0
    assert not (tmp_path / "d" / "node.json").exists()


def test_second_node_on_the_same_data_dir_is_refused(nodes, tmp_path):
    data = tmp_path / "d"
    first = nodes(data)
    info = first.wait_ready()
    proc = hmp("run", "--data-dir", str(data), "--api-port", "0", timeout=30)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.decode()
    assert err.count("\n") == 1 and "another node is running" in err and str(first.pid) in err
    # the first is unaffected
    assert first.alive() and json.loads((data / "node.json").read_text())["pid"] == info["pid"]
    assert first.stop() == 0


def test_killed_node_does_not_block_a_restart(nodes, tmp_path):
    data = tmp_path / "d"
    first = nodes(data)
    info = first.wait_ready()
    first.kill()
    first.wait()
    assert (data / "node.json").exists()  # stale: written by a dead process
    second = nodes(data)
    info2 = second.wait_ready()
    assert info2["pid"] == second.pid != info["pid"] and info2["did"] == info["did"]
    assert second.stop() == 0


@pytest.mark.parametrize(
    ("args", "toml", "env", "needle"),
    [
        (["--api-port", "70000"], None, {}, "api.port"),
        (["--api-port", "eighty"], None, {}, "--api-port"),
        (["--log-format", "xml"], None, {}, "node.log_format"),
        (["--log-level", "loud"], None, {}, "node.log_level"),
        (["--roles", "relay,king"], None, {}, "node.roles"),
        ([], "[api]\nport = 1\nbogus = 2\n", {}, "bogus"),
        ([], "[nonsense]\nx = 1\n", {}, "nonsense"),
        ([], "[api]\nport = \"x\"\n", {}, "api.port"),
        ([], None, {"HMPNODE_API_PORT": "-1"}, "HMPNODE_API_PORT"),
    ],
)
def test_invalid_configuration_exits_2_naming_the_setting(tmp_path, args, toml, env, needle):
    data = tmp_path / "d"
    if toml is not None:
        data.mkdir()
        (data / "hmpnode.toml").write_text(toml)
    proc = hmp("run", "--data-dir", str(data), *args, env=node_env(**env), timeout=30)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.decode()
    assert err.count("\n") == 1 and needle in err, err
    assert not (data / "node.json").exists()


def test_missing_config_file_is_an_error(tmp_path):
    proc = hmp("run", "--data-dir", str(tmp_path / "d"), "--config", str(tmp_path / "nope.toml"), timeout=30)
    assert proc.returncode == 2 and b"nope.toml" in proc.stderr and proc.stderr.count(b"\n") == 1


def test_settings_from_file_env_and_flags(nodes, tmp_path):
    """flags > environment > hmpnode.toml; the file also sets the log format."""
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    (data / "hmpnode.toml").write_text('[node]\nlog_format = "json"\nname = "filed"\n[api]\nport = 1\n')
    node = nodes(data, api_port=None, env=node_env(HMPNODE_API_PORT="0"))
    info = node.wait_ready()
    assert info["api"]["port"] > 1  # env 0 beat the file's 1
    assert node.stop() == 0
    lines = [json.loads(line) for line in node.log().splitlines() if line.strip()]
    ready = [r for r in lines if r["message"] == "node ready"]
    assert ready and ready[0]["name"] == "filed" and ready[0]["did"] == info["did"]


def test_json_log_format_emits_json_lines(nodes, tmp_path):
    node = nodes(tmp_path / "d", "--log-format", "json", "--log-level", "debug")
    info = node.wait_ready()
    token = (tmp_path / "d" / "api.token").read_text().strip()
    assert _get(info["api"]["url"] + "/v1/health", token=token)[0] == 200
    assert node.stop() == 0
    lines = [line for line in node.log().splitlines() if line.strip()]
    assert len(lines) >= 3
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record)
    messages = [r["message"] for r in records]
    assert "node ready" in messages and "stopped" in messages
    ready = records[messages.index("node ready")]
    assert ready["did"] == info["did"] and ready["url"] == info["api"]["url"]
    assert any(r["logger"] == "hmpnode.access" for r in records)  # debug: access log on


def test_text_log_format(nodes, tmp_path):
    node = nodes(tmp_path / "d", "--log-format", "text")
    info = node.wait_ready()
    assert node.stop() == 0
    text = node.log()
    assert "node ready" in text and info["did"] in text
    with pytest.raises(ValueError):
        json.loads(text.splitlines()[0])


def test_sealed_identity_with_passphrase_file(nodes, tmp_path):
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    (tmp_path / "pw").write_text("correct horse\n")
    (data / "hmpnode.toml").write_text(f'[identity]\npassphrase_file = "{tmp_path / "pw"}"\n')
    node = nodes(data)
    info = node.wait_ready()
    keystore = json.loads((data / "identity.json").read_text())
    assert keystore["sealed"] is True and keystore["did"] == info["did"]
    assert node.stop() == 0
    # without the passphrase the node cannot start
    (data / "hmpnode.toml").write_text("")
    proc = hmp("run", "--data-dir", str(data), "--api-port", "0", timeout=30)
    assert proc.returncode == 2 and b"passphrase" in proc.stderr and proc.stderr.count(b"\n") == 1


def test_start_failures_a_restart_cannot_mend_exit_2_the_others_1():
    """exit_code_of: 2 stops systemd's restarts (RestartPreventExitStatus=2), so only what
    stays until the operator acts gets it."""
    import errno
    import sqlite3

    from hmpnode.daemon import exit_code_of
    from hmpnode.store.schema import NewerSchema

    def sqlite_error(code: int) -> sqlite3.Error:
        err = sqlite3.DatabaseError("x")
        err.sqlite_errorcode = code
        return err

    lasting = [OSError(errno.EACCES, "x"), OSError(errno.EROFS, "x"), OSError(errno.EISDIR, "x"),
               sqlite_error(sqlite3.SQLITE_NOTADB), sqlite_error(sqlite3.SQLITE_CORRUPT),
               sqlite_error(sqlite3.SQLITE_READONLY), NewerSchema("x"), OSError(errno.EADDRINUSE, "x")]
    passing = [OSError(errno.ENOSPC, "x"), sqlite_error(sqlite3.SQLITE_BUSY),
               sqlite_error(sqlite3.SQLITE_FULL), sqlite3.OperationalError("no code"), RuntimeError("x")]
    assert [exit_code_of(e) for e in lasting] == [2] * len(lasting)
    assert [exit_code_of(e) for e in passing] == [1] * len(passing)


def test_busy_port_is_a_one_line_error(nodes, tmp_path):
    first = nodes(tmp_path / "a")
    port = first.wait_ready()["api"]["port"]
    proc = hmp("run", "--data-dir", str(tmp_path / "b"), "--api-port", str(port), timeout=30)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.decode().splitlines() if line.startswith("hmpnode:")]
    assert len(lines) == 1 and "cannot listen" in lines[0] and str(port) in lines[0]
    assert not (tmp_path / "b" / "node.json").exists()
    assert first.stop() == 0


def test_token_file_mode_is_tightened(nodes, tmp_path):
    data = tmp_path / "d"
    node = nodes(data)
    node.wait_ready()
    assert node.stop() == 0
    os.chmod(data / "api.token", 0o644)
    again = nodes(data)
    again.wait_ready()
    assert _mode(data / "api.token") == 0o600
    assert again.stop() == 0


def test_default_data_dir_and_wildcard_host(nodes, tmp_path):
    """No --data-dir: the platform's user data dir ($XDG_DATA_HOME/hmpnode here),
    created 0700; client commands find the node there too. A wildcard API host
    is advertised as loopback in node.json's url."""
    env = node_env(XDG_DATA_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    data = tmp_path / "xdg" / "hmpnode"
    node = nodes(data, "--api-host", "0.0.0.0", env=env, pass_data_dir=False)
    info = node.wait_ready()
    assert _mode(data) == 0o700
    assert info["api"]["host"] == "0.0.0.0" and info["api"]["url"] == f"http://127.0.0.1:{info['api']['port']}"
    proc = hmp("status", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["node"]["pid"] == node.pid
    assert node.stop() == 0


def test_shutdown_ends_open_event_streams_promptly(nodes, tmp_path):
    node = nodes(tmp_path / "d")
    info = node.wait_ready()
    token = (tmp_path / "d" / "api.token").read_text().strip()
    request = urllib.request.Request(info["api"]["url"] + "/v1/events")
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as stream:
        assert stream.status == 200
        assert stream.readline().startswith(b":")  # the stream is open
        started = time.monotonic()
        node.signal(signal.SIGTERM)
        assert node.wait(timeout=15) == 0
        assert time.monotonic() - started < 5, "an idle event stream held up the shutdown"
        stream.read()  # returns: the server ended the stream (else the 10 s socket timeout raises)
    assert not (tmp_path / "d" / "node.json").exists()


def test_sigterm_lets_an_in_flight_request_finish(nodes, tmp_path):
    """A request being handled when SIGTERM arrives is answered, and what it
    stored is there after the restart. (aiohttp counts a request as in flight
    once its body has arrived; one still uploading is cut off.)"""
    from datetime import datetime, timedelta, timezone

    import nacl.utils

    from hmpnode.container.build import build_container
    from hmpnode.container.verify import encode_wire
    from hmpnode.identity import Identity

    sender = Identity(bytes([5]) * 32)
    now = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=5)
    # compressed: verifying one draws on the node's decompressed-bytes budget, which the
    # test watches to know the request is in flight
    wires = [encode_wire(build_container(sender, "note", {"text": f"in flight {i}"}, now=now, rng=nacl.utils.random,
                                         compression="zstd"))
             for i in range(1000)]
    body = b'{"containers":[' + b",".join(wires) + b"]}"

    data = tmp_path / "d"
    node = nodes(data)
    info = node.wait_ready()
    token = (data / "api.token").read_text().strip()
    head = (f"POST /v1/containers/import HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", info["api"]["port"]), timeout=15) as sock:
        sock.sendall(head + body)
        # in flight once the node verifies it; a fixed 30 ms here could let SIGTERM cut off
        # a request not yet read on a loaded machine
        deadline = time.monotonic() + 30
        while json.loads(_get(info["api"]["url"] + "/v1/status", token=token)[1])["inflight_decompressed"]["peak"] == 0:
            assert time.monotonic() < deadline, "the import was never taken up"
            time.sleep(0.01)
        node.signal(signal.SIGTERM)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 200 " in status_line, answer[:300]
    result = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert result["stored"] == 1000
    assert node.wait() == 0
    assert "SIGTERM received" in node.log()

    again = nodes(data)
    info2 = again.wait_ready()
    status, out = _get(info2["api"]["url"] + "/v1/status", token=token)
    assert status == 200 and json.loads(out)["store"]["containers"] == 1000
    assert again.stop() == 0


def test_busy_peer_or_dht_port_is_a_one_line_error(nodes, tmp_path):
    first = nodes(tmp_path / "a")
    peer = first.wait_ready()["peer"]
    for flag, port in (("--peer-port", peer["port"]), ("--dht-port", peer["dht_port"])):
        proc = hmp("run", "--data-dir", str(tmp_path / "b"), flag, str(port), env=node_env(), timeout=30)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.decode().splitlines() if line.startswith("hmpnode:")]
        assert len(lines) == 1 and "cannot listen for peers" in lines[0], lines
        assert not (tmp_path / "b" / "node.json").exists()
    bad = hmp("run", "--data-dir", str(tmp_path / "c"), "--peer-port", "70000", env=node_env(), timeout=30)
    assert bad.returncode == 2 and b"peer.port" in bad.stderr
    assert first.stop() == 0


def test_free_heap_pages_go_back_to_the_system_where_glibc_can():
    import platform

    from hmpnode.daemon import release_free_memory

    assert release_free_memory() is (platform.libc_ver()[0] == "glibc")


def test_malformed_http_is_a_400_and_one_log_line_without_traceback(nodes, tmp_path):
    """Unparsable HTTP on the API or the peer port (reachable from the LAN) is refused
    with a 400; it is logged as one warning, at most 10 a minute, never a traceback."""
    node = nodes(tmp_path / "d")
    info = node.wait_ready()
    ports = [int(info["api"]["url"].rsplit(":", 1)[1]), info["peer"]["port"]]
    bad = [b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
           b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
           b"GET / HTTP/1.1\r\nX-A: " + b"b" * 20_000 + b"\r\n\r\n"]
    for _ in range(5):
        for port in ports:
            for request in bad:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(request)
                    head = b""
                    while len(head) < 12 and (chunk := s.recv(12 - len(head))):
                        head += chunk
                    assert head == b"HTTP/1.0 400"
    assert node.stop() == 0
    text = node.log()
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if "refused a malformed HTTP request" in line]
    assert 1 <= len(lines) <= 10 and all(" WARNING " in line for line in lines), lines
    assert "Content-Length" in text


def _upgrade_then_reset(port: int, path: str, headers: str = "") -> None:
    """A WebSocket upgrade request, then the connection reset (SO_LINGER 0: RST, not FIN)
    before the answer is read: a dialler that drops during the upgrade."""
    import base64
    import struct

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n".encode())
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_a_disconnect_during_the_upgrade_is_one_log_line_without_traceback(nodes, tmp_path):
    """A client gone before its answer was written (here: reset during the WebSocket
    upgrade on the peer port, and during an event stream's start on the API) is an
    ordinary disconnect: at most 10 INFO lines a minute, no ERROR, no traceback."""
    from hmpnode.net.connections import PEER_PATH

    node = nodes(tmp_path / "d")
    info = node.wait_ready()
    token = (tmp_path / "d" / "api.token").read_text().strip()
    # whether a reset lands while the answer is written (the logged case) or before the
    # request was read (dropped unlogged) depends on the scheduling: rounds of 30 each
    # until one was logged, bounded (a loaded machine needs more of them)
    for _ in range(10):
        for _ in range(30):
            _upgrade_then_reset(info["peer"]["port"], PEER_PATH)
            _upgrade_then_reset(int(info["api"]["url"].rsplit(":", 1)[1]), "/v1/events",
                                f"Authorization: Bearer {token}\r\n")
        assert _get(info["api"]["url"] + "/v1/status", token)[0] == 200  # served on as before
        if "closed before its answer was written" in node.log():
            break
    assert node.stop() == 0
    text = node.log()
    assert "Traceback" not in text and " ERROR " not in text, text
    lines = [line for line in text.splitlines() if "closed before its answer was written" in line]
    assert 1 <= len(lines) <= 10 and all(" INFO " in line for line in lines), lines


def test_a_disconnect_line_keeps_to_the_log_level_and_its_own_quota():
    """The filter's line is INFO: a node logging at warning drops it; disconnects use up
    their own quota, not the malformed requests' (those are still logged)."""
    import logging

    from aiohttp.http_exceptions import BadStatusLine

    from hmpnode.logs import HttpNoiseFilter

    seen: list[logging.LogRecord] = []
    logger = logging.getLogger("hmpnode.test.http_noise")
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    logger.addFilter(HttpNoiseFilter(per_minute=2, clock=lambda: 0.0))
    logger.propagate = False
    try:
        for level, expected in ((logging.WARNING, []), (logging.INFO, [logging.INFO] * 2)):
            logger.setLevel(level)
            seen.clear()
            for _ in range(5):
                logger.error("Error handling request from %s", "10.0.0.1", exc_info=ConnectionResetError("gone"))
            assert [r.levelno for r in seen] == expected
        logger.error("Error handling request from %s", "10.0.0.1", exc_info=BadStatusLine("x"))
        assert seen[-1].levelno == logging.WARNING and "malformed" in seen[-1].getMessage()
    finally:
        logger.removeHandler(handler)


def test_idle_connections_are_closed_and_the_open_file_limit_raised(nodes, tmp_path):
    """A connection that sends no request (or half of one) is closed after
    node.idle_connection_seconds on both ports; the node runs with its soft open-file limit
    raised to the hard limit (at most 65 536)."""
    import resource

    node = nodes(tmp_path / "d", env=node_env(HMPNODE_NODE_IDLE_CONNECTION_SECONDS="2"))
    info = node.wait_ready()
    ports = [int(info["api"]["url"].rsplit(":", 1)[1]), info["peer"]["port"]]
    conns = []
    for port in ports:
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        conns += [idle, half]
    started = time.monotonic()
    for conn in conns:
        conn.settimeout(20)
        assert conn.recv(100) == b""  # closed by the node, without an answer
        conn.close()
    assert time.monotonic() - started < 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with open(f"/proc/{node.pid}/limits") as fh:
        line = next(line for line in fh if line.startswith("Max open files"))
    expected = 65_536 if hard == resource.RLIM_INFINITY else min(hard, 65_536)
    assert int(line.split()[3]) == max(soft, expected), line


def test_log_limiter_writes_a_key_at_its_rate_and_says_what_it_held_back():
    """What peers can cause (offences, undelivered holdings) is logged at most `lines` per
    key and window; the next line says how many were held back; keys are bounded."""
    import logging

    from hmpnode.logs import LogLimiter

    clock = [0.0]
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("hmpnode.test_limiter")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    limiter = LogLimiter(logger, 60.0, 1, max_keys=2, clock=lambda: clock[0])
    assert limiter.log(logging.WARNING, ("peer", "rate_limited"), "refused %s", "a")
    assert not any(limiter.log(logging.WARNING, ("peer", "rate_limited"), "refused %s", "b") for _ in range(500))
    assert limiter.log(logging.WARNING, ("peer", "other"), "refused %s", "c")  # its own key
    clock[0] = 61.0
    assert limiter.log(logging.WARNING, ("peer", "rate_limited"), "refused %s", "d")
    assert records == ["refused a", "refused c", "refused d (500 more like it not logged)"]
    assert not limiter.log(logging.DEBUG, "x", "below the level")
    limiter.log(logging.WARNING, "k3", "x")
    assert len(limiter._keys) == 2


def test_api_shows_the_settings_in_force_with_their_sources(nodes, tmp_path):
    """`GET /v1/config`: what `hmpnode config show` prints, for the running node: a file's
    setting names the file, a variable names itself, a flag names the flag, the rest say
    default; it needs the token like every route."""
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    (data / "hmpnode.toml").write_text("[peer]\nfanout = 3\n")
    node = nodes(data, "--log-level", "debug", env=node_env(HMPNODE_API_MAX_BATCH="10"))
    info = node.wait_ready()
    token = (data / "api.token").read_text().strip()
    assert _get(info["api"]["url"] + "/v1/config")[0] == 401
    status, body = _get(info["api"]["url"] + "/v1/config", token)
    assert status == 200, body
    shown = json.loads(body)
    assert shown["data_dir"] == str(data)
    settings = shown["settings"]
    assert settings["peer"]["fanout"] == {"value": 3, "source": str(data / "hmpnode.toml")}
    assert settings["api"]["max_batch"] == {"value": 10, "source": "HMPNODE_API_MAX_BATCH"}
    assert settings["node"]["log_level"] == {"value": "debug", "source": "--log-level"}
    assert settings["relay"]["max_per_recipient"]["source"] == "default"
    cli = json.loads(hmp("config", "show", "--data-dir", str(data), env=node_env(HMPNODE_API_MAX_BATCH="10")).stdout)
    assert cli["settings"]["peer"] == settings["peer"]


def test_a_start_waits_out_a_probes_shared_lock_but_not_a_nodes(tmp_path):
    """`hmpnode stop`/`status` test the data dir's lock with a shared flock held for an
    instant (daemon.lock_holder); a node starting in that instant waits it out instead of
    saying another node runs. A lock held all along is still refused, within the grace."""
    import fcntl
    import threading

    from hmpnode.daemon import LOCK_PROBE_GRACE_SECONDS, DaemonError, DataDirLock

    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    (data / "lock").write_bytes(b"")
    probe = os.open(data / "lock", os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    threading.Timer(LOCK_PROBE_GRACE_SECONDS / 5, os.close, (probe,)).start()  # the probe lets go
    lock = DataDirLock(data)
    lock.acquire()  # waited for the probe
    try:
        with pytest.raises(DaemonError, match="another node is running"):
            DataDirLock(data).acquire()  # a node's lock stays: refused once the grace is over
    finally:
        lock.release()
