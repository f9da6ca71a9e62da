"""Who gets the next hedge token: the requests whose hedge came due while the budget was short.

They wait in two queues, oldest first. Those on a *suspect* replica (one that keeps losing to
hedges) found no token at all: they take the next token, before the others, without waiting to
be overdue. The others take one only once the rationing lets them (`HedgePolicy.
may_hedge_late`: once they have had no reply for the recent p99). A request answered
meanwhile, or out of time, leaves its queue when it comes to the head. Each queue is bounded;
a request that finds its queue full of live requests gets no hedge.

Pure: no I/O and no clock; the time is passed in, and whoever owns the queue calls `release`
as tokens are earned and as queued requests turn overdue (hedging.py: rationing).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from tailserve.router.hedging import HedgeBudget

# The most requests waiting for a hedge token, in each queue.
LIMIT = 1024


class Waiter(Protocol):
    """A request queued for a hedge token (what the queue asks of an `Exchange`)."""

    def awaits_hedge(self, now: float) -> bool:
        """Whether it still wants a hedge: unanswered, only its first copy out, time left."""
        ...

    def may_hedge_late(self, now: float) -> bool:
        """Whether the rationing lets it take a token now."""
        ...

    def send_hedge(self, *, late: bool = False) -> None:
        """Send the copy its spent token paid for."""
        ...


class HedgeQueue:
    __slots__ = ("_budget", "_healthy", "_limit", "_suspect")

    def __init__(self, budget: HedgeBudget, *, limit: int = LIMIT) -> None:
        self._budget = budget
        self._limit = limit
        self._healthy: deque[Waiter] = deque()
        self._suspect: deque[Waiter] = deque()

    def waiting(self, now: float) -> int:
        """Requests that want a token now (the queues also hold ones answered since, dropped
        as the queues are next served)."""
        return sum(1 for q in (self._suspect, self._healthy) for w in q if w.awaits_hedge(now))

    def defer(self, waiter: Waiter, now: float, *, suspect: bool = False) -> bool:
        """Queue ``waiter`` for a token; False when its queue is full of requests that still
        want one (it is dropped: already counted as refused)."""
        queue = self._suspect if suspect else self._healthy
        if len(queue) >= self._limit:
            live = [w for w in queue if w.awaits_hedge(now)]
            queue.clear()
            queue.extend(live)
            if len(queue) >= self._limit:
                return False
        queue.append(waiter)
        return True

    def release(self, now: float) -> None:
        """Hand the tokens there are to the requests that have waited longest for one, as far
        as the rationing lets them."""
        budget = self._budget
        suspects = self._suspect
        while suspects:
            head = suspects[0]
            if not head.awaits_hedge(now):
                suspects.popleft()
            elif budget.ready and budget.try_spend():
                suspects.popleft()
                head.send_hedge(late=True)
            else:
                return  # no token: none for the queue below either
        queue = self._healthy
        while queue:
            head = queue[0]
            if not head.awaits_hedge(now):
                queue.popleft()  # answered meanwhile
            elif head.may_hedge_late(now) and budget.try_spend():
                queue.popleft()
                head.send_hedge(late=True)
            else:
                return
