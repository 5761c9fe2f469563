"""The CLI's rough edges (issue 13): help everywhere, exit codes documented, classes and
evaluation types checked, errors naming the flag typed, `wait` and `id`, and a busy API
port reported before the mesh starts. Real processes throughout."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest

from hmpnode.cli import EXIT_CODES, build_parser
from hmpnode.container.evaluations import EVALUATION_TYPES
from hmpnode.container.schema import default_schemas
from tests.nodeproc import NodeProcess, hmp, node_env


def _walk(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, f"{path} {name}")


def test_every_subcommand_has_a_description_and_every_option_help():
    missing = []
    for path, parser in _walk(build_parser(), "hmpnode"):
        if not parser.description:
            missing.append(f"{path}: no description")
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction) and not action.help:
                missing.append(f"{path}: {'/'.join(action.option_strings) or action.dest} has no help")
    assert not missing, "\n".join(missing)


def test_help_lists_exit_codes_classes_and_evaluation_types():
    top = hmp("--help")
    assert top.returncode == 0 and "exit codes:" in top.stdout.decode()
    send = hmp("send", "--help").stdout.decode()
    assert EXIT_CODES.splitlines()[1].strip() in send
    flat = " ".join(send.split())  # argparse wraps lines
    for name in default_schemas().known_classes:
        assert name in flat, name
    evaluate = " ".join(hmp("evaluate", "--help").stdout.decode().split())
    for kind in EVALUATION_TYPES:
        assert kind in evaluate, kind


def test_argparse_errors_name_the_program_once():
    proc = hmp("recall", "--tokens", "5")
    assert proc.returncode == 2
    line = proc.stderr.decode()
    assert line.count("hmpnode") == 1 and line.startswith("hmpnode: recall: ") and line.count("\n") == 1, line


def test_unknown_class_refused_unless_allowed(tmp_path):
    key = tmp_path / "k.json"
    assert hmp("keygen", "--out", str(key)).returncode == 0
    proc = hmp("container", "build", "--key", str(key), "--class", "diary_entyr")
    assert proc.returncode == 2 and b"--class 'diary_entyr'" in proc.stderr and b"--allow-unknown-class" in proc.stderr
    assert proc.stdout == b""
    proc = hmp("container", "build", "--key", str(key), "--class", "diary_entyr", "--allow-unknown-class")
    assert proc.returncode == 0, proc.stderr
    # refused before the node is asked: no node is running on this data dir
    proc = hmp("send", "--data-dir", str(tmp_path / "none"), "--class", "gaol")
    assert proc.returncode == 2 and b"--allow-unknown-class" in proc.stderr


def _ask(data, *args, timeout=30):
    return subprocess.run([sys.executable, "-m", "hmpnode", *args, "--data-dir", str(data)], capture_output=True,
                          env=node_env(), timeout=timeout, stdin=subprocess.DEVNULL)


def test_client_errors_name_the_flag_and_types_are_checked(nodes, tmp_path):
    data = tmp_path / "n"
    nodes(data, env=node_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false")).wait_ready()
    proc = _ask(data, "recall", "anything", "--tokens", "100000000", "--bytes", "100")
    assert proc.returncode == 2 and b"--tokens" in proc.stderr and b"max_tokens" not in proc.stderr, proc.stderr
    proc = _ask(data, "watch", "--cursor", "not-a-cursor")
    assert proc.returncode == 2 and b"--cursor" in proc.stderr and b"Last-Event-ID" not in proc.stderr, proc.stderr
    proc = _ask(data, "list", "--limit", "100000")
    assert proc.returncode == 2 and b"--limit:" in proc.stderr, proc.stderr
    proc = _ask(data, "remember", "x", "--ttl", "soon")
    assert proc.returncode == 2 and proc.stderr.startswith(b"hmpnode: --ttl 'soon'"), proc.stderr

    made = json.loads(_ask(data, "remember", "a thing to evaluate").stdout)
    proc = _ask(data, "evaluate", made["did"], "--type", "suport", "--value", "0.5")
    assert proc.returncode == 2 and b"--type 'suport'" in proc.stderr and b"--allow-custom-type" in proc.stderr
    proc = _ask(data, "evaluate", made["did"], "--type", "support", "--value", "0.5")
    assert proc.returncode == 0, proc.stderr
    proc = _ask(data, "evaluate", made["did"], "--type", "usefulness", "--value", "0.5", "--allow-custom-type")
    assert proc.returncode == 0, proc.stderr


def test_wait_and_id(nodes, tmp_path):
    data = tmp_path / "n"
    proc = _ask(data, "wait", "--timeout", "0.5")
    assert proc.returncode == 1 and b"no node answered within 0.5 s" in proc.stderr and proc.stderr.count(b"\n") == 1
    assert _ask(data, "wait", "--timeout", "0").returncode == 2
    node = nodes(data, env=node_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false"))
    proc = _ask(data, "wait", "--timeout", "60", timeout=90)  # started at once: wait is what makes this safe
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["pid"] == node.pid and info == node.wait_ready()
    # `hmpnode --data-dir D id` (the global flag) and the subcommand's flag agree
    glob = subprocess.run([sys.executable, "-m", "hmpnode", "--data-dir", str(data), "id"], capture_output=True,
                          env=node_env(), timeout=30)
    assert glob.returncode == 0 and glob.stdout.decode().strip() == info["did"]
    assert _ask(data, "id", "--public-key").stdout.decode().strip() == info["public_key"]


@pytest.mark.parametrize("flag, message", [
    ("--api-port", "cannot listen on 127.0.0.1:{port} (--api-host/--api-port"),
    ("--peer-port", "cannot listen for peers on 127.0.0.1:{port} (--peer-host/--peer-port"),
])
def test_busy_port_is_reported_before_dht_and_lan_start(tmp_path, flag, message):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = NodeProcess(tmp_path / "n", flag, str(port), api_port=None, env=node_env()).start()
        try:
            code = node.wait(timeout=60)
            log = node.log()
        finally:
            node.cleanup()
    assert code == 2, log  # a busy port: exit 2 (README, exit codes)
    assert message.format(port=port) in log, log
    # the peer port, the DHT and LAN discovery never started
    assert "DHT listening" not in log and "lan discovery" not in log and "node ready" not in log, log
    assert not (tmp_path / "n" / "node.json").exists()


def test_config_show_and_check(tmp_path):
    """`config show`: every setting with where it came from; `config check [FILE]`: exit 0,
    or 2 with one line naming the key and the reason; an HMPNODE_* variable that names no
    setting is refused the same way (it used to be ignored)."""
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    (data / "hmpnode.toml").write_text("[peer]\nfanout = 3\n")
    env = node_env(HMPNODE_API_MAX_BATCH="10")
    proc = hmp("config", "show", "--data-dir", str(data), env=env)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)["settings"]
    assert shown["peer"]["fanout"] == {"value": 3, "source": str(data / "hmpnode.toml")}
    assert shown["api"]["max_batch"] == {"value": 10, "source": "HMPNODE_API_MAX_BATCH"}
    assert shown["node"]["log_level"]["source"] == "default"
    ok = hmp("config", "check", "--data-dir", str(data), env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    bad = tmp_path / "bad.toml"
    bad.write_text("[peer]\nfanout = -1\n")
    refused = hmp("config", "check", str(bad), "--data-dir", str(data), env=env)
    lines = refused.stderr.decode().strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "peer.fanout" in lines[0] and "Traceback" not in lines[0]
    bogus = hmp("config", "check", "--data-dir", str(data), env=node_env(HMPNODE_BOGUS="1"))
    assert bogus.returncode == 2 and b"unknown setting HMPNODE_BOGUS" in bogus.stderr
