"""The background lane of a model: work that runs only in the time online requests leave free.

Jobs (`tailserve.jobs`) are inferred here, never through the batcher's own queues: a queued
job would count in an online request's admission and could share its batch. A batch from this
lane goes to an instance only when the batcher holds no online request and the instance is
idle, and it is cut to what the cost model predicts to take at most ``budget_s``: an online
request that arrives just after it starts waits at most that long, a share of what its SLO
leaves for queueing (``jobs.budget_share`` of the model's SLO times its admission target).

A single piece predicted to take longer than the budget (a model whose one row is slow) runs
only while another instance stays idle for online requests, or, on a model of one instance,
once the batcher is empty: it cannot be cut finer, and it would otherwise never run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tailserve.engine.batching import Item
from tailserve.engine.buckets import Bucket
from tailserve.errors import Overloaded

# Jobs' pieces waiting at once in one model's lane (the job runner holds a few jobs at a
# time, so this is a guard, not a queue to fill).
MAX_WAITING = 4096

Predict = Callable[[Bucket, int], float]


class BackgroundLane:
    def __init__(self, *, budget_s: float, max_rows: int, max_waiting: int = MAX_WAITING):
        self.budget_s = budget_s
        self.max_rows = max(1, max_rows)
        self._max_waiting = max_waiting
        self._waiting: deque[Item] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, item: Item) -> None:
        if len(self._waiting) >= self._max_waiting:
            raise Overloaded(
                f"the background lane holds {len(self._waiting)} pieces of jobs", retry_after_s=1.0
            )
        self._waiting.append(item)

    def take(self, predict: Predict, *, idle_others: int, instances: int) -> list[Item]:
        """The next batch for an idle instance, while the batcher holds no online request:
        head-of-lane pieces of one class, as many as fit the budget (at least one that fits it
        alone, else see the module's docstring). [] : none may go now."""
        waiting = self._waiting
        while waiting and waiting[0].payload.future.done():
            waiting.popleft()  # its job gave up (cancelled, or the worker is stopping)
        if not waiting:
            return []
        head = waiting[0]
        if predict(head.bucket, head.rows) > self.budget_s and instances > 1 and not idle_others:
            return []
        batch = [waiting.popleft()]
        rows = head.rows
        while waiting and waiting[0].bucket == head.bucket:
            more = waiting[0].rows
            if rows + more > self.max_rows or predict(head.bucket, rows + more) > self.budget_s:
                break
            batch.append(waiting.popleft())
            rows += more
        return batch

    def rows_that_fit(self, predict: Callable[[int], float], rows: int) -> int:
        """The most rows of a job's request (of ``rows``) one piece may hold: the cost model's
        prediction within the budget, at least one."""
        low, high = 1, min(rows, self.max_rows)
        if predict(high) <= self.budget_s:
            return high
        while low < high:  # the largest count that fits (the prediction grows with rows)
            middle = (low + high + 1) // 2
            if predict(middle) <= self.budget_s:
                low = middle
            else:
                high = middle - 1
        return low

    def drain(self) -> list[Item]:
        items = list(self._waiting)
        self._waiting.clear()
        return items
