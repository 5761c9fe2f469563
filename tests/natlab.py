"""A NAT lab: an "internet" with delayed links and homes behind real nftables NATs.

    with NatLab(delay_ms=5) as lab:
        relay = lab.public("relay")              # a host on the internet: relay.ip is public
        a = lab.home("alice", "a")               # a host behind a NAT of kind "a"
        lab.run(a, ["python3", "-c", "..."])     # run inside a.ns (NetLab.run)
        node = lab.node(a, tmp / "A", "--roles", "relay", env=lab_env())  # `hmpnode run` in a.ns

Topology. The namespace `inet` holds only tests/natswitch.py: every internet-facing
interface of the lab (public hosts, home routers, the carrier-grade NAT) is one end of a
veth whose other end is a port of that switch, so all of them share one Ethernet segment
and every frame between two of them waits `delay_ms` once (the one-way delay; no netem on
this kernel). Every internet address is in a /24 of its own, as on the real internet,
where peers group observers by subnet: public hosts get 198.18.N.10, routers 198.19.N.10
(the benchmarking range 198.18.0.0/15, INTERNET), all on-link (`default dev WAN`), with
static neighbour entries (no ARP: a first packet between two hosts is not held back by a
resolution), IPv6 off. A home is a host namespace on
192.168.N.2/24 behind a router namespace on 192.168.N.1 whose nftables ruleset makes it
one of the KINDS. Offloads are off on the switch-facing interfaces so that every frame the
switch reads is a whole, checksummed Ethernet frame.

Everything (the switch, processes started through the lab, nodes, namespaces) is removed
by `close()` / `with` exit, whatever happened, as NetLab does. Needs root, iproute2,
nftables (`nft`) and ethtool (.ci/run installs them).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.netns import Namespace, NetLab, netns_unavailable
from tests.nodeproc import NodeProcess, node_env

__all__ = ["INTERNET", "KINDS", "Host", "NatLab", "lab_env", "natlab_unavailable"]

#: the lab's public addresses: the benchmarking range (RFC 2544), one /24 per host. Not
#: globally routable to Python's ipaddress: a node in the lab must be told it is dialable
#: ([peer] dial_allow), and whatever judges "public" must treat it as such.
INTERNET = ("198.18.0.0/15",)

#: what each kind of home is (the letters of issue 23's lab)
KINDS = {
    "a": "port-preserving masquerade: endpoint-independent mapping (the local port is kept for every "
         "destination); inbound only on a flow the home opened (conntrack), a stray SYN gets the router's reset",
    "b": "the same mapping plus a stateful filter: inbound only on a flow the home opened (address- and "
         "port-dependent filtering), anything else dropped silently, no reset",
    "c": "symmetric mapping: masquerade fully-random, a fresh public port for every flow",
    "d": "double NAT: a kind-a home router behind a carrier-grade NAT router (100.64.N.0/24 between them)",
    "e": "1:1 NAT, as on a cloud VM: the router's public address is dnat'ed to the host and its traffic snat'ed",
    "f": "a container: a bridged namespace (172.17.0.2 on a bridge) behind a masquerading, "
         "filtering host that is itself on the internet",
}

SWITCH = Path(__file__).with_name("natswitch.py")
_ATTACH_TIMEOUT = 10.0
_OFFLOADS = ("rx", "off", "tx", "off", "tso", "off", "gso", "off", "gro", "off", "sg", "off")


def natlab_unavailable() -> str | None:
    """Why the lab cannot be built here (a skip reason), or None."""
    why = netns_unavailable()
    if why:
        return why
    for tool in ("nft", "ethtool"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {'nftables' if tool == 'nft' else tool})"
    return None


def lab_env(**extra: str) -> dict[str, str]:
    """Environment of an `hmpnode run` in the lab: the peer port on every interface, no LAN
    discovery (the lab's public segment is one LAN: discovery would hide what static peers,
    the DHT and the NATs do)."""
    env = node_env(HMPNODE_PEER_HOST="0.0.0.0", HMPNODE_PEER_LAN_DISCOVERY="false", **extra)
    if "HMPNODE_PEER_PORT" not in extra:  # the node's config says (node_env's 0 would beat it)
        env.pop("HMPNODE_PEER_PORT", None)
    return env


@dataclass(frozen=True)
class Host:
    """One machine of the lab. `ip`: its own address (private behind a NAT); `public_ip`: the
    address the internet sees it at (its outermost router's); `routers`: its NAT routers,
    outermost first (empty for a public host)."""
    name: str
    kind: str  # "public" or a key of KINDS
    ns: Namespace
    ip: str
    public_ip: str
    routers: tuple[Namespace, ...] = field(default=())


class NatLab:
    """The internet namespace and its switch, public hosts, homes; all removed by `close()`."""

    def __init__(self, delay_ms: float = 5.0, queue: int = 20000) -> None:
        self.delay_ms = delay_ms
        self.queue = queue
        self.net = NetLab()
        self.hosts: dict[str, Host] = {}
        self.nodes: list[NodeProcess] = []
        self._publics = 0
        self._routers = 0
        self._homes = 0
        self._switch: subprocess.Popen[bytes] | None = None
        self._switch_out = b""
        self._attached: set[str] = set()
        self._uplinks: list[tuple[Namespace, str, str]] = []
        self.switch_counts: dict[str, int] | None = None

    def __enter__(self) -> NatLab:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building -------------------------------------------------------------------------

    def start(self) -> None:
        """The internet namespace and its switch."""
        self.inet = self._namespace("inet")
        self._switch = self.net.popen(self.inet, [sys.executable, str(SWITCH), "--delay-ms", str(self.delay_ms),
                                                  "--queue", str(self.queue)], stdout=subprocess.PIPE)

    def public(self, name: str) -> Host:
        """A host on the internet with its own public address (198.18.N.10)."""
        self._unused(name)
        ns = self._namespace(self._label("p", name))
        ip = f"198.18.{10 + self._next('_publics')}.10"
        self._uplink(ns, ip)
        return self._add(Host(name, "public", ns, ip, ip))

    def home(self, name: str, kind: str) -> Host:
        """A host behind a NAT of `kind` (a key of KINDS)."""
        if kind not in KINDS:
            raise ValueError(f"kind: one of {', '.join(KINDS)}")
        self._unused(name)
        n = 10 + self._next("_homes")
        if kind == "f":
            return self._container(name, n)
        router = self._namespace(self._label("r", name), router=True)
        wan_ip = f"198.19.{10 + self._next('_routers')}.10"
        routers: tuple[Namespace, ...] = (router,)
        if kind == "d":  # the carrier's router on the internet, the home router behind it
            cgn, home_router = router, self._namespace(self._label("q", name), router=True)
            cgn_wan = self._uplink(cgn, wan_ip)
            _inside, outside = self.net.link(cgn, f"100.64.{n}.1/24", home_router, f"100.64.{n}.2/24",
                                            multicast_route=False)
            self._nft(cgn, self._masquerade(cgn_wan))
            self._route(home_router, f"100.64.{n}.1")
            wan, router, routers = outside, home_router, (cgn, home_router)
        else:
            wan = self._uplink(router, wan_ip)
        host = self._namespace(self._label("h", name))
        ip = f"192.168.{n}.2"
        self.net.link(router, f"192.168.{n}.1/24", host, f"{ip}/24", multicast_route=False)
        self._route(host, f"192.168.{n}.1")
        if kind in ("a", "d"):
            self._nft(router, self._masquerade(wan))
        elif kind == "b":
            self._nft(router, self._masquerade(wan) + self._filter(wan))
        elif kind == "c":
            self._nft(router, self._masquerade(wan, "fully-random"))
        elif kind == "e":
            self._nft(router, f"""table ip nat {{
  chain prerouting {{ type nat hook prerouting priority dstnat; iifname "{wan}" dnat to {ip}; }}
  chain postrouting {{ type nat hook postrouting priority srcnat; oifname "{wan}" ip saddr {ip} snat to {wan_ip}; }}
}}
""")
        return self._add(Host(name, kind, host, ip, wan_ip, routers))

    def _container(self, name: str, n: int) -> Host:
        """Kind f: the docker host on the internet, a bridge, the container on it."""
        docker = self._namespace(self._label("r", name), router=True)
        wan_ip = f"198.19.{10 + self._next('_routers')}.10"
        wan = self._uplink(docker, wan_ip)
        bridge = f"br{self.net.id}"
        self._sh(docker, ["ip", "link", "add", bridge, "type", "bridge"])
        self._sh(docker, ["ip", "addr", "add", "172.17.0.1/16", "dev", bridge])
        self._sh(docker, ["ip", "link", "set", bridge, "up"])
        host = self._namespace(self._label("h", name))
        port, _ = self.net.link(docker, None, host, "172.17.0.2/16", multicast_route=False)
        self._sh(docker, ["ip", "link", "set", port, "master", bridge])
        self._route(host, "172.17.0.1")
        self._nft(docker, self._masquerade(wan, source="172.17.0.0/16") + self._filter(wan, input_too=False))
        return self._add(Host(name, "f", host, "172.17.0.2", wan_ip, (docker,)))

    # -- using ----------------------------------------------------------------------------

    def run(self, where: Host | Namespace, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """NetLab.run inside a host (or any lab namespace)."""
        return self.net.run(_ns(where), argv, **kwargs)

    def popen(self, where: Host | Namespace, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """NetLab.popen inside a host (or any lab namespace); killed by `close()`."""
        return self.net.popen(_ns(where), argv, **kwargs)

    def node(self, host: Host, data_dir: Path, *args: str, env: dict[str, str] | None = None,
             api_port: str | None = "0") -> NodeProcess:
        """`hmpnode run` inside `host` (tests/nodeproc.py), started; wait with `.wait_ready()`.
        `env` defaults to lab_env(). The agent API listens on the host's own loopback, so talk
        to the node with `lab.run(host, [python, -m, hmpnode, ..., --data-dir, data_dir])`."""
        proc = NodeProcess(data_dir, *args, env=env or lab_env(), api_port=api_port,
                           prefix=["ip", "netns", "exec", host.ns.name])
        self.nodes.append(proc)
        return proc.start()

    def close(self) -> None:
        """Stop the switch (its counters land in `switch_counts`), the nodes, then NetLab.close."""
        try:
            if self._switch is not None and self._switch.poll() is None:
                self._switch.send_signal(signal.SIGTERM)
                try:
                    out, _ = self._switch.communicate(timeout=3)
                    for line in (self._switch_out + out).decode(errors="replace").splitlines():
                        if line.startswith("stopped "):
                            self.switch_counts = json.loads(line[len("stopped "):])
                except subprocess.TimeoutExpired:
                    pass
            for proc in self.nodes:
                proc.cleanup()
            self.nodes.clear()
        finally:
            self.net.close()

    # -- pieces ---------------------------------------------------------------------------

    def _unused(self, name: str) -> None:
        if name in self.hosts:
            raise ValueError(f"a host named {name!r} exists")

    def _add(self, host: Host) -> Host:
        self.hosts[host.name] = host
        return host

    def _next(self, counter: str) -> int:
        value = getattr(self, counter)
        if value >= 200:
            raise ValueError("the lab numbers at most 200 hosts of a kind")
        setattr(self, counter, value + 1)
        return value

    @staticmethod
    def _label(prefix: str, name: str) -> str:
        if not name.isalnum() or not name.islower() or len(name) > 10:
            raise ValueError("name: 1..10 lowercase letters or digits")
        return prefix + name

    def _namespace(self, label: str, *, router: bool = False) -> Namespace:
        ns = self.net.namespace(label)
        settings = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        if router:
            settings.append("net.ipv4.ip_forward=1")
        self._sh(ns, ["sysctl", "-qw", *settings])
        return ns

    def _uplink(self, ns: Namespace, ip: str) -> str:
        """A veth from `ns` (addressed `ip`, on-link default route) to a new port of the switch."""
        port, wan = self.net.link(self.inet, None, ns, f"{ip}/24", multicast_route=False)
        for where, dev in ((self.inet, port), (ns, wan)):
            self._sh(where, ["ethtool", "-K", dev, *_OFFLOADS])
        self._sh(ns, ["ip", "link", "set", "dev", wan, "address", _mac(ip)])
        self._sh(ns, ["ip", "route", "add", "default", "dev", wan])
        # no ARP on the internet: every uplink knows every other's MAC, so that a first
        # packet is not held back by a resolution the other side's first packet is not
        for other_ns, other_wan, other_ip in self._uplinks:
            self._sh(ns, ["ip", "neigh", "replace", other_ip, "lladdr", _mac(other_ip), "dev", wan, "nud", "permanent"])
            self._sh(other_ns, ["ip", "neigh", "replace", ip, "lladdr", _mac(ip), "dev", other_wan, "nud", "permanent"])
        self._uplinks.append((ns, wan, ip))
        self._await_attached(port)
        return wan

    def _await_attached(self, port: str) -> None:
        """Until the switch says it reads `port` (bounded)."""
        assert self._switch is not None and self._switch.stdout is not None
        deadline = time.monotonic() + _ATTACH_TIMEOUT
        fd = self._switch.stdout.fileno()
        while port not in self._attached:
            left = deadline - time.monotonic()
            if left <= 0 or self._switch.poll() is not None:
                raise RuntimeError(f"the lab switch did not attach {port} (exit {self._switch.poll()})")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                self._switch_out += chunk
                *lines, self._switch_out = self._switch_out.split(b"\n")
                self._attached.update(line.decode().split(" ", 1)[1] for line in lines
                                      if line.startswith(b"attached "))

    def _route(self, ns: Namespace, gateway: str) -> None:
        self._sh(ns, ["ip", "route", "add", "default", "via", gateway])

    def _sh(self, ns: Namespace, argv: list[str]) -> None:
        """One configuration command inside `ns`; a failure raises with its message."""
        proc = self.net.run(ns, argv, timeout=15)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {ns.label}: {proc.stderr.decode().strip()}")

    def _nft(self, ns: Namespace, ruleset: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".nft") as fh:
            fh.write(ruleset)
            fh.flush()
            try:
                self._sh(ns, ["nft", "-f", fh.name])
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{ruleset}") from None

    @staticmethod
    def _masquerade(wan: str, flags: str = "", source: str | None = None) -> str:
        match = f"ip saddr {source} " if source else ""
        return f"""table ip nat {{
  chain postrouting {{ type nat hook postrouting priority srcnat; oifname "{wan}" {match}masquerade {flags}; }}
}}
"""

    @staticmethod
    def _filter(wan: str, *, input_too: bool = True) -> str:
        """Inbound from `wan` only for flows opened from inside; the rest dropped silently."""
        hooks = ("input", "forward") if input_too else ("forward",)
        chains = "".join(f"""  chain {hook} {{ type filter hook {hook} priority filter; policy accept;
    iifname "{wan}" ct state established,related accept; iifname "{wan}" drop; }}
""" for hook in hooks)
        return f"table ip filter {{\n{chains}}}\n"


def _mac(ip: str) -> str:
    """The lab's MAC of an internet address: locally administered, the address in it."""
    return "02:00:" + ":".join(f"{int(part):02x}" for part in ip.split("."))


def _ns(where: Host | Namespace) -> Namespace:
    return where.ns if isinstance(where, Host) else where
