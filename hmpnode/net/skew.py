"""How far each peer's clock is from ours, from the timestamps of what it signs (sans-IO).

Every signed message a peer sends (its handshake announce, each MCE message) is
made with its clock just before it is sent: its timestamp minus our clock when
it arrives is one reading of the peer's offset (plus the transit time, which
is small against the windows it is compared with). The estimate is the median
of the last few readings, so one delayed frame does not move it. Readings are
only taken from messages whose signature verified (as of their own time, for
one from the future). The estimates are for operators (`status`, /metrics):
no decision depends on them (docs/protocol.md 25.4).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from statistics import median

__all__ = ["SkewEstimates"]


class SkewEstimates:
    """Per peer DID: the last `samples` offsets in seconds (their clock minus ours);
    at most `max_peers` peers (the least recently heard from fall off)."""

    def __init__(self, samples: int = 9, max_peers: int = 1024):
        self._samples = samples
        self._max_peers = max_peers
        self._peers: OrderedDict[str, deque[float]] = OrderedDict()

    def add(self, did: str, offset_seconds: float, *, jump: bool = False) -> None:
        """One reading; `jump`: it was refused as beyond a window, so the clock moved and the
        earlier readings are history (the estimate is this reading until more come)."""
        readings = self._peers.pop(did, None)
        if readings is None or jump:
            readings = deque(maxlen=self._samples)
        readings.append(float(offset_seconds))
        self._peers[did] = readings
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)

    def of(self, did: str) -> float | None:
        readings = self._peers.get(did)
        return median(readings) if readings else None

    def view(self) -> dict[str, float]:
        """DID -> estimated offset in seconds (rounded to ms)."""
        return {did: round(median(r), 3) for did, r in self._peers.items()}

    def max_abs(self) -> float:
        """The largest estimated offset, in absolute value (0 with no readings)."""
        return max((abs(median(r)) for r in self._peers.values()), default=0.0)
