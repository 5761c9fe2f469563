"""Hole punching (docs/protocol.md 34.4): the sans-IO coordination of one punch between two
peers already connected through a relay, DCUtR-style over TCP simultaneous open.

N (the side that accepted the relayed connection) offers its addresses in a `punch` frame,
A answers with its own, N measures the round trip, sends `punch_sync` and dials half a
round trip later, while A dials when the sync arrives: both SYNs leave at about the same
moment, so each NAT has a mapping open when the other's SYN arrives. Up to
`PunchLimits.attempts` attempts, each with its own deadline.

Everything here is pure (time passed in): `Punch` (one punch, either role), `vet_addrs`
(what a peer may make us dial), `PunchGate` (rate limits). The driver
(hmpnode.net.punching) binds sockets, sends frames and dials as the effects say."""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from hmpnode.net.announce import parse_addr
from hmpnode.net.penalty import TokenBucket

__all__ = ["PunchLimits", "Punch", "Send", "Dial", "Retry", "Done", "Effect", "PunchGate", "PunchFrame",
           "parse_frame", "vet_addrs", "REASONS", "OFFER_REASONS"]


#: why a punch ended without a direct link (the stable codes of `/v1/peers` and the frames)
REASONS = ("no_public_address", "not_port_preserving", "timeout", "refused", "rate_limited", "closed")
#: what a side may say instead of addresses: it cannot take part, so nobody dials
OFFER_REASONS = ("no_public_address", "not_port_preserving", "refused")


@dataclass(frozen=True, slots=True)
class PunchLimits:
    """Hole punching's bounds ([peer] punch_*; hmpnode.config builds them)."""

    #: attempts of one punch (DCUtR: 97.6 % of the successes come on the first)
    attempts: int = 3
    #: seconds N waits for A's answer, and A for the sync, in one attempt
    answer_seconds: float = 5.0
    #: seconds each side keeps dialling (a refused connect is retried at once) in one attempt
    dial_seconds: float = 2.0
    #: seconds between two attempts
    pause_seconds: float = 1.0
    #: connection attempts (SYNs) of one attempt at most
    max_syns: int = 1000
    #: addresses in one `punch` frame
    max_addrs: int = 4
    #: punches one peer may start, or we start with it, per `peer_window_seconds` (burst: all of them)
    peer_punches: int = 3
    peer_window_seconds: float = 600.0
    #: punch attempts (either role) per minute, node-wide, and in progress at once
    per_minute: int = 30
    concurrent: int = 8


# -- the frames ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PunchFrame:
    """A checked `punch` / `punch_sync` frame: `addrs` empty when `reason` says why not."""

    op: str
    id: int
    addrs: tuple[str, ...] = ()
    reason: str | None = None


def parse_frame(message: dict[str, Any], max_addrs: int) -> PunchFrame | str:
    """The frame's members checked for shape (not yet for whom they name: `vet_addrs`);
    a string says what is wrong (the handler refuses it as malformed_frame)."""
    op, pid = message.get("op"), message.get("id")
    if type(pid) is not int or not 0 <= pid < 2**53:
        return "id must be an integer 0..2^53-1"
    if op == "punch_sync":
        return PunchFrame(op, pid)
    addrs, reason = message.get("addrs"), message.get("reason")
    if not isinstance(addrs, list) or len(addrs) > max_addrs:
        return f"addrs must be a list of at most {max_addrs} addresses"
    if not all(isinstance(a, str) and len(a) <= 64 for a in addrs):
        return "addrs must be strings of at most 64 characters"
    if reason is not None and reason not in OFFER_REASONS:
        return f"reason must be one of {', '.join(OFFER_REASONS)}"
    if (reason is None) == (not addrs):
        return "a punch carries addresses or a reason, not both nor neither"
    return PunchFrame(op, pid, tuple(addrs), reason)


