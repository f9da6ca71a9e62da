"""Batchers: pure objects that hold a model's queue and say what to run, and when.

A batcher never touches asyncio, a model or the network; it is told the time and when each
instance will be free. The scheduler `offer`s it each request (it may refuse: queue full, or
a deadline it cannot meet), and `poll`s it whenever an instance is free or something changed:
the answer is a batch to run now, requests to fail because their deadline has passed, or the
time to look again. Keeping the rules here lets them be tested with a fake clock and swapped:

- `DeadlineBatcher` (engine/deadline_batcher.py): cost classes, earliest deadline first, admission.
- `SizeOrTimeout`: a batch goes when full or when its oldest request has waited long enough
  (what Triton, MLServer and TorchServe do).
- `NoBatching`: every request alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailserve.engine.buckets import Bucket
from tailserve.engine.cost import LinearCost


@dataclass(slots=True, eq=False)
class Item:
    """One queued request as a batcher sees it; ``payload`` is the scheduler's own."""

    rows: int
    bucket: Bucket
    enqueued_at: float
    deadline: float = math.inf
    priority: int = 1  # 1 is the highest
    payload: Any = None
    taken: bool = False
    # The client set the deadline (it gives up then): past it, the request expires. Without
    # one, the model's SLO orders and admits the request, but a late answer still goes out.
    hard: bool = False
    # When the batcher expected it to be answered, as it admitted it.
    estimate: float = 0.0
    # The shed let it in before it was read (`Batcher.shed`, at the highest priority): its
    # offer may let it queue for all of its time left (engine/admission.py).
    screened: bool = False
    # A pipeline's step (engine/pipeline.py): its request is already running on the event
    # loop, so the loop's backlog is not ahead of it; its step's budget bounds its wait.
    inner: bool = False


@dataclass(slots=True)
class Poll:  # (not frozen: a frozen dataclass takes twice as long to make, once a request)
    batch: list[Item] = field(default_factory=list)
    # Queued requests whose deadline can no longer be met even if they ran now.
    expired: list[Item] = field(default_factory=list)
    # Poll again then (or at the next arrival or free instance); None: only then.
    wait_until: float | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str  # "queue_full" | "deadline"
    message: str
    retry_after_s: float
    # A refusal before the request is read, under overload: for this long (seconds) any
    # request with under ``least_budget_s`` left may be refused on its word (0: not at all).
    reusable_s: float = 0.0
    least_budget_s: float = 0.0


class Batcher(Protocol):
    # How late the event loop runs what is ready (set by the scheduler before each offer).
    loop_delay_s: float
    # How busy the event loop's thread is, 0..1 (set by the scheduler before each offer).
    loop_busy: float
    # The loop's time the requests it holds still need, seconds (likewise).
    loop_backlog_s: float
    # Set by `offer`: whether the request it queued may change what `poll` answers, so the
    # scheduler must poll again; when False, the time to look again that the last poll gave
    # still stands (an arrival that only adds to a batch still filling wakes no one).
    poll_soon: bool

    def offer(
        self,
        item: Item,
        now: float,
        free_at: Sequence[float],
        *,
        final: bool = True,
        headroom: float = 1.0,
    ) -> Rejection | None:
        """Queue the request, or say why not. ``free_at``: when each instance is free. Not
        ``final``: a refusal for its deadline is not counted (it will be offered another way).
        ``headroom``: the share of admission's allowance for the queue ahead it may take."""
        ...

    def poll(self, now: float, free_at: Sequence[float], *, draining: bool = False) -> Poll:
        """What to do now that an instance is free (``draining``: no one else is coming)."""
        ...

    def shed(
        self,
        now: float,
        free_at: Sequence[float],
        *,
        deadline: float,
        priority: int,
        queue: bool = True,
    ) -> Rejection | None:
        """Before a request is even read: would the least request of that priority and
        deadline be refused? (Refusing then costs a fraction of refusing after decoding.) The
        request it lets in is offered later marked `Item.screened`. Not ``queue``: the request
        may not need the model (a cache hit); only what every request waits for counts (the
        event loop's backlog)."""
        ...

    def observe(
        self,
        bucket: Bucket,
        rows: int,
        seconds: float,
        overhead_s: float,
        now: float | None = None,
    ) -> None:
        """A batch of ``rows`` in ``bucket`` kept its instance busy ``seconds``; getting it
        there and its results back to the loop took ``overhead_s`` more (answered at ``now``)."""
        ...

    def predict(self, bucket: Bucket, rows: int) -> float: ...

    def completed(self, item: Item, done: float) -> None:
        """The request was answered at ``done`` (to check the admission's estimate)."""
        ...

    def refused(self) -> None:
        """A request was refused on the word of an earlier `shed` (`Rejection.reusable_s`)."""
        ...

    def costs(self) -> dict[str, LinearCost]:
        """The cost model of each cost class, by label."""
        ...

    def drain(self) -> list[Item]:
        """Remove and return everything queued."""
        ...

    def __len__(self) -> int: ...


