"""Batch to the deadline: cost classes, earliest deadline first, admission by what can be met.

`DeadlineBatcher` keeps a model's requests by cost class (engine/queues.py), refuses at once
what cannot be served in time (engine/admission.py), and decides here when each class's batch
goes.

When an instance is free, a class's batch goes when it holds its target rows, or when waiting
longer would make its most urgent member miss its deadline (the deadline minus the predicted
time of the batch, with the model's error margin, and the hand-off overhead). A batch never
holds more rows than can run before that member's deadline. The target is the batch size at
which the class's arrivals need no more than ``target_utilization`` of the instances' time:

    rows arriving λ a second, batches costing a + b·n:   λ·(a/n + b) <= U·k   =>   n >= λa/(Uk - λb)

At low load that is one row (no wait at all); as the load nears capacity it climbs to the
maximum. Where the event loop is the bottleneck, a class also waits a few milliseconds for
company, as every batch costs the loop its dispatch, merge, split and answers. A ready class
goes before one that may still wait; among the ready, the higher priority, then the earlier
latest start. A poll also returns the requests that expired (`ClassQueues.expire`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tailserve.engine.admission import Admission
from tailserve.engine.batching import Item, Poll, Rejection
from tailserve.engine.buckets import Bucket
from tailserve.engine.cost import LinearCost
from tailserve.engine.delays import Delays
from tailserve.engine.queues import ClassQueue, ClassQueues
from tailserve.engine.refusal_audit import RefusalAudit

# From this share of its thread's time busy, the event loop counts as a bottleneck: a class
# then waits for the rows arriving within up to _LOOP_WAIT_S (all of it at a saturated loop),
# and no longer than that since its most urgent member came.
_LOOP_BUSY_FROM = 0.3
_LOOP_WAIT_S = 0.004


class DeadlineBatcher:
    def __init__(
        self,
        *,
        max_rows: int,
        instances: int,
        max_queue: int,
        target_utilization: float = 0.8,
        admission_target: float = 0.3,
        audit: RefusalAudit | None = None,
    ) -> None:
        self.max_rows = max_rows
        self.instances = instances
        self.target_utilization = target_utilization
        # Whether the last request offered may change what `poll` answers (see `Batcher`).
        self.poll_soon = True
        self._delays = Delays()
        self._queues = ClassQueues(max_rows)
        self._admission = Admission(
            self._queues,
            self._delays,
            max_queue=max_queue,
            admission_target=admission_target,
            audit=audit,
        )

    def __len__(self) -> int:
        return self._queues.queued

    # The event loop's readings (the `Batcher` protocol's), and what was learnt: see Delays.

    @property
    def loop_delay_s(self) -> float:
        return self._delays.loop_delay_s

    @loop_delay_s.setter
    def loop_delay_s(self, value: float) -> None:
        self._delays.loop_delay_s = value

    @property
    def loop_backlog_s(self) -> float:
        return self._delays.loop_backlog_s

    @loop_backlog_s.setter
    def loop_backlog_s(self, value: float) -> None:
        self._delays.loop_backlog_s = value

    @property
    def loop_busy(self) -> float:
        """How busy the event loop's thread is (0..1)."""
        return self._delays.loop_busy

    @loop_busy.setter
    def loop_busy(self, value: float) -> None:
        self._delays.loop_busy = value

    @property
    def overhead_s(self) -> float:
        return self._delays.overhead_s

    @property
    def correction_s(self) -> float:
        return self._delays.correction_s

    # --- admission: see Admission ----------------------------------------------------------

    @property
    def max_queue(self) -> int:
        return self._admission.max_queue

    @property
    def admission_target(self) -> float:
        return self._admission.admission_target

    @property
    def refusals(self) -> float:
        return self._admission.refusals

    def share(self) -> float:
        return self._admission.share()

    def offer(
        self,
        item: Item,
        now: float,
        free_at: Sequence[float],
        *,
        final: bool = True,
        headroom: float = 1.0,
    ) -> Rejection | None:
        admission, queues = self._admission, self._queues
        if queues.queued >= admission.max_queue:
            return admission.queue_full(now)
        queue = queues.by_key.get(item.bucket.key) or self._class(item.bucket)
        rejection = admission.admit(item, queue, now, free_at, count=final, headroom=headroom)
        if rejection is not None:
            return rejection
        queues.add(queue, item, now)
        # Whether what the last poll waits for has come (`ClassQueue.wake_rows`).
        self.poll_soon = queue.rows >= queue.wake_rows or item.deadline < queue.wake_deadline
        return None

    def shed(
        self,
        now: float,
        free_at: Sequence[float],
        *,
        deadline: float,
        priority: int,
        queue: bool = True,
    ) -> Rejection | None:
        return self._admission.shed(now, free_at, deadline=deadline, priority=priority, queue=queue)

    def refused(self) -> None:
        self._admission.refused()

    def pressed(self, now: float, free_at: Sequence[float], budget_s: float) -> bool:
        """Whether the model is overloaded: refusing requests lately, or a request of the
        lowest priority offered now would wait more than admission lets it of ``budget_s``."""
        admission = self._admission
        if admission.share() < 1.0:
            return True
        lowest = max(1, max((q.lowest for q in self._queues.by_key.values()), default=1))
        return admission.wait_s(now, free_at, lowest) > budget_s * admission.admission_target

    def wait_s(self, now: float, free_at: Sequence[float]) -> float:
        """How long a request of the lowest priority offered now would wait to start."""
        lowest = max(1, max((q.lowest for q in self._queues.by_key.values()), default=1))
        return float(self._admission.wait_s(now, free_at, lowest))

    def completed(self, item: Item, done: float) -> None:
        if item.estimate:
            self._delays.learn_answer(item.estimate, done)

    # --- dispatch ---------------------------------------------------------------------------

    def poll(self, now: float, free_at: Sequence[float], *, draining: bool = False) -> Poll:
        queues = self._queues
        expired = queues.expire(now) if queues.hard else []
        if not queues.queued or not free_at or min(free_at) > now:
            return Poll(expired=expired)
        overhead = self._delays.overhead_s
        chosen: tuple[int, float, ClassQueue, int] | None = None
        wake = math.inf
        for queue in queues.by_key.values():
            urgent = queue.most_urgent()
            if urgent is None:
                continue
            limit = self._rows_in_time(queue, urgent.deadline - now)
            rows = queue.next_batch_rows(limit)
            latest = urgent.deadline - queue.cost.bound(rows) - overhead
            rate = queue.rate.value(now)
            target = self._target_rows(queue, rate, now)
            # Company for the loop's sake (see _LOOP_BUSY_FROM).
            wait = self._loop_wait()
            company = math.ceil(rate * wait)
            waited = urgent.enqueued_at + wait
            short = min(target, limit) - queue.rows
            ready = short <= 0 and (now >= waited or queue.rows >= company)
            if draining or now >= latest or ready:
                queue.wake_rows = 0
                key = (queue.best_priority(), latest, queue, limit)
                if chosen is None or key[:2] < chosen[:2]:
                    chosen = key
                continue
            queue.wake_deadline = urgent.deadline
            if short > 0:
                queue.wake_rows = queue.rows + short
                wake = min(wake, latest, now + short / rate if rate > 0 else latest)
            else:
                queue.wake_rows = company
                wake = min(wake, latest, waited)
        if chosen is not None:
            return Poll(batch=queues.take(chosen[2], chosen[3]), expired=expired)
        return Poll(expired=expired, wait_until=None if math.isinf(wake) else wake)

    def _rows_in_time(self, queue: ClassQueue, remaining: float) -> int:
        """The most rows a batch may hold and still end within ``remaining`` seconds.

        When not even one row can (the deadline is already lost), shrinking the batch saves
        nothing and costs throughput, just when the queue is longest: then it is the maximum.
        """
        cost = queue.cost
        spare = remaining - self._delays.overhead_s - cost.bound(0)
        if cost.per_row_s <= 0:
            return self.max_rows
        rows = spare / cost.per_row_s
        if not rows < self.max_rows:  # (inf and nan included: no int() of those)
            return self.max_rows
        fit = int(rows)
        return self.max_rows if fit < 1 else fit

    def _target_rows(self, queue: ClassQueue, rate: float, now: float) -> int:
        """The rows at which the class's arrivals (``rate`` rows a second, now) need no more
        than ``target_utilization`` of the instances' time."""
        if rate <= 0:
            return 1
        # Each batch also costs the event loop its hand-off: where the loop is the
        # bottleneck, that is the fixed cost that batching amortises.
        fixed, per_row = queue.cost.fixed_s + self._delays.overhead_s, queue.cost.per_row_s
        # The instance time the other classes need at the least (their per-row part).
        others = 0.0
        if len(self._queues) > 1:
            others = sum(
                other.rate.value(now) * other.cost.per_row_s
                for other in self._queues.by_key.values()
                if other is not queue
            )
        room = self.target_utilization * self.instances - others - rate * per_row
        if room <= 0:
            return self.max_rows
        return max(1, min(self.max_rows, math.ceil(rate * fixed / room)))

    def _loop_wait(self) -> float:
        """How long a class may wait for company because the event loop is the bottleneck."""
        pressure = (self.loop_busy - _LOOP_BUSY_FROM) / (1.0 - _LOOP_BUSY_FROM)
        return _LOOP_WAIT_S * min(1.0, max(0.0, pressure))

    # --- cost models ------------------------------------------------------------------------

    def observe(
        self,
        bucket: Bucket,
        rows: int,
        seconds: float,
        overhead_s: float,
        now: float | None = None,
    ) -> None:
        """A batch ran: ``rows`` in ``seconds``, ``overhead_s`` of hand-off (-1: not measured),
        answered at ``now``."""
        self._class(bucket).cost.observe(rows, seconds)
        if overhead_s >= 0:
            self._delays.learn_overhead(overhead_s, now)

    def predict(self, bucket: Bucket, rows: int) -> float:
        return self._class(bucket).cost.predict(rows)

    def costs(self) -> dict[str, LinearCost]:
        return self._queues.costs()

    def drain(self) -> list[Item]:
        return self._queues.drain()

    def _class(self, bucket: Bucket) -> ClassQueue:
        return self._queues.get(bucket)