def vet_addrs(addrs: Sequence[str], vouched: Collection[str], allowed: Callable[[str], bool]) -> list[str]:
    """The addresses of a peer's `punch` we may dial: "tcp://IP:PORT" (an IP literal, no
    host name), whose IP is `vouched` (what the peer's own connection, its relay's report
    or its signed announce shows: nobody can make us SYN a host it is not at), and which
    `allowed` (the dial policy: globally routable, or private/loopback where allowed).
    Order kept, duplicates dropped; empty: refuse the punch."""
    out: list[str] = []
    for addr in addrs:
        try:
            scheme, host, _port = parse_addr(addr)
            ip = str(ipaddress.ip_address(host))
        except ValueError:
            continue
        if scheme == "tcp" and ip in vouched and allowed(addr) and addr not in out:
            out.append(addr)
    return out


# -- one punch ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send a `nat` frame `op` with `members`."""

    op: str
    members: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Dial:
    """At `at` (monotonic), dial `addrs` from the bound port until `until`; then call `dialled`."""

    at: float
    until: float
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Retry:
    """N: at `at`, bind a fresh port and call `attempt` again."""

    at: float


@dataclass(frozen=True, slots=True)
class Done:
    """The punch ended: direct (a connected stream came out), else failed with `reason`."""

    direct: bool
    reason: str | None = None


Effect = Send | Dial | Retry | Done


@dataclass
class Punch:
    """One punch with one peer, as N ("n": starts, measures the RTT, syncs) or A ("a":
    answers, dials on the sync). Feed it what happens (`attempt`, `answered`, `requested`,
    `synced`, `dialled`, `tick`); it returns what to do. `state` and `attempts` are what
    `/v1/peers` shows."""

    role: str
    limits: PunchLimits
    #: N's next frame id (each attempt has its own; A takes N's)
    next_id: int = 1
    state: str = "punching"
    attempts: int = 0
    reason: str | None = None
    #: the current attempt: its id, what it waits for, since when, until when, whom it dials
    id: int = 0
    waiting: str = ""
    sent_at: float = 0.0
    deadline: float = 0.0
    peer_addrs: tuple[str, ...] = ()
    rtt: float | None = None
    _last: str = "timeout"

    def __post_init__(self) -> None:
        if self.role not in ("n", "a"):
            raise ValueError("role must be 'n' or 'a'")

    @property
    def done(self) -> bool:
        return self.state != "punching"

    def view(self) -> dict[str, Any]:
        return {"state": self.state, "attempts": self.attempts, "reason": self.reason}

    def end(self, reason: str | None) -> list[Effect]:
        """End the punch: direct (None) or failed with `reason`."""
        self.state, self.reason, self.waiting = ("direct", None, "") if reason is None else ("failed", reason, "")
        return [Done(reason is None, reason)]

    def _offer(self, pid: int, addrs: Sequence[str], reason: str | None) -> Send:
        return Send("punch", {"id": pid, "addrs": list(addrs)} if reason is None
                    else {"id": pid, "addrs": [], "reason": reason})

    # -- N ----------------------------------------------------------------------------------

    def attempt(self, now: float, addrs: Sequence[str], reason: str | None = None) -> list[Effect]:
        """N starts an attempt with the addresses of its freshly bound port, or says why it
        cannot (`no_public_address`, `not_port_preserving`): then the peer is told and
        nobody dials."""
        assert self.role == "n" and not self.done and not self.waiting
        self.id, self.next_id = self.next_id, self.next_id + 1
        self.attempts += 1
        if reason is not None:
            return [self._offer(self.id, (), reason), *self.end(reason)]
        self.waiting, self.sent_at, self.deadline = "answer", now, now + self.limits.answer_seconds
        return [self._offer(self.id, addrs, None)]

    def answered(self, now: float, frame: PunchFrame, addrs: Sequence[str]) -> list[Effect]:
        """A's answer (`addrs`: what of it `vet_addrs` kept): sync, and dial in RTT/2."""
        if self.role != "n" or self.waiting != "answer" or frame.id != self.id:
            return []  # late, or another attempt's: ignored
        if frame.reason is not None:
            return self.end(frame.reason)
        if not addrs:
            return self.end("refused")
        self.rtt = max(0.0, now - self.sent_at)
        at = now + self.rtt / 2
        self.waiting, self.peer_addrs, self.deadline = "dial", tuple(addrs), at + self.limits.dial_seconds
        return [Send("punch_sync", {"id": self.id}), Dial(at, self.deadline, self.peer_addrs)]

    # -- A ----------------------------------------------------------------------------------

    def requested(self, now: float, frame: PunchFrame, addrs: Sequence[str], own: Sequence[str],
                  own_reason: str | None = None) -> list[Effect]:
        """N's `punch` (`addrs`: what `vet_addrs` kept of it): answer with our addresses
        `own` (or why we cannot) and wait for the sync. A new id starts a new attempt."""
        assert self.role == "a" and not self.done
        if frame.id == self.id and self.attempts:
            return []  # a duplicate
        self.id, self.waiting = frame.id, ""
        self.attempts += 1
        if frame.reason is not None:  # N cannot: nothing is dialled
            return self.end(frame.reason)
        if not addrs:
            return [self._offer(frame.id, (), "refused"), *self.end("refused")]
        if own_reason is not None:
            return [self._offer(frame.id, (), own_reason), *self.end(own_reason)]
        self.waiting, self.deadline, self.peer_addrs = "sync", now + self.limits.answer_seconds, tuple(addrs)
        return [self._offer(frame.id, own, None)]

    def synced(self, now: float, frame: PunchFrame) -> list[Effect]:
        """N's sync: dial now."""
        if self.role != "a" or self.waiting != "sync" or frame.id != self.id:
            return []
        self.waiting, self.deadline = "dial", now + self.limits.dial_seconds
        return [Dial(now, self.deadline, self.peer_addrs)]

    # -- both -------------------------------------------------------------------------------

    def dialled(self, now: float, ok: bool, reason: str = "timeout") -> list[Effect]:
        """The dial of this attempt ended: a stream (the punch is direct), or `reason`
        ("timeout": nothing answered; "refused": every SYN was answered by a reset)."""
        if self.waiting != "dial":
            return []
        if ok:
            return self.end(None)
        self._last = reason if reason in REASONS else "timeout"
        return self._failed_attempt(now)

    def tick(self, now: float) -> list[Effect]:
        """Deadlines: an answer or a sync that did not come in time fails the attempt; A
        left waiting for N's next attempt too long ends the punch (a dial is ended by its
        driver at `Dial.until`)."""
        if self.waiting in ("answer", "sync") and now >= self.deadline:
            self._last = "timeout"
            return self._failed_attempt(now)
        if self.waiting == "next" and now >= self.deadline:
            return self.end(self._last)
        return []

    def _failed_attempt(self, now: float) -> list[Effect]:
        self.waiting = ""
        if self.attempts >= self.limits.attempts:
            return self.end(self._last)
        if self.role == "n":
            return [Retry(now + self.limits.pause_seconds)]
        # A: N starts the next attempt; if none comes in time, the punch has failed
        self.waiting, self.deadline = "next", now + self.limits.pause_seconds + self.limits.answer_seconds
        return []


