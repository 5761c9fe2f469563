"""Reachability: the addresses peers see us at, and whether a dial-back confirms that
they reach us there (docs/protocol.md 34.1, 34.2). Sans-IO: time comes from `clock`,
nonces from `token`; the driver (`hmpnode.net.dialback`) feeds reports, sends the asks
this returns and says which nonces arrived.

Why each rule:

- An observed address counts only if this node would dial it on a peer's word
  (`routable`: globally routable, or allowed by [peer] dial_private / dial_allow): a
  loopback or LAN address is never called public in production.
- A dial-back is asked only for an address at least two peers in distinct groups agree
  on (a group: the /24, IPv6 /64, of a peer outside loopback and our LANs; else the
  peer's DID), so that one host minting DIDs cannot make us believe, confirm and then
  announce an address of its choosing (a victim's).
- Only a nonce arriving at our listening port confirms an address; a peer's
  `dialback_result` is informational (a refusal just leaves that ask without outcome).
- `public`: a confirmation within `recheck_seconds` of an address a peer still sees us at;
  `private`: asks went unanswered (their deadline passed) and none arrived; `unknown`
  otherwise. Evidence older than half of `recheck_seconds` is asked for again, and an
  address peers agree on for the first time is asked for at once.

`DialbackGate` is the serving side's limits: whom a node dials back, and how often.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from hmpnode.net.announce import parse_addr, url_host
from hmpnode.net.scope import host_key, network_of, parse_ip

__all__ = ["DialbackLimits", "Reachability", "DialbackGate", "Ask", "parse_dialback", "parse_observed",
           "DIALBACK_REFUSALS", "DEADLINE_SECONDS", "DIALBACK_PATH", "format_addr"]

#: where a dial-back lands: plain HTTP on the peer port
DIALBACK_PATH = "/hmp/v2/dialback"
#: seconds an asker waits for its nonce (a server dials within its timeout of the ask, at most 10 s)
DEADLINE_SECONDS = 20.0
#: peers in distinct groups that must report the same IP before it is asked for
MIN_GROUPS = 2
#: reports kept (one per peer DID), and per group: a host minting DIDs fills at most its share
MAX_REPORTS = 128
REPORTS_PER_GROUP = 4
#: peers asked per address and round, asks waiting at once, finished asks kept as evidence
ASKS_PER_ROUND = 3
MAX_PENDING = 16
MAX_HISTORY = 64
#: seconds after which a peer that refused an ask (busy, rate limited) may be asked again
RETRY_REFUSED_SECONDS = 60.0
#: ... and after `busy` (its dial-backs in progress were at their cap: a moment's state)
RETRY_BUSY_SECONDS = 10.0
#: longest `addr` member taken ("tcp://[IPv6]:65535" is 48 characters)
MAX_ADDR = 64
#: the `reason` of a refused dialback_result (docs/protocol.md 34.2)
DIALBACK_REFUSALS = frozenset({"malformed", "not_your_address", "relayed", "rate_limited", "busy", "unreachable"})

_NONCE = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class DialbackLimits:
    """Dial-backs served and asked ([peer] dialback_*; built by
    hmpnode.config.PeerSettings.dialback_limits)."""

    #: serving: one dial-back per asking DID and per target IP this often
    peer_interval_seconds: float = 60.0
    #: serving: dial-backs per minute node-wide, and at once
    per_minute: int = 30
    concurrent: int = 4
    #: serving: seconds one dial-back (connect and request) may take
    timeout_seconds: float = 5.0
    #: asking: one ask per peer this often
    ask_interval_seconds: float = 600.0
    #: asking: how long a verdict holds (asked again after half of it)
    recheck_seconds: float = 1800.0


def format_addr(ip: str, port: int) -> str:
    """`tcp://ip:port`, an IPv6 address in brackets."""
    return f"tcp://{url_host(ip)}:{port}"


def parse_observed(addr: Any) -> tuple[str, int] | None:
    """The (ip, port) of an `observed`/`dialback` addr member; None unless a `tcp://` IP literal."""
    if not isinstance(addr, str) or len(addr) > MAX_ADDR:
        return None
    try:
        scheme, host, port = parse_addr(addr)
    except ValueError:
        return None
    ip = parse_ip(host)
    if scheme != "tcp" or ip is None:
        return None
    return str(ip), port


def parse_dialback(message: dict[str, Any]) -> tuple[int, str, int, str] | None:
    """(id, ip, port, nonce) of a `dialback` frame; None when a member is missing or bad."""
    ask_id, nonce = message.get("id"), message.get("nonce")
    target = parse_observed(message.get("addr"))
    if (type(ask_id) is not int or not 0 <= ask_id < 2**53 or target is None
            or not isinstance(nonce, str) or _NONCE.fullmatch(nonce) is None):
        return None
    return ask_id, target[0], target[1], nonce


def _routable(ip: str) -> bool:
    addr = parse_ip(ip)
    return addr is not None and addr.is_global


@dataclass(slots=True)
class _Report:
    ip: str
    port: int
    local_port: int
    group: str
    at: float
    #: when the peer's connection was last seen gone (None: connected)
    gone: float | None = None


@dataclass(slots=True)
class Ask:
    """One dial-back asked of a peer."""

    id: int
    peer: str
    ip: str
    addr: str
    nonce: str
    at: float
    #: pending, arrived, failed (deadline passed), refused (the peer said so)
    outcome: str = "pending"
    reason: str = ""
    done: float | None = None
    #: the IP the dial-back came from
    source: str = ""


class Reachability:
    """What peers see us at and what dial-backs proved (module docstring)."""

    def __init__(self, port: int = 0, *, limits: DialbackLimits = DialbackLimits(),
                 routable: Callable[[str], bool] = _routable, clock: Callable[[], float] = time.monotonic,
                 token: Callable[[], str] = lambda: os.urandom(16).hex(), counters: Counter[str] | None = None) -> None:
        #: our listening (peer) port: what a dial-back targets; 0 until known
        self.port = port
        self.limits, self._routable, self._clock, self._token = limits, routable, clock, token
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self._reports: dict[str, _Report] = {}
        self._asks: deque[Ask] = deque()
        self._pending: dict[str, Ask] = {}
        self._asked_at: dict[str, float] = {}
        self._next_id = 1

    # -- reports --------------------------------------------------------------------------

    def observed(self, peer_did: str, addr: Any, local_port: int, *, peer_ip: str | None = None,
                 channel: str | None = None) -> bool:
        """A peer's `observed` report of the connection whose local port is `local_port`.
        `peer_ip` and `channel` (loopback, lan, global) place the peer in its group; without
        them the peer is a group of its own. False (counted) when the addr is not taken."""
        target = parse_observed(addr)
        if target is None or type(local_port) is not int or not 0 < local_port < 65536:
            self.counters["observed_malformed"] += 1
            return False
        now = self._clock()
        peer = parse_ip(peer_ip)
        group = peer_did if peer is None or channel in ("loopback", "lan") else network_of(peer)
        self._reports.pop(peer_did, None)
        same = [did for did, r in self._reports.items() if r.group == group]
        if len(same) >= REPORTS_PER_GROUP:
            del self._reports[same[0]]  # the group's oldest
            self.counters["observed_group_full"] += 1
        if len(self._reports) >= MAX_REPORTS:
            del self._reports[next(iter(self._reports))]
        self._reports[peer_did] = _Report(target[0], target[1], local_port, group, now)
        self.counters["observed"] += 1
        return True

    def _live(self, now: float) -> list[_Report]:
        """Reports of connected peers, and of peers gone less than recheck_seconds ago."""
        horizon = now - self.limits.recheck_seconds
        for did in [d for d, r in self._reports.items() if r.gone is not None and r.gone < horizon]:
            del self._reports[did]
        return list(self._reports.values())

    def _groups(self, now: float) -> dict[str, set[str]]:
        """Routable observed IPs -> the groups that reported them."""
        out: dict[str, set[str]] = {}
        for r in self._live(now):
            if self._routable(r.ip):
                out.setdefault(r.ip, set()).add(r.group)
        return out

    # -- dial-backs asked -----------------------------------------------------------------

    def asks(self, connected: Collection[str]) -> list[Ask]:
        """The dial-backs to ask now, of peers in `connected` (DIDs of direct connections
        that speak hmp-nat/1): the driver sends each as a `dialback` frame. Also marks
        the reports of peers not in `connected` as gone."""
        now = self._clock()
        for did, r in self._reports.items():
            if did in connected:
                r.gone = None
            elif r.gone is None:
                r.gone = now
        self._expire(now)
        if not self.port:
            return []
        out: list[Ask] = []
        for ip, groups in self._groups(now).items():
            if len(groups) < MIN_GROUPS or self._settled(ip, now):
                continue
            peers = [did for did, r in self._reports.items()
                     if r.ip == ip and did in connected
                     and now - self._asked_at.get(did, -1e18) >= self.limits.ask_interval_seconds]
            for did in peers[:ASKS_PER_ROUND]:
                if len(self._pending) >= MAX_PENDING:
                    return out
                ask = Ask(self._next_id, did, ip, format_addr(ip, self.port), self._token(), now)
                self._next_id += 1
                self._asked_at[did] = now
                self._pending[ask.nonce] = ask
                self._remember(ask)
                self.counters["dialback_asked"] += 1
                out.append(ask)
        return out

    def _settled(self, ip: str, now: float) -> bool:
        """An ask for `ip` is waiting, or one ended less than half a recheck ago."""
        half = now - self.limits.recheck_seconds / 2
        return any(a.ip == ip and (a.outcome == "pending" or (a.outcome in ("arrived", "failed") and a.done > half))
                   for a in self._asks)

    def _remember(self, ask: Ask) -> None:
        self._asks.append(ask)
        while len(self._asks) > MAX_HISTORY:
            old = self._asks.popleft()
            self._pending.pop(old.nonce, None)

    def _expire(self, now: float) -> None:
        for nonce, ask in list(self._pending.items()):
            if now - ask.at >= DEADLINE_SECONDS:
                ask.outcome, ask.done = "failed", now
                del self._pending[nonce]
                self.counters["dialback_failed"] += 1
        horizon = now - self.limits.ask_interval_seconds
        for did in [d for d, at in self._asked_at.items() if at < horizon]:
            del self._asked_at[did]

    def unsent(self, ask: Ask) -> None:
        """The driver could not send `ask` (the connection went): no outcome."""
        if self._pending.pop(ask.nonce, None) is not None:
            ask.outcome, ask.reason, ask.done = "refused", "unsent", self._clock()

    def result(self, peer_did: str, ask_id: Any, ok: Any, reason: Any) -> None:
        """A peer's `dialback_result`: a refusal ends a waiting ask without outcome; ok, and
        `unreachable` (it dialled, nothing answered), are only noted: the ask fails when its
        deadline passes without the nonce."""
        ask = next((a for a in self._asks if a.id == ask_id and a.peer == peer_did), None)
        if ask is None or type(ok) is not bool:
            self.counters["dialback_result_unknown"] += 1
            return
        if ask.outcome != "pending":
            return  # the nonce arrived first, or the deadline passed
        ask.reason = reason if isinstance(reason, str) and reason in DIALBACK_REFUSALS else ("" if ok else "other")
        if not ok and ask.reason != "unreachable":  # refused: it dialled nothing (unreachable waits out the deadline)
            now = self._clock()
            del self._pending[ask.nonce]
            ask.outcome, ask.done = "refused", now
            # it dialled nothing: ask it again sooner than an answered ask (but not at once)
            wait = RETRY_BUSY_SECONDS if ask.reason == "busy" else RETRY_REFUSED_SECONDS
            retry = now - self.limits.ask_interval_seconds + wait
            self._asked_at[peer_did] = min(self._asked_at.get(peer_did, retry), retry)
            self.counters["dialback_peer_refused"] += 1

    def arrived(self, nonce: Any, source_ip: str = "") -> bool:
        """A dial-back request reached our listening port with `nonce`: True when it was
        one we asked for (its address is confirmed), else counted and False."""
        now = self._clock()
        self._expire(now)
        ask = self._pending.pop(nonce, None) if isinstance(nonce, str) else None
        if ask is None:
            self.counters["dialback_unasked"] += 1
            return False
        ask.outcome, ask.done, ask.source = "arrived", now, source_ip[:64]
        self.counters["dialback_arrived"] += 1
        return True

    # -- what it found --------------------------------------------------------------------

    def _outcomes(self, now: float) -> tuple[set[str], set[str]]:
        """(confirmed IPs, IPs whose asks failed) within recheck_seconds, of IPs a peer still
        sees us at (one peer's new report does not undo what others confirmed)."""
        self._expire(now)
        seen = self._groups(now)
        horizon = now - self.limits.recheck_seconds
        recent = [a for a in self._asks if a.done is not None and a.done >= horizon and a.ip in seen]
        return ({a.ip for a in recent if a.outcome == "arrived"}, {a.ip for a in recent if a.outcome == "failed"})

    @property
    def verdict(self) -> str:
        """public, private or unknown (module docstring)."""
        confirmed, failed = self._outcomes(self._clock())
        return "public" if confirmed else "private" if failed else "unknown"

    def public_ips(self) -> list[str]:
        """Routable IPs peers see us at: confirmed first, then by the groups that report them."""
        now = self._clock()
        confirmed, _ = self._outcomes(now)
        groups = self._groups(now)
        return sorted(groups, key=lambda ip: (ip not in confirmed, -len(groups[ip]), ip))

    def confirmed_addresses(self) -> list[str]:
        """`tcp://IP:port` of our listening port at each confirmed IP: what we announce."""
        confirmed, _ = self._outcomes(self._clock())
        return [format_addr(ip, self.port) for ip in sorted(confirmed)] if self.port else []

    def port_preserving(self) -> bool | None:
        """Does our NAT keep a connection's local port? True: every routable report saw its
        connection's local port; False: one did not; None: no such report."""
        seen = [r.port == r.local_port for r in self._live(self._clock()) if self._routable(r.ip)]
        return all(seen) if seen else None

    def evidence(self) -> list[dict[str, Any]]:
        """Who saw us where and which dial-backs went how (for /v1/status), ages in seconds."""
        now = self._clock()
        self._live(now)
        out: list[dict[str, Any]] = [
            {"kind": "observed", "peer": did, "addr": format_addr(r.ip, r.port), "local_port": r.local_port,
             "group": r.group, "counted": self._routable(r.ip), "connected": r.gone is None,
             "age_seconds": round(now - r.at, 1)}
            for did, r in self._reports.items()
        ]
        out += [{"kind": "dialback", "peer": a.peer, "id": a.id, "addr": a.addr, "outcome": a.outcome,
                 "reason": a.reason, "source": a.source, "age_seconds": round(now - a.at, 1)} for a in self._asks]
        return out


class DialbackGate:
    """The serving side's decision: whom this node dials back, and how often. Only the IP
    the asker's connection comes from (nobody can make us dial a third party), at most
    once per `peer_interval_seconds` per asking DID and per target IP, `per_minute` in all
    and `concurrent` at once."""

    def __init__(self, limits: DialbackLimits = DialbackLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self._clock = limits, clock
        self._last: dict[str, float] = {}
        self._minute: deque[float] = deque()
        self.running = 0

    def admit(self, peer_did: str, peer_ip: str | None, direct: bool, ip: str) -> str | None:
        """None: dial `ip` now (call `done` after); else the refusal's reason code."""
        if not direct:
            return "relayed"
        asker, target = parse_ip(peer_ip), parse_ip(ip)
        if asker is None or target != asker:
            return "not_your_address"
        now = self._clock()
        for key in [k for k, at in self._last.items() if now - at >= self.limits.peer_interval_seconds]:
            del self._last[key]
        while self._minute and now - self._minute[0] >= 60.0:
            self._minute.popleft()
        keys = (f"did:{peer_did}", host_key(target))
        if any(k in self._last for k in keys):
            return "rate_limited"
        if len(self._minute) >= self.limits.per_minute or self.running >= self.limits.concurrent:
            return "busy"
        for k in keys:
            self._last[k] = now
        self._minute.append(now)
        self.running += 1
        return None

    def done(self) -> None:
        self.running -= 1

