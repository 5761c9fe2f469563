"""A per-agent trust figure from evaluations (HMP §6.9.3, a local trust model).

Pure: the node passes, for one agent A, one row per *other* agent E that
evaluated A's containers: (E, mean of E's active evaluation values over A's
containers, how many). The figure is

    trust(A) = 0.5 + 0.5 * sum(clamp(mean_E, -1, 1)) / (n + damping)

* bounded: strictly inside (0, 1) for damping > 0; 0.5 is "no evidence";
* one evaluator counts once per target, whatever the number of containers or
  evaluations it spreads its opinion over (a flood moves nothing more than
  one evaluation would): each evaluator's contribution is capped at 1;
* evaluations of one's own containers are ignored (an agent cannot raise its
  own figure);
* damping: `damping` phantom neutral evaluators, so a handful of evaluators
  cannot move a figure far (with damping 3, one glowing evaluator gives 0.625).

Not covered (docs/protocol.md "Trust"): many agents (Sybils) each evaluating
once; evaluator figures are not themselves weighted by trust.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["NEUTRAL", "TrustFigure", "trust_figure"]

NEUTRAL = 0.5


@dataclass(frozen=True, slots=True)
class TrustFigure:
    agent: str
    trust: float
    evaluators: int
    evaluations: int
    damping: float

    def to_json(self) -> dict[str, object]:
        return {"agent_did": self.agent, "trust": round(self.trust, 6), "evaluators": self.evaluators,
                "evaluations": self.evaluations, "damping": self.damping}


def trust_figure(agent: str, rows: Iterable[tuple[str, float, int]], *, damping: float = 3.0) -> TrustFigure:
    """`rows`: (evaluator, mean value, count) over `agent`'s containers."""
    if not damping > 0:
        raise ValueError("damping must be > 0")
    total, n, evaluations = 0.0, 0, 0
    seen: set[str] = set()
    for evaluator, mean, count in rows:
        if evaluator == agent or evaluator in seen or not math.isfinite(mean):
            continue
        seen.add(evaluator)
        total += min(1.0, max(-1.0, mean))
        n += 1
        evaluations += max(0, int(count))
    return TrustFigure(agent, NEUTRAL + NEUTRAL * total / (n + damping), n, evaluations, damping)
