"""Rate limits, strikes and bans for peers, sans-IO (time is passed in, in seconds).

A peer spends tokens for every frame and every container it sends. Every
protocol violation and every refused container adds strikes; at the
threshold the connection is cut and the peer's DID and IP address are
ignored for `ban_seconds`. Honest peers never come near it: a rejection of
one container costs one strike, a broken frame or MCE message five.

A DID costs milliseconds of proof of work, so a ban of a DID alone is evaded
with a fresh one: `DidChurn` counts the distinct DIDs each address presented
within a window, and the mesh bans an address that keeps minting them. A key
banned again soon after its last ban ends is banned for longer (doubling, up
to `max_factor` times the ban length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hmpnode.container import inflight

__all__ = ["TokenBucket", "Strikes", "BanList", "DidChurn", "STRIKE_COST", "NOT_OFFENCES"]

#: strikes per offence
STRIKE_COST = {
    "rejected_container": 1,
    "not_addressed": 1,
    "rate_limited": 2,
    "malformed_frame": 5,
    "too_many_items": 5,
    "bad_mce": 5,
    "frame_too_large": 10,
}


#: refusals that cost no strikes: freshness (a clock off, on either side, is no
#: misbehaviour: a ban for it would outlast the clock's repair) and a relay's own
#: limits and size budgets (the sender cannot know them; another node may allow more),
#: and this node's full disk; they are counted,
#: the container is refused
NOT_OFFENCES = frozenset({"expired", "future_timestamp", "clock_skew", "relay_full", "relay_quota_exceeded",
                          "relay_sender_quota", "relay_unknown_recipient", "storage_full",
                          "forgotten",  # our agent forgot it: local policy, not the peer's fault
                          *inflight.REASONS})


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; starts full. The one token
    bucket of the mesh: peer frames and containers, LAN discovery, the DHT's request budget."""

    rate: float
    burst: float
    tokens: float = 0.0
    at: float | None = None  # when last used; None: never (full)

    def take(self, now: float, amount: float = 1.0, *, force: bool = False) -> bool:
        """Refill for the time elapsed (time going backwards refills nothing), then take
        `amount`: False, with nothing taken, when short of it, unless `force` (a debit
        into the negative, for work already decided)."""
        if self.at is None:
            self.tokens = self.burst
        elif now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < amount and not force:
            return False
        self.tokens -= amount
        return True


@dataclass(slots=True)
class Strikes:
    """Strikes of one peer; they decay by `forgive_per_second`."""

    threshold: int
    forgive_per_second: float = 0.1
    count: float = 0.0
    at: float = 0.0
    by_reason: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str, now: float, times: int = 1) -> bool:
        """Record an offence; True when the peer has now crossed the threshold."""
        self.count = max(0.0, self.count - (now - self.at) * self.forgive_per_second)
        self.at = now
        self.count += STRIKE_COST.get(reason, 1) * times
        self.by_reason[reason] = self.by_reason.get(reason, 0) + times
        return self.count >= self.threshold


@dataclass(slots=True)
class BanList:
    """DIDs and IP addresses ignored until a time; bounded (oldest bans fall off).

    A key banned again within `memory` ban lengths of its previous ban's end is
    a repeat offender: each such ban lasts twice the previous one, at most
    `max_factor` times `seconds`."""

    seconds: float
    max_entries: int = 10_000
    max_factor: int = 8
    memory: float = 4.0
    until: dict[str, float] = field(default_factory=dict)
    #: key -> (factor of its last ban, when that ban ended or ends)
    history: dict[str, tuple[int, float]] = field(default_factory=dict)

    def ban(self, key: str, now: float, seconds: float | None = None) -> float:
        """Ignore `key` from `now` for `seconds`, or by default for the list's ban
        length (times the repeat factor); returns the length used."""
        if seconds is None:
            factor, ended = self.history.get(key, (0, float("-inf")))
            factor = min(self.max_factor, factor * 2) if factor and now - ended <= self.memory * self.seconds else 1
            seconds = self.seconds * factor
            self.history[key] = (factor, now + seconds)
            if len(self.history) > self.max_entries:
                for old in sorted(self.history, key=lambda k: self.history[k][1])[: len(self.history) - self.max_entries]:
                    del self.history[old]
        self.until[key] = max(self.until.get(key, now), now + seconds)
        if len(self.until) > self.max_entries:
            for old in sorted(self.until, key=self.until.__getitem__)[: len(self.until) - self.max_entries]:
                del self.until[old]
        return seconds

    def banned(self, key: str | None, now: float) -> bool:
        if key is None:
            return False
        until = self.until.get(key)
        if until is None:
            return False
        if until <= now:
            del self.until[key]
            return False
        return True


@dataclass(slots=True)
class DidChurn:
    """Distinct DIDs each address presented within the last `window` seconds.

    A DID costs milliseconds of proof of work; an honest address shows a few DIDs
    (one per node behind it) and shows them again. Bounded: at most `limit` + 1
    DIDs kept per address and `max_addresses` addresses (least recently seen go)."""

    limit: int
    window: float
    max_addresses: int = 4096
    seen: dict[str, dict[str, float]] = field(default_factory=dict)

    def note(self, address: str, did: str, now: float) -> int:
        """`address` presented `did` at `now`: the distinct DIDs it presented within the window."""
        dids = self.seen.pop(address, None) or {}
        self.seen[address] = dids  # most recently seen address last
        for old in [d for d, t in dids.items() if t <= now - self.window]:
            del dids[old]
        dids.pop(did, None)
        dids[did] = now
        while len(dids) > self.limit + 1:
            del dids[next(iter(dids))]
        while len(self.seen) > self.max_addresses:
            del self.seen[next(iter(self.seen))]
        return len(dids)

    def over(self, address: str, did: str, now: float) -> bool:
        """Note `did` and say whether `address` presented more than `limit` DIDs within the window."""
        return self.note(address, did, now) > self.limit

    def forget(self, address: str) -> None:
        self.seen.pop(address, None)