# -- rate limits --------------------------------------------------------------------------------


@dataclass
class PunchGate:
    """Who may punch now: per peer (`peer_punches` per `peer_window_seconds`, both roles),
    node-wide (`per_minute` attempts) and at once (`concurrent`). The per-peer buckets are
    bounded (the least recently used one goes)."""

    limits: PunchLimits
    max_peers: int = 4096
    running: set[str] = field(default_factory=set)
    _peers: OrderedDict[str, TokenBucket] = field(default_factory=OrderedDict)
    _node: TokenBucket | None = None

    def start(self, did: str, now: float) -> str | None:
        """Take a punch with `did` (None: go) or the reason not to ("busy", "rate_limited")."""
        lim = self.limits
        if did in self.running or len(self.running) >= lim.concurrent:
            return "busy"
        bucket = self._peers.pop(did, None) or TokenBucket(lim.peer_punches / lim.peer_window_seconds,
                                                          lim.peer_punches)
        self._peers[did] = bucket
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        if not bucket.take(now):
            return "rate_limited"
        if not self.attempt(now):
            bucket.tokens += 1  # not used: the node-wide limit refused it
            return "rate_limited"
        self.running.add(did)
        return None

    def attempt(self, now: float) -> bool:
        """One attempt node-wide (a punch's first, and each retry)."""
        if self._node is None:
            self._node = TokenBucket(self.limits.per_minute / 60.0, self.limits.per_minute)
        return self._node.take(now)

    def ended(self, did: str) -> None:
        self.running.discard(did)
