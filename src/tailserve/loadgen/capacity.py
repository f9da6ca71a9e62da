"""SLO capacity search: the highest offered rate whose p99 stays under the SLO with no errors.

A pure object: it proposes a rate, is told how that step went, and proposes the next. It doubles
the rate until a step fails, then bisects between the best pass and the first failure until they
are within ``precision`` of each other. A step fails on a p99 over the SLO, on any error, or when
the server completes clearly fewer requests than were offered (it is falling behind, and a
longer step would show the queue growing without bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Step:
    offered_rps: float
    achieved_rps: float
    p99_ms: float
    errors: int

    def passes(self, slo_ms: float, min_achieved: float) -> bool:
        return (
            self.errors == 0
            and self.p99_ms <= slo_ms
            and self.achieved_rps >= min_achieved * self.offered_rps
        )


@dataclass(slots=True)
class CapacitySearch:
    slo_ms: float
    start_rps: float = 50.0
    max_rps: float = 100_000.0
    precision: float = 0.05
    min_achieved: float = 0.95
    max_steps: int = 16
    steps: list[Step] = field(default_factory=list)
    best: float | None = None
    _failed_at: float | None = None

    def next_rate(self) -> float | None:
        """The next rate to try, or None when the search has converged (or given up)."""
        if len(self.steps) >= self.max_steps:
            return None
        if not self.steps:
            return self.start_rps
        if self._failed_at is None:
            rate = (self.best or self.start_rps) * 2
            return rate if rate <= self.max_rps else None
        low = self.best if self.best is not None else 0.0
        high = self._failed_at
        if low == 0.0 and high <= self.start_rps / 16:
            return None  # fails even at a trickle: there is no capacity to find
        if high - low <= self.precision * max(low, 1.0):
            return None
        return (low + high) / 2

    def record(self, step: Step) -> None:
        self.steps.append(step)
        if step.passes(self.slo_ms, self.min_achieved):
            if self.best is None or step.offered_rps > self.best:
                self.best = step.offered_rps
        elif self._failed_at is None or step.offered_rps < self._failed_at:
            self._failed_at = step.offered_rps

    @property
    def capacity_rps(self) -> float | None:
        return self.best
