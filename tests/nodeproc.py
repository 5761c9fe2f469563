"""`hmpnode run` as a real process, for the daemon, client and durability tests.

Each node runs in its own process group; `NodeProcess.cleanup()` (called by the
`nodes` fixture in a `finally`) SIGKILLs the group if anything is still alive,
and every wait is bounded by a deadline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 20.0


def _reserve_discovery_port() -> tuple[socket.socket, int]:
    """A UDP port held for this test process's lifetime, for its nodes' LAN discovery.
    Bound without SO_REUSEADDR, so the kernel hands out a port no socket uses (not
    another pytest-xdist worker's, nor another run's); SO_REUSEADDR set afterwards lets
    the nodes (which bind it with SO_REUSEADDR + SO_REUSEPORT) share it, while a plain
    bind to port 0 (a DHT or API socket anywhere on the host) is never given it. It
    joins no group, so it takes none of the nodes' multicast."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.setsockopt(socket.IPPROTO_IP, 49, 0)  # IP_MULTICAST_ALL off: no other socket's groups
    except OSError:
        pass
    return sock, sock.getsockname()[1]


_DISCOVERY_SOCKET, DISCOVERY_PORT = _reserve_discovery_port()

#: test nodes keep to loopback: peer port, DHT and LAN discovery on 127.0.0.1 only, on the
#: discovery port of this test process (its nodes find each other, no other worker's do);
#: a free peer port on every start (not the one kept from the first: a node restarted by a
#: test never waits for, or collides on, its old port; tests/test_addresses.py tests "auto")
LOOPBACK_MESH = {
    "HMPNODE_PEER_HOST": "127.0.0.1",
    "HMPNODE_PEER_PORT": "0",
    "HMPNODE_PEER_DISCOVERY_INTERFACES": "127.0.0.1",
    "HMPNODE_PEER_DISCOVERY_PORT": str(DISCOVERY_PORT),
}


def node_env(**extra: str) -> dict[str, str]:
    # NOTIFY_SOCKET: a test run under a service manager must not tell it that test nodes are ready
    env = {k: v for k, v in os.environ.items() if not k.startswith("HMPNODE_") and k != "NOTIFY_SOCKET"}
    env.update(LOOPBACK_MESH)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def hmp(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None, timeout: float = 60):
    """One `hmpnode` command, run to completion."""
    proc = subprocess.run([sys.executable, "-m", "hmpnode", *args], input=stdin, capture_output=True,
                          env=env or node_env(), timeout=timeout)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    return proc


class NodeProcess:
    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None, api_port: str | None = "0",
                 pass_data_dir: bool = True, prefix: list[str] | tuple[str, ...] = ()):
        """`data_dir`: where the node keeps its state; `pass_data_dir=False` leaves
        it to the node to find (environment, platform default) and only watches it.
        `prefix`: argv that execs the node, e.g. `ip netns exec NS` (it must exec,
        so that the process it starts is the node itself)."""
        self.prefix = list(prefix)
        self.data_dir = Path(data_dir)
        self.pass_data_dir = pass_data_dir
        self.args = list(args)
        self.env = env or node_env()
        self.api_port = api_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.{time.monotonic_ns()}.log"
        self._log = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> NodeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # a file, not a pipe: a full pipe would stall the node
        cmd = [*self.prefix, sys.executable, "-m", "hmpnode", "run"]
        if self.pass_data_dir:
            cmd += ["--data-dir", str(self.data_dir)]
        if self.api_port is not None:
            cmd += ["--api-port", self.api_port]
        self.proc = subprocess.Popen(cmd + self.args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     env=self.env, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict:
        """node.json written by this process; fails with the node's log otherwise."""
        deadline = time.monotonic() + timeout
        node_file = self.data_dir / "node.json"
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"node exited with {self.proc.returncode} before it was ready:\n{self.log()}")
            try:
                info = json.loads(node_file.read_bytes())
            except (FileNotFoundError, ValueError):
                info = None
            if info and info.get("pid") == self.pid:
                return info
            time.sleep(0.05)
        raise AssertionError(f"node not ready within {timeout} s:\n{self.log()}")

    def wait(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node did not exit within {timeout} s:\n{self.log()}") from None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait for the exit status."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group, at once."""
        if self.proc is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cleanup(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:  # stragglers of the group, if any
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Nodes:
    """Factory handed out by the `nodes` fixture; remembers every process it made."""

    def __init__(self):
        self.made: list[NodeProcess] = []

    def __call__(self, data_dir: Path, *args: str, **kwargs) -> NodeProcess:
        node = NodeProcess(data_dir, *args, **kwargs)
        self.made.append(node)
        return node.start()

    def cleanup(self) -> None:
        for node in self.made:
            node.cleanup()
