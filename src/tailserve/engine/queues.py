"""The deadline batcher's queue: its requests by cost class, and the work they hold.

Each cost class (bucket) keeps its requests in (priority, deadline) order, a cost model of its
batches (`LinearCost`) and the rate its rows arrive at. Requests of different classes never
share a batch. Admission reads the work queued (`ClassQueues.work_ahead`); dispatch takes
batches from it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from tailserve.engine.batching import Item
from tailserve.engine.buckets import Bucket
from tailserve.engine.cost import LinearCost

# The arrival rate is a count decayed with this time constant (seconds), over at least
# _RATE_MIN_S (one arrival is not a rate of thousands a second).
_RATE_TAU_S = 0.5
_RATE_MIN_S = 0.05
# Arrivals this close after the count's last decay join it undecayed (no exp of their own).
_RATE_GRANULE_S = 0.001


@dataclass(slots=True)
class ArrivalRate:
    """Rows per second: a count decayed with time constant tau, divided by the decayed length
    of time it covers (so the estimate is not low while the first tau seconds fill)."""

    count: float = 0.0
    at: float = 0.0
    since: float | None = None

    def add(self, now: float, rows: float) -> None:
        if self.since is None:
            self.since = now
        elif 0.0 <= now - self.at < _RATE_GRANULE_S:
            self.count += rows  # (counted as come at ``at``: at most a 0.2% error)
            return
        self.count = self.count * math.exp(-max(0.0, now - self.at) / _RATE_TAU_S) + rows
        self.at = now

    def value(self, now: float) -> float:
        if self.since is None:
            return 0.0
        covered = _RATE_TAU_S * -math.expm1(-max(now - self.since, _RATE_MIN_S) / _RATE_TAU_S)
        return self.count * math.exp(-max(0.0, now - self.at) / _RATE_TAU_S) / covered


@dataclass(slots=True)
class ClassQueue:
    """One cost class's requests, in (priority, deadline) order."""

    bucket: Bucket
    cost: LinearCost
    order: list[tuple[int, float, int, Item]] = field(default_factory=list)
    # Deadline order, kept apart from ``order`` only while more than one priority level is
    # queued (``mixed``): with one, ``order`` is already in deadline order. ``level``: that
    # one level (0: the class is empty).
    urgent: list[tuple[float, int, Item]] = field(default_factory=list)
    mixed: bool = False
    level: int = 0
    hard: list[tuple[float, int, Item]] = field(default_factory=list)
    rows: int = 0
    rows_by_priority: dict[int, int] = field(default_factory=dict)
    # The lowest priority (largest level) ever queued here: a request at it or below has
    # every queued row ahead of it.
    lowest: int = 0
    rate: ArrivalRate = field(default_factory=ArrivalRate)
    # What the last poll waits for here: an arrival that brings the class to ``wake_rows``
    # or with a deadline earlier than ``wake_deadline`` asks for a new poll. 0: any arrival
    # does (nothing was waited for).
    wake_rows: int = 0
    wake_deadline: float = 0.0

    def push(self, item: Item, seq: int) -> None:
        level = item.priority
        heapq.heappush(self.order, (level, item.deadline, seq, item))
        if self.mixed:
            heapq.heappush(self.urgent, (item.deadline, seq, item))
        elif level != self.level:
            if self.level:  # a second level: deadline order needs a heap of its own now
                self.mixed = True
                self.urgent = [entry[1:] for entry in self.order if not entry[3].taken]
                heapq.heapify(self.urgent)
            else:
                self.level = level
        if item.hard:
            heapq.heappush(self.hard, (item.deadline, seq, item))
        self.rows += item.rows
        self.rows_by_priority[level] = self.rows_by_priority.get(level, 0) + item.rows
        if level > self.lowest:
            self.lowest = level

    def remove(self, item: Item) -> None:
        item.taken = True
        self.wake_rows = 0
        self.rows -= item.rows
        self.rows_by_priority[item.priority] -= item.rows
        if not self.rows:  # (every request has a row: the class is empty)
            self.level = 0
            if self.mixed:
                self.mixed = False
                self.urgent.clear()

    def most_urgent(self) -> Item | None:
        if not self.mixed:
            return self._first()
        while self.urgent and self.urgent[0][2].taken:
            heapq.heappop(self.urgent)
        return self.urgent[0][2] if self.urgent else None

    def _first(self) -> Item | None:
        """The first request in (priority, deadline) order."""
        while self.order and self.order[0][3].taken:
            heapq.heappop(self.order)
        return self.order[0][3] if self.order else None

    def most_urgent_hard(self) -> Item | None:
        while self.hard and self.hard[0][2].taken:
            heapq.heappop(self.hard)
        return self.hard[0][2] if self.hard else None

    def best_priority(self) -> int:
        first = self._first()
        return first.priority if first is not None else 0

    def take(self, max_rows: int) -> list[Item]:
        """The next batch in (priority, deadline) order, while the rows fit. The first request
        always goes, even when its rows alone pass ``max_rows``: a request is never split, and
        one left behind would stay queued for good."""
        batch: list[Item] = []
        rows = 0
        while self.order:
            item = self.order[0][3]
            if item.taken:
                heapq.heappop(self.order)
                continue
            if batch and rows + item.rows > max_rows:
                break
            heapq.heappop(self.order)
            self.remove(item)
            batch.append(item)
            rows += item.rows
        return batch

    def next_batch_rows(self, max_rows: int) -> int:
        return min(self.rows, max_rows)

    def ahead(self, priority: int) -> int:
        """Rows queued at this priority or a higher one."""
        if priority >= self.lowest:
            return self.rows
        return sum(rows for level, rows in self.rows_by_priority.items() if level <= priority)


