"""May a relay hold one more directed container? (sans-IO; docs/protocol.md 24.1)

Recipient DIDs, and sender DIDs, cost an attacker next to nothing, so quotas
per recipient alone let one peer fill a relay's store by addressing
containers to made-up recipients. A relay therefore also bounds what it holds
on behalf of each sending peer (its DID, and its address unless the
connection is a loopback one, where every node of the host shares one
address), and all holdings for recipients it never heard of (no announce, no
contact) together, node-wide, in a small pool; and it holds nothing longer
than `max_hold_seconds`.

Every figure counts holdings (one per recipient a container is held for) and
their size (the container's size once per holding), the way the store keeps
them. `admit` is given the usage read from the store before a batch and
charges what it admits, so a batch is checked against itself too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RelayLimits", "RelayUsage", "admit", "hold_until_us", "REASONS"]

#: refusal reasons, in the order they are checked (docs/protocol.md 25.1)
REASONS = ("relay_full", "relay_sender_quota", "relay_unknown_recipient", "relay_quota_exceeded")


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """The relay's quotas and longest hold, declared here only ([relay]; built once by
    hmpnode.config.RelaySettings.relay_limits)."""

    max_per_recipient: int = 100_000
    max_bytes_per_recipient: int = 256 * 1024 * 1024
    max_total_bytes: int = 2 * 1024 * 1024 * 1024
    #: holdings and bytes on behalf of one sending peer (DID), and of one address
    max_per_sender: int = 100_000
    max_bytes_per_sender: int = 256 * 1024 * 1024
    max_bytes_per_address: int = 512 * 1024 * 1024
    #: all holdings for recipients the relay never heard of, together
    max_unknown_bytes: int = 32 * 1024 * 1024
    max_hold_seconds: int = 7 * 86_400


@dataclass(slots=True)
class RelayUsage:
    """Holdings as [count, bytes]: in all, per recipient, per sender DID, per
    sender address, and for unknown recipients. Keys missing from a map count as
    nothing held."""

    total: list[int] = field(default_factory=lambda: [0, 0])
    unknown: list[int] = field(default_factory=lambda: [0, 0])
    recipients: dict[str, list[int]] = field(default_factory=dict)
    senders: dict[str, list[int]] = field(default_factory=dict)
    addresses: dict[str, list[int]] = field(default_factory=dict)


def _get(table: dict[str, list[int]], key: str) -> list[int]:
    got = table.get(key)
    if got is None:
        got = table[key] = [0, 0]
    return got


def admit(limits: RelayLimits, usage: RelayUsage, *, sender: str, address: str | None,
          recipients: list[str], unknown: set[str], size: int) -> str | None:
    """None when the relay may hold a container of `size` bytes from the peer
    `sender` (connected from `address`; None: not counted by address) for
    `recipients` (`unknown`: those it never heard of); `usage` is charged.
    Otherwise the refusal reason, and `usage` is unchanged."""
    n = len(recipients)
    if n == 0:
        return None
    add = size * n
    if usage.total[1] + add > limits.max_total_bytes:
        return "relay_full"
    by_sender = _get(usage.senders, sender)
    if by_sender[0] + n > limits.max_per_sender or by_sender[1] + add > limits.max_bytes_per_sender:
        return "relay_sender_quota"
    by_address = _get(usage.addresses, address) if address is not None else None
    if by_address is not None and by_address[1] + add > limits.max_bytes_per_address:
        return "relay_sender_quota"
    strangers = [r for r in recipients if r in unknown]
    if strangers and usage.unknown[1] + size * len(strangers) > limits.max_unknown_bytes:
        return "relay_unknown_recipient"
    for r in recipients:
        count, used = usage.recipients.get(r, (0, 0))
        if count + 1 > limits.max_per_recipient or used + size > limits.max_bytes_per_recipient:
            return "relay_quota_exceeded"
    for row, k in ((usage.total, n), (by_sender, n), (by_address, n), (usage.unknown, len(strangers))):
        if row is not None:
            row[0] += k
            row[1] += size * k
    for r in recipients:
        row = _get(usage.recipients, r)
        row[0] += 1
        row[1] += size
    return None


def hold_until_us(now_us: int, ttl_us: int | None, max_hold_seconds: int) -> int:
    """When a holding made at `now_us` ends: at the container's ttl, at most
    `max_hold_seconds` later (a container without ttl is not held forever)."""
    limit = now_us + max_hold_seconds * 1_000_000
    return limit if ttl_us is None else min(ttl_us, limit)
