"""Running hmpnode as a service: readiness over $NOTIFY_SOCKET (systemd Type=notify),
the token-free /healthz probe, and the operator's metrics, on real node processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from hmpnode.daemon import sd_notify
from tests.meshutil import MeshNode, wait_for
from tests.nodeproc import node_env
from tests.test_api import parse_metrics
from tests.test_mesh import _over_relay_quota, _relay_holds


def _get(url: str, token: str | None = None, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _notify_socket() -> tuple[socket.socket, str]:
    """A unix datagram socket as systemd makes one (short path: sun_path holds 108 bytes)."""
    directory = tempfile.mkdtemp(prefix="hmpn-", dir="/tmp")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    return sock, path


def _receive(sock: socket.socket, timeout: float) -> dict[str, str]:
    sock.settimeout(timeout)
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines() if "=" in line)


# -- readiness (sd_notify) -----------------------------------------------------------------


def test_sd_notify_sends_one_datagram_and_is_quiet_without_a_manager(tmp_path):
    sock, path = _notify_socket()
    try:
        assert sd_notify("READY=1\nSTATUS=x", {"NOTIFY_SOCKET": path}) is True
        assert _receive(sock, 5) == {"READY": "1", "STATUS": "x"}
        assert sd_notify("READY=1", {}) is False  # not under a service manager
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "relative/path"}) is False
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}) is False
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def test_sd_notify_abstract_socket():
    name = f"hmpnode-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name}) is True
        assert _receive(sock, 5) == {"READY": "1"}
    finally:
        sock.close()


def test_node_says_ready_once_listening_and_stopping_on_sigterm(nodes, tmp_path):
    sock, path = _notify_socket()
    try:
        node = nodes(tmp_path / "n", env=node_env(NOTIFY_SOCKET=path))
        fields = _receive(sock, 30)
        assert fields["READY"] == "1" and fields["MAINPID"] == str(node.pid)
        # ready means listening: node.json is there and the API and the peer port answer now
        info = json.loads((tmp_path / "n" / "node.json").read_bytes())
        assert info["pid"] == node.pid and fields["STATUS"].endswith(info["api"]["url"])
        assert _get(info["api"]["url"] + "/healthz")[0] == 200
        with socket.create_connection(("127.0.0.1", info["peer"]["port"]), timeout=5):
            pass
        node.signal(signal.SIGTERM)
        assert _receive(sock, 20) == {"STOPPING": "1"}
        assert node.wait() == 0
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


# -- /healthz ---------------------------------------------------------------------------------


def test_healthz_needs_no_token_and_says_nothing_else(nodes, tmp_path):
    node = nodes(tmp_path / "n")
    info = node.wait_ready()
    url = info["api"]["url"]
    token = (tmp_path / "n" / "api.token").read_text().strip()
    for auth in (None, "wrong", token):
        status, headers, body = _get(url + "/healthz", auth)
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert headers["Content-Type"].startswith("application/json")
    text = body.decode()
    assert info["did"] not in text and info["version"] not in text and "hmpnode" not in text
    # everything else still wants the token
    assert _get(url + "/v1/health")[0] == 401
    assert _get(url + "/metrics")[0] == 401
    assert _get(url + "/v1/health", token)[0] == 200


# -- metrics ---------------------------------------------------------------------------------


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_render_mesh_families_and_leaves_out_what_is_off():
    from hmpnode.api.metrics import Histogram, render

    mesh = {"peers_known": 3, "sessions": {"inbound": 2}, "session_roles": {"relay": 1, "mailman": 0, "other": 1},
            "relay": {"items": 2, "bytes": 300}, "outbox": {"items": 1, "oldest_age_seconds": 12.34567},
            "dht": None, "lan": None}
    types, samples = parse_metrics(render({}, {}, {}, rate=0.0, subscribers=0, histogram=Histogram(), mesh=mesh))
    assert _value(samples, "hmpnode_peer_sessions", direction="inbound") == 2
    assert _value(samples, "hmpnode_peer_sessions", direction="outbound") == 0
    assert _value(samples, "hmpnode_peer_sessions_by_role", role="other") == 1
    assert _value(samples, "hmpnode_relay_queue_bytes") == 300
    assert _value(samples, "hmpnode_outbox_oldest_age_seconds") == 12.346
    assert types["hmpnode_outbox_items"] == "gauge" and _value(samples, "hmpnode_peers_known") == 3
    assert not any(n.startswith(("hmpnode_dht_", "hmpnode_lan_")) for n in types)  # DHT and LAN off
    types, _ = parse_metrics(render({}, {}, {}, rate=0.0, subscribers=0, histogram=Histogram()))
    assert "hmpnode_peers_known" not in types  # no mesh at all (an API without one)


async def _metrics(node: MeshNode):
    return parse_metrics(await node.client.metrics())


async def test_mesh_metrics_on_real_nodes(nodes, tmp_path):
    """A relay holding two containers for an offline recipient, a sender with one
    left in its outbox: sessions, peers, relay queue, outbox, DHT and LAN discovery
    show what the nodes' status says."""
    relay, recipient, sender = await _over_relay_quota(nodes, tmp_path, 2, 3)
    try:
        await wait_for(lambda: _relay_holds(relay, 2), 60, "the relay to hold two")

        async def one_left():
            return (await sender.client.status())["mesh"]["outbox"] == 1

        await wait_for(one_left, 60, "the sender to keep the third in its outbox")

        async def dht_record_held():  # the others publish their peer records into the relay's DHT
            return (await relay.client.status())["mesh"]["dht"]["stored_records"] >= 1

        await wait_for(dht_record_held, 60, "the relay to hold a DHT record")
        types, samples = await _metrics(relay)
        status = (await relay.client.status())["mesh"]
        assert types["hmpnode_relay_queue_items"] == "gauge"
        assert _value(samples, "hmpnode_relay_queue_items") == 2
        assert _value(samples, "hmpnode_relay_queue_bytes") == status["relay"]["bytes"] > 0
        assert _value(samples, "hmpnode_peers_known") == status["known_peers"] >= 2
        sessions = {d: _value(samples, "hmpnode_peer_sessions", direction=d) for d in ("inbound", "outbound")}
        assert sum(sessions.values()) == status["connected"] >= 1
        assert _value(samples, "hmpnode_dht_routing_table_size") == status["dht_routing"] >= 1
        assert _value(samples, "hmpnode_dht_records_held") == status["dht"]["stored_records"] >= 1
        assert types["hmpnode_lan_announces_sent_total"] == "counter"
        assert _value(samples, "hmpnode_lan_announces_sent_total") >= 1
        assert _value(samples, "hmpnode_lan_announces_received_total") >= 1
        assert _value(samples, "hmpnode_lan_announces_accepted_total") >= 1
        assert _value(samples, "hmpnode_lan_announces_refused_total") >= 0
        assert _value(samples, "hmpnode_lan_peers") >= 1
        for name in ("hmpnode_relay_reoffered_total", "hmpnode_relay_expired_connected_total",
                     "hmpnode_peer_requests_expired_total", "hmpnode_peer_requests_omitted_total",
                     "hmpnode_outbox_woken_total"):
            assert types[name] == "counter" and _value(samples, name) >= 0

        types, samples = await _metrics(sender)
        assert _value(samples, "hmpnode_outbox_items") == 1
        assert 0 <= _value(samples, "hmpnode_outbox_oldest_age_seconds") < 600
        assert _value(samples, "hmpnode_relay_queue_items") == 0
        # the sender talks to the relay, which announces the relay role
        assert _value(samples, "hmpnode_peer_sessions_by_role", role="relay") >= 1
        assert _value(samples, "hmpnode_peer_sessions_by_role", role="other") == 0
        # the quota refusal is counted by area and reason, on the relay's side
        async def relay_refused():
            _, samples = await _metrics(relay)
            return {dict(labels)["reason"]: v for (name, labels), v in samples.items()
                    if name == "hmpnode_refused_total" and dict(labels)["area"] == "relay"}

        refused = await wait_for(relay_refused, 60, "the relay to count its quota refusal")
        assert refused.get("relay_quota_exceeded", 0) >= 1, refused
    finally:
        for n in (relay, recipient, sender):
            await n.close()


def test_operations_doc_names_every_metric_family():
    """docs/operations.md lists every metric family the node exports (the operator's reference)."""
    import hmpnode.api.metrics as M

    families = set(re.findall(r'"(hmpnode_[a-z_]+)"', Path(M.__file__).read_text()))
    assert len(families) > 30
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    missing = sorted(f for f in families if f not in doc)
    assert not missing, missing
