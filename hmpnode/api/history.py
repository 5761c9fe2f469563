"""The last hour of the node's numbers, kept in memory for the dashboard's charts (`GET /v1/history`).

Sans-IO: `History.record(now, sample)` takes the time (monotonic seconds) and a
`Sample` read from the counters /metrics uses (hmpnode.api.app reads them every
`api.history_interval_ms` and calls it); `view(now)` gives the series.

Bounded whatever runs: at most `MAX_POINTS` points (an hour at the default 5 s;
a shorter interval keeps a shorter window, never more points), each with the
fixed series of `RATES` and `GAUGES` and at most `TOP_REASONS` refusal reasons
plus "other". Rates come from counter deltas between two samples; a counter
that went down was reset, and its new value is what happened since.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["History", "Sample", "MAX_POINTS", "TOP_REASONS", "RATES", "GAUGES", "OTHER"]

#: points kept: 720 x 5 s = one hour at the default interval
MAX_POINTS = 720
#: refusal reasons with a series of their own (each point keeps its busiest ones; the
#: view shows the busiest of the window); the rest add up in OTHER
TOP_REASONS = 6
OTHER = "other"
#: counters shown as a rate per second
RATES = ("containers_in", "containers_out")
#: values shown as read
GAUGES = ("peers_connected", "relay_held", "outbox_held", "loop_lag_seconds")


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading: `counters` cumulative (for RATES), `gauges` as they are (GAUGES), and the
    cumulative refusals by "area/reason"."""

    counters: Mapping[str, int]
    gauges: Mapping[str, float]
    refusals: Mapping[str, int] = field(default_factory=dict)


def _increase(now: int, before: int) -> int:
    """How much a counter grew; one that went down was reset and counts from zero."""
    return now - before if now >= before else now


class History:
    """A ring of points, one per `record` (the module docstring)."""

    def __init__(self, interval: float, *, points: int = MAX_POINTS, top: int = TOP_REASONS) -> None:
        if interval <= 0 or points < 1 or top < 0:
            raise ValueError("interval > 0, points >= 1 and top >= 0")
        self.interval, self.top = interval, top
        #: (time, {series: value or None}, {reason: per second})
        self.points: deque[tuple[float, dict[str, float | None], dict[str, float]]] = deque(maxlen=points)
        self._last: tuple[float, Mapping[str, int], Mapping[str, int]] | None = None

    def record(self, now: float, sample: Sample) -> None:
        """Add a point: the gauges, and the rates since the previous sample (None for the first,
        or after time stood still or went back: nothing to divide by)."""
        last, self._last = self._last, (now, dict(sample.counters), dict(sample.refusals))
        values: dict[str, float | None] = {name: float(sample.gauges.get(name, 0)) for name in GAUGES}
        reasons: dict[str, float] = {}
        if last is None or now <= last[0]:
            values.update(dict.fromkeys(RATES))
        else:
            seconds = now - last[0]
            for name in RATES:
                values[name] = _increase(sample.counters.get(name, 0), last[1].get(name, 0)) / seconds
            grown = {r: _increase(n, last[2].get(r, 0)) / seconds for r, n in sample.refusals.items()}
            busiest = sorted((r for r, v in grown.items() if v > 0), key=lambda r: (-grown[r], r))
            reasons = {r: grown[r] for r in busiest[:self.top]}
            rest = sum(grown[r] for r in busiest[self.top:])
            if rest:
                reasons[OTHER] = reasons.get(OTHER, 0.0) + rest
        self.points.append((now, values, reasons))

    def view(self, now: float) -> dict[str, Any]:
        """The series, oldest first: `ago_seconds` of each point, a list per series, and the
        refusals per second of the window's busiest reasons (the others in "other")."""
        totals: dict[str, float] = {}
        for _, _, reasons in self.points:
            for r, v in reasons.items():
                totals[r] = totals.get(r, 0.0) + v
        named = sorted((r for r in totals if r != OTHER), key=lambda r: (-totals[r], r))[:self.top]
        refusals: dict[str, list[float]] = {r: [] for r in named}
        if len(totals) > len(named):
            refusals[OTHER] = []
        for _, _, reasons in self.points:
            for r in refusals:
                if r != OTHER:
                    refusals[r].append(round(reasons.get(r, 0.0), 6))
            if OTHER in refusals:
                refusals[OTHER].append(round(sum(v for r, v in reasons.items() if r not in named), 6))
        return {
            "interval_seconds": self.interval,
            "max_points": self.points.maxlen,
            "window_seconds": self.interval * (self.points.maxlen or 0),
            "ago_seconds": [round(now - t, 3) for t, _, _ in self.points],
            "series": {name: [None if p[1][name] is None else round(p[1][name], 6) for p in self.points]
                       for name in (*RATES, *GAUGES)},
            "refusals_per_second": refusals,
        }
