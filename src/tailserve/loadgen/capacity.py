"""SLO capacity search: the highest offered rate whose p99 stays under the SLO with no errors.

A pure object: it proposes a rate, is told how that step went, and proposes the next. It doubles
the rate until a step fails, then bisects between the best pass and the first failure until they
are within ``precision`` of each other. A step fails on a p99 over the SLO, on any error, or when
the server completes clearly fewer requests than were offered (it is falling behind, and a
longer step would show the queue growing without bound), or when the generator could not keep
its own schedule.

A failure counts only once confirmed: the rate is run again, and only a second failure stops
the search going higher. One stall of the machine (another process, a page-cache flush) spoils
a step's p99 by itself, and on a small shared machine the search otherwise stopped at whatever
rate a stall happened to fall in (the same configuration found 1,938 and 4,000 req/s in two
runs). A server past its capacity fails both tries. A clear overload (under ``clear_overload``
of the offered rate completed) and a generator behind its schedule are not tried again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Step:
    offered_rps: float
    achieved_rps: float
    p99_ms: float
    errors: int
    behind: bool = False  # the generator fell behind its schedule

    @classmethod
    def of(cls, rate: float, result: dict[str, Any]) -> Step:
        """The step a run at ``rate`` made: from its result document (`loadgen.bench`)."""
        overall = result["overall"]
        return cls(
            rate,
            overall["achieved_rps"],
            overall["p99_ms"] or 0.0,
            overall["errors"],
            behind=bool(result["generator"]["behind"]),
        )

    def passes(self, slo_ms: float, min_achieved: float) -> bool:
        return (
            self.errors == 0
            and not self.behind
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
    max_steps: int = 24
    confirm: bool = True
    clear_overload: float = 0.8
    steps: list[Step] = field(default_factory=list)
    best: float | None = None
    _failed_at: float | None = None
    _retry: float | None = None
    _retried: set[float] = field(default_factory=set)

    def next_rate(self) -> float | None:
        """The next rate to try, or None when the search has converged (or given up)."""
        if len(self.steps) >= self.max_steps:
            return None
        if self._retry is not None:
            rate, self._retry = self._retry, None
            return rate
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
        rate = step.offered_rps
        if step.passes(self.slo_ms, self.min_achieved):
            if self.best is None or rate > self.best:
                self.best = rate
            return
        if self.confirm and rate not in self._retried and not self._clear_failure(step):
            self._retried.add(rate)
            self._retry = rate
            return
        if self._failed_at is None or rate < self._failed_at:
            self._failed_at = rate

    def _clear_failure(self, step: Step) -> bool:
        return step.behind or step.achieved_rps < self.clear_overload * step.offered_rps

    @property
    def capacity_rps(self) -> float | None:
        return self.best