class _Fifo:
    """The arrival-order queue and one cost model per class, shared by the simple batchers."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.loop_delay_s = 0.0
        self.loop_busy = 0.0
        self.loop_backlog_s = 0.0
        self.poll_soon = True
        self.queue: deque[Item] = deque()
        # The rows queued.
        self.rows = 0
        self._costs: dict[Any, tuple[str, LinearCost]] = {}

    def offer(
        self,
        item: Item,
        now: float,
        free_at: Sequence[float],
        *,
        final: bool = True,
        headroom: float = 1.0,
    ) -> Rejection | None:
        if len(self.queue) >= self.max_queue:
            return Rejection("queue_full", f"queue is full ({self.max_queue} requests)", 1.0)
        self.queue.append(item)
        self.rows += item.rows
        self.poll_soon = self._poll_soon(item)
        return None

    def _poll_soon(self, item: Item) -> bool:
        return True

    def _take(self, count: int) -> list[Item]:
        batch = [self.queue.popleft() for _ in range(count)]
        self.rows -= sum(item.rows for item in batch)
        return batch

    def observe(
        self,
        bucket: Bucket,
        rows: int,
        seconds: float,
        overhead_s: float,
        now: float | None = None,
    ) -> None:
        self._cost(bucket).observe(rows, seconds)

    def predict(self, bucket: Bucket, rows: int) -> float:
        return self._cost(bucket).predict(rows)

    def completed(self, item: Item, done: float) -> None:
        pass

    def refused(self) -> None:
        pass

    def shed(
        self,
        now: float,
        free_at: Sequence[float],
        *,
        deadline: float,
        priority: int,
        queue: bool = True,
    ) -> Rejection | None:
        if queue and len(self.queue) >= self.max_queue:
            return Rejection("queue_full", f"queue is full ({self.max_queue} requests)", 1.0)
        return None

    def costs(self) -> dict[str, LinearCost]:
        return dict(self._costs.values())

    def drain(self) -> list[Item]:
        items = list(self.queue)
        self.queue.clear()
        self.rows = 0
        return items

    def __len__(self) -> int:
        return len(self.queue)

    def _cost(self, bucket: Bucket) -> LinearCost:
        found = self._costs.get(bucket.key)
        if found is None:
            found = self._costs[bucket.key] = (bucket.label, LinearCost())
        return found[1]


class SizeOrTimeout(_Fifo):
    """Run a batch when it is full, or when its oldest request has waited ``max_delay_s``.

    A batch takes queued requests of the head's class, in arrival order, while their rows fit
    in ``max_rows``. A request is never split: one larger than the limit was refused earlier.
    Deadlines are not looked at.
    """

    def __init__(self, *, max_rows: int, max_delay_s: float, max_queue: int) -> None:
        super().__init__(max_queue)
        self.max_rows = max_rows
        self.max_delay_s = max_delay_s

    def poll(self, now: float, free_at: Sequence[float], *, draining: bool = False) -> Poll:
        if not self.queue:
            return Poll()
        take, full = _fill(self.queue, self.max_rows)
        due = self.queue[0].enqueued_at + self.max_delay_s
        if full or draining or now >= due:
            return Poll(batch=self._take(take))
        return Poll(wait_until=due)

    def _poll_soon(self, item: Item) -> bool:
        # A new head (its time to wait starts), or a batch that may be complete: full, or
        # ended by a request of another class. Otherwise the head's time still stands.
        queue = self.queue
        return (
            len(queue) == 1 or item.bucket.key != queue[0].bucket.key or self.rows >= self.max_rows
        )


class NoBatching(_Fifo):
    """Every request runs alone, in arrival order, as soon as an instance is free."""

    def poll(self, now: float, free_at: Sequence[float], *, draining: bool = False) -> Poll:
        return Poll(batch=self._take(1)) if self.queue else Poll()


def _fill(queue: Sequence[Item], max_rows: int) -> tuple[int, bool]:
    """How many head-of-queue requests of the head's class fit; whether the batch is complete.

    The batch is the run of same-class requests from the head, so arrival order is kept. A
    request of another class ends the run: waiting longer could not grow this batch.
    """
    key = queue[0].bucket.key
    take = rows = 0
    for item in queue:
        if item.bucket.key != key or rows + item.rows > max_rows:
            return take, True
        take += 1
        rows += item.rows
    return take, rows >= max_rows
