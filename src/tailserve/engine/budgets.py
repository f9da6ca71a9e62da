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


def critical_paths(budgets: Sequence[float], waits: Sequence[Sequence[int]]) -> list[float]:
    """For each step, the most budget on any path from it to the end (itself included): what
    the time left must cover once it starts. Steps are in an order where each waits only for
    steps before it (``waits[i]``), so one pass from the end finds every path."""
    after: list[list[int]] = [[] for _ in budgets]
    for index, earlier in enumerate(waits):
        for j in earlier:
            after[j].append(index)
    paths = [0.0] * len(budgets)
    for index in reversed(range(len(budgets))):
        paths[index] = budgets[index] + max((paths[j] for j in after[index]), default=0.0)
    return paths


def allot(budgets: Sequence[float], index: int, now: float, deadline: float) -> Allotment:
    """`allot_step` for a chain of steps (each waits for the one before)."""
    return allot_step(budgets[index], sum(budgets[index:]), now, deadline)


def allot_step(budget: float, planned: float, now: float, deadline: float) -> Allotment:
    """A step's share of the time left, ``budget`` of the ``planned`` budgets still to run on
    its longest path to the end: the budgets are weights, and the time left is shared out by
    them. A request with time to spare lets each step run past its budget before it is given up
    on (cut off at its budget while the request had time, it would degrade for nothing); one
    behind schedule gives each less. A step with no budget (0) may use whatever is left."""
    if budget <= 0 or planned <= 0:
        return Allotment(deadline, deadline, 1.0)
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