class ClassQueues:
    """Every cost class of one model, and how many requests they hold."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.by_key: dict[Hashable, ClassQueue] = {}
        # The one class, while there is only one (`work_ahead`'s short way).
        self.only: ClassQueue | None = None
        self.queued = 0
        # Whether requests with a client-set deadline may be queued (only they can expire).
        self.hard = False
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, bucket: Bucket) -> ClassQueue:
        found = self.by_key.get(bucket.key)
        if found is None:
            found = self.by_key[bucket.key] = ClassQueue(bucket, self._prior(bucket))
            self.only = found if len(self.by_key) == 1 else None
        return found

    def add(self, queue: ClassQueue, item: Item, now: float) -> None:
        queue.push(item, next(self._seq))
        queue.rate.add(now, item.rows)
        self.queued += 1
        if item.hard:
            self.hard = True

    def take(self, queue: ClassQueue, max_rows: int) -> list[Item]:
        batch = queue.take(max_rows)
        self.queued -= len(batch)
        return batch

    def expire(self, now: float) -> list[Item]:
        """The requests with a client-set deadline that can no longer be met even if they ran
        now, taken out. (One whose deadline is only the model's SLO never expires: it runs
        late.)"""
        expired: list[Item] = []
        for queue in self.by_key.values():
            while queue.hard:
                urgent = queue.most_urgent_hard()
                if urgent is None or urgent.deadline >= now + queue.cost.predict(urgent.rows):
                    break
                queue.remove(urgent)
                expired.append(urgent)
        self.queued -= len(expired)
        self.hard = any(queue.hard for queue in self.by_key.values())
        return expired

    def drain(self) -> list[Item]:
        items = []
        for queue in self.by_key.values():
            while (item := queue.most_urgent()) is not None:
                queue.remove(item)
                items.append(item)
        self.queued = 0
        return items

    def costs(self) -> dict[str, LinearCost]:
        return {queue.bucket.label: queue.cost for queue in self.by_key.values()}

    def work_ahead(
        self, priority: int, own_rows: int, queue: ClassQueue | None
    ) -> tuple[float, float]:
        """The instance time of the work queued ahead of a request of ``priority`` (every
        class, in batches, with a margin of twice their combined error), and what its own
        ``own_rows`` add in their class ``queue`` (their batch alone, or their share of one
        already queued)."""
        max_rows = self.max_rows
        only = self.only
        if only is not None and (queue is None or queue is only):
            # One class (most models), all in one batch: the loop below, written out.
            rows = only.rows if priority >= only.lowest else only.ahead(priority)
            own = own_rows if queue is not None else 0
            if rows + own < max_rows:
                cost = only.cost
                if rows:
                    return cost.fixed_s + cost.per_row_s * rows + 2.0 * cost.error_s, (
                        cost.per_row_s * own
                    )
                if own:
                    return 0.0, cost.fixed_s + cost.per_row_s * own + 2.0 * cost.error_s
                return 0.0, 0.0
        work = variance = own_work = own_variance = 0.0
        for other in self.by_key.values():
            rows = other.rows if priority >= other.lowest else other.ahead(priority)
            cost = other.cost
            if not rows:
                batches_work = batches_variance = 0.0
            elif rows < max_rows:  # (one batch: `_batches`'s common case, written out)
                batches_work = cost.fixed_s + cost.per_row_s * rows
                batches_variance = cost.error_s * cost.error_s
            else:
                batches_work, batches_variance = self._batches(cost, rows)
            work += batches_work
            variance += batches_variance
            if other is queue and own_rows:
                with_own = self._batches(cost, rows + own_rows)
                own_work = with_own[0] - batches_work
                own_variance = with_own[1] - batches_variance
        # The batches' errors are independent: their sum grows as the square root of their count.
        spread = math.sqrt(variance)
        if own_work or own_variance:
            own_work += 2.0 * (math.sqrt(variance + own_variance) - spread)
        return work + 2.0 * spread, own_work

    def _batches(self, cost: LinearCost, rows: int) -> tuple[float, float]:
        """The time of ``rows`` in full batches and a last partial one, and its variance."""
        if rows <= 0:
            return 0.0, 0.0
        if rows < self.max_rows:
            return cost.fixed_s + cost.per_row_s * rows, cost.error_s * cost.error_s
        full, rest = divmod(rows, self.max_rows)
        work = full * cost.predict(self.max_rows) + (cost.predict(rest) if rest else 0.0)
        return work, (full + (rest > 0)) * cost.error_s**2

    def _prior(self, bucket: Bucket) -> LinearCost:
        """A new class starts from the fit of the class nearest below it in padded length (a
        longer class costs at least as much), else from the default guess."""
        if bucket.pad is None or bucket.pad.length is None:
            return LinearCost()
        below = [
            (queue.bucket.pad.length, queue.cost)
            for queue in self.by_key.values()
            if queue.bucket.pad is not None
            and queue.bucket.pad.length is not None
            and queue.bucket.pad.length <= bucket.pad.length
            and queue.cost.observations
        ]
        if not below:
            return LinearCost()
        length, cost = max(below, key=lambda pair: pair[0])
        scale = bucket.pad.length / length
        return LinearCost.with_prior(cost.fixed_s, cost.per_row_s * scale)
