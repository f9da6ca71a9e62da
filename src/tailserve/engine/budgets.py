"""A pipeline's time: each step's share of the request's deadline, and how many rows fit it.

Pure: times are seconds on the caller's clock, costs come as a function of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Allotment:
    """The time one step may take: it plans its work to ``plan`` (its budget, or less when
    behind schedule) and is given up on at ``deadline`` (its share of all the time left, more
    than its budget when the request has time to spare)."""

    deadline: float
    plan: float
    # The step's share over its declared budget (1 or more: on schedule, the request's spare
    # time shared out too; below: the steps before it ran late, or the request came with less
    # time than the budgets add up to).
    ratio: float

    @property
    def behind(self) -> bool:
        return self.ratio < _ON_SCHEDULE


# A step whose share is this close to its budget is on schedule (clock noise is not lateness).
_ON_SCHEDULE = 0.98


def allot(budgets: Sequence[float], index: int, now: float, deadline: float) -> Allotment:
    """Step ``index``'s share of the time left: the budgets of the steps still to run are
    weights, and the time left is shared out by them. A request with time to spare lets each
    step run past its budget before it is given up on (cut off at its budget while the request
    had time, it would degrade for nothing); one behind schedule gives each less. A step with
    no budget (0) may use whatever is left."""
    budget = budgets[index]
    if budget <= 0:
        return Allotment(deadline, deadline, 1.0)
    planned = sum(budgets[index:])
    left = max(0.0, deadline - now)
    scale = left / planned
    # Work is sized to the budget, never to the spare time: under load, spare time stretched
    # into every step would let each do more and the worker serve fewer.
    end = min(deadline, now + budget * scale)
    return Allotment(end, min(end, now + budget), scale)


def rows_that_fit(rows: int, least: int, seconds: float, cost: Callable[[int], float]) -> int:
    """The most rows, at least ``least`` and at most ``rows``, whose ``cost`` fits in
    ``seconds`` (``least`` when none does). Costs grow with rows, so a bisection finds it."""
    if rows <= least or cost(rows) <= seconds:
        return rows
    low, high = least, rows  # cost(high) does not fit; low fits or is the floor
    while high - low > 1:
        middle = (low + high) // 2
        if cost(middle) <= seconds:
            low = middle
        else:
            high = middle
    return low


def proportional_rows(rows: int, least: int, ratio: float) -> int:
    """Rows in proportion to a step's share of its budget (for a step with no cost model)."""
    return max(min(least, rows), min(rows, int(rows * ratio)))
