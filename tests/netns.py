"""Private networks for tests, built from Linux network namespaces and veth pairs.

    with NetLab() as lab:
        a, b = lab.namespace("a"), lab.namespace("b")
        lab.link(a, "10.77.1.1/24", b, "10.77.1.2/24")
        out = lab.run(a, ["ping", "-c1", "10.77.1.2"])

Nothing touches the host's own interfaces: veths are created inside their
namespaces, and deleting a namespace deletes its veth ends. Names carry the
pid and a random id, so parallel runs and leftovers of killed runs never
collide; `sweep_stale()` removes the leftovers of runs whose process is gone.
`close()` (also on `with` exit, whatever happened) kills every process started
through the lab (its process group), then whatever is still running inside
the lab's namespaces, then deletes the namespaces. Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hmpnode.client import pid_alive

__all__ = ["NetLab", "Namespace", "netns_unavailable", "sweep_stale", "PREFIX"]

PREFIX = "hmpt"
#: `ip netns exec NAME` bind-mounts the files of /etc/netns/NAME over those of /etc
ETC_NETNS = Path("/etc/netns")
_NAME = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]+-")
_IP_TIMEOUT = 10


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` does not work: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> list[str]:
    """Delete namespaces left by lab runs whose process no longer exists."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0]
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            _kill_inside(name)
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    if ETC_NETNS.is_dir():
        for path in ETC_NETNS.iterdir():
            m = _NAME.match(path.name)
            if m and not pid_alive(int(m.group(1))):
                shutil.rmtree(path, ignore_errors=True)
    return removed


def _kill_inside(name: str) -> None:
    """SIGKILL every process still in namespace `name` (ours: it is a lab namespace)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass(frozen=True)
class Namespace:
    name: str
    label: str

    def __str__(self) -> str:
        return self.name


class NetLab:
    """Namespaces, veth links and processes of one test; all removed by `close()`."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(3)
        self.namespaces: list[Namespace] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self._links = 0
        self._routes: dict[str, int] = {}
        self._etc: list[Path] = []

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespace(self, label: str) -> Namespace:
        """A new namespace with `lo` up."""
        if not re.fullmatch(r"[a-z0-9]{1,12}", label):
            raise ValueError("label: 1..12 lowercase letters or digits")
        ns = Namespace(f"{PREFIX}{os.getpid()}-{self.id}-{label}", label)
        _ip("netns", "add", ns.name)
        self.namespaces.append(ns)
        _ip("-n", ns.name, "link", "set", "lo", "up")
        return ns

    def link(self, a: Namespace, a_cidr: str | None, b: Namespace, b_cidr: str | None, *,
             broadcast: bool = True, multicast_route: bool = True) -> tuple[str, str]:
        """A veth pair between `a` and `b`, addressed and up; returns the two
        interface names. A cidr of None leaves that end without an address (a
        switch or bridge port). `broadcast=False` adds the addresses without `brd`
        (the kernel then reports none); `multicast_route` adds 224.0.0.0/4
        via the veth (multicast sends need a route in a namespace without a default one)."""
        n = self._links
        self._links += 1
        name_a, name_b = f"v{self.id}{n}a", f"v{self.id}{n}b"  # at most 15 characters
        assert len(name_a) <= 15
        _ip("-n", a.name, "link", "add", name_a, "type", "veth", "peer", "name", name_b, "netns", b.name)
        for ns, name, cidr in ((a, name_a, a_cidr), (b, name_b, b_cidr)):
            if cidr is not None:
                _ip("-n", ns.name, "addr", "add", cidr, *(["brd", "+"] if broadcast else []), "dev", name)
            _ip("-n", ns.name, "link", "set", name, "up")
            if multicast_route and cidr is not None:
                metric = self._routes.get(ns.name, 0)
                self._routes[ns.name] = metric + 1
                _ip("-n", ns.name, "route", "add", "224.0.0.0/4", "dev", name, "metric", str(metric))
        return name_a, name_b

    def hosts(self, ns: Namespace, names: dict[str, str]) -> None:
        """Host names (name -> IP) that resolve inside `ns` only: an /etc/hosts that
        `ip netns exec` puts in place for processes started in `ns` afterwards."""
        etc = ETC_NETNS / ns.name
        etc.mkdir(parents=True, exist_ok=True)
        self._etc.append(etc)
        lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{ip} {name}" for name, ip in names.items())]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def _argv(self, ns: Namespace, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns.name, *map(str, argv)]

    def run(self, ns: Namespace, argv: list[str], *, timeout: float = 30,
            **popen_kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run `argv` inside `ns` to completion; output is captured unless
        `capture_output=False` or stdout/stderr are given."""
        if popen_kwargs.pop("capture_output", True):
            popen_kwargs.setdefault("stdout", subprocess.PIPE)
            popen_kwargs.setdefault("stderr", subprocess.PIPE)
        proc = self.popen(ns, argv, **popen_kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def popen(self, ns: Namespace, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `ns` in its own process group; killed by `close()`."""
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self._argv(ns, argv), start_new_session=True, **popen_kwargs)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _kill(proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        """Kill the lab's processes, then delete its namespaces (and so its veths)."""
        for proc in self.procs:
            self._kill(proc)
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _kill_inside(ns.name)
            _ip("netns", "del", ns.name, check=False)
        self.namespaces.clear()
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        self._etc.clear()
