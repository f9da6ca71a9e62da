"""Batch to the deadline: cost classes, earliest deadline first, admission by what can be met.

Each cost class (bucket) keeps its queued requests in (priority, deadline) order, a cost model
of its batches (`LinearCost`) and the rate its rows arrive at. Requests of different classes
never share a batch.

**Admission.** A request is refused at once (the scheduler answers 429) when its deadline cannot
be met: not even by a batch of its rows alone started now, or when the wait for the work
queued ahead of it (same or higher priority, every class, spread over the instances) and what
the instances are still running, or the event loop's backlog where that is longer (what the
requests it holds still need of it: a queue as much as the model's, drained at the same time),
would take more than a share of the time left once the known delays (the hand-off, the event
loop's lag once, for the answer going out, a learnt correction) are taken off. The share is all
of it while the worker refuses next to nothing, and falls to ``admission_target`` as refusals
near a steady fifth of requests (overload): then the rest is headroom for what the worker
cannot see. Refusing early keeps the queue at what can be served in time, so under overload
the admitted requests keep their latency (goodput) instead of all getting slow. A request the
shed let in before it was read (`Item.screened`) may, when it is offered, queue for all of its
time left: the share's headroom is for the requests not yet read, and refusing one already
read and decoded saves only the model's part of its cost. (Under overload the wait ahead grew
between the two often enough that as many requests were decoded and then refused as were
served: churn at 15,000 req/s answered 2,500-2,700 a second within its SLO, and 4,900-5,100
with this.)

**Dispatch.** When an instance is free, a class's batch goes when it holds its target rows, or
when waiting longer would make its most urgent member miss its deadline (the deadline minus the
predicted time of the batch, with the model's error margin, and the hand-off overhead: getting
a batch to its thread and the results back to the event loop). A batch never holds more rows
than can run before that member's deadline. The target is the batch size at
which the class's arrivals need no more than ``target_utilization`` of the instances' time:

    rows arriving λ a second, batches costing a + b·n:   λ·(a/n + b) <= U·k   =>   n >= λa/(Uk - λb)

At low load that is one row (no wait at all); as the load nears capacity it climbs to the
maximum (full batches). The instances are not always the bottleneck: once the event loop's
thread is more than 30% busy, a class also waits for the rows that arrive within up to 4 ms (as
the loop nears full use), and for no longer than that since its most urgent member came, as
every batch costs the loop its dispatch, merge, split and answers. A class that is ready
goes before one that may still wait; among the ready, the higher priority and then the earlier
latest start goes first.

**Expiry.** A queued request with a client-set deadline that can no longer be met even if it
ran now is returned as expired (the scheduler answers 504) rather than run to no one's benefit.
A request whose deadline is only the model's SLO is never expired: it runs late.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from tailserve.engine.batching import Item, Poll, Rejection
from tailserve.engine.buckets import Bucket
from tailserve.engine.cost import LinearCost

# The arrival rate is a count decayed with this time constant (seconds), over at least
# _RATE_MIN_S (one arrival is not a rate of thousands a second).
_RATE_TAU_S = 0.5
_RATE_MIN_S = 0.05
# Arrivals this close after the count's last decay join it undecayed (no exp of their own).
_RATE_GRANULE_S = 0.001

# The share of recent requests refused (a moving average over about 1/_REFUSAL_RATE requests)
# at which admission keeps its full headroom: the worker is overloaded. (At 5%, a burst's few
# refusals lowered the share to its floor, and at the floor the Poisson queue of a worker at
# two thirds of its capacity went past it often enough, 2-5% of requests, to keep it there:
# the ranker refused 115-310 requests in 8 s at 600-800 req/s with its p99 at half its SLO.)
_REFUSAL_RATE = 0.01
_OVERLOADED_AT = 0.2
# Below this the share of refusals counts as none (the share of the time left is within
# 0.05% of whole), and an admitted request has nothing to count.
_REFUSALS_NONE = 1e-4

# A shed this soon after an offer may count the work queued as that offer did.
_HINT_S = 0.005
# Under overload, a shed's refusal stands for this long for any request with less time left
# (the server answers those without asking again: a refusal costs the event loop about a
# third of a served request, and under overload refusals are most of what it does).
_REUSE_S = 0.001

# From this share of its thread's time busy, the event loop counts as a bottleneck: a class
# then waits for the rows arriving within up to _LOOP_WAIT_S (all of it at a saturated loop),
# and for no longer than that since its most urgent member came, as every batch costs the
# loop its dispatch, merge, split and answers (churn: ~110-140 µs a batch beside its rows, more
# than the ~90 µs a request costs the loop besides). The deadline rule still starts it in time.
_LOOP_BUSY_FROM = 0.3
_LOOP_WAIT_S = 0.004

# The weight of each answered request in the admission's correction; what admission learnt
# (the correction, the hand-off overhead) fades with this time constant when nothing new comes.
_CORRECTION_RATE = 0.01
_CORRECTION_TAU_S = 0.5
# What admission learnt, faded, is worked out again at most this often (it fades over
# _CORRECTION_TAU_S) or when a batch or an answer teaches something new: not on every request.
_LEARNT_REFRESH_S = 0.001
# The most hand-off overhead a batch teaches (a loop stalled for a moment says nothing of the
# next batch's hand-off; the scheduler caps its own estimate alike).
_MAX_OVERHEAD_S = 0.02


def _faded(value: float, learnt_at: float, now: float) -> float:
    """What admission learnt at ``learnt_at``, faded by the time since."""
    return value * math.exp(-max(0.0, now - learnt_at) / _CORRECTION_TAU_S)


@dataclass(slots=True)
class _Rate:
    """Rows per second: a count decayed with time constant tau, divided by the decayed length
    of time it covers (so the estimate is not low while the first tau seconds fill)."""

    count: float = 0.0
    at: float = 0.0
    since: float | None = None

    def add(self, now: float, rows: int) -> None:
        if self.since is None:
            self.since = now
        elif 0.0 <= now - self.at < _RATE_GRANULE_S:
            # (Counted as come at ``at``: at most a 0.2% error, and no exp for each request.)
            self.count += rows
            return
        self.count = self.count * math.exp(-max(0.0, now - self.at) / _RATE_TAU_S) + rows
        self.at = now

    def value(self, now: float) -> float:
        if self.since is None:
            return 0.0
        covered = _RATE_TAU_S * -math.expm1(-max(now - self.since, _RATE_MIN_S) / _RATE_TAU_S)
        return self.count * math.exp(-max(0.0, now - self.at) / _RATE_TAU_S) / covered


@dataclass(slots=True)
class _Class:
    bucket: Bucket
    cost: LinearCost
    order: list[tuple[int, float, int, Item]] = field(default_factory=list)
    # Deadline order, kept apart from ``order`` only while more than one priority level is
    # queued (``mixed``): with one, ``order`` is already in deadline order, and one heap a
    # request is half the bookkeeping. ``level``: that one level (0: the class is empty).
    urgent: list[tuple[float, int, Item]] = field(default_factory=list)
    mixed: bool = False
    level: int = 0
    hard: list[tuple[float, int, Item]] = field(default_factory=list)
    rows: int = 0
    rows_by_priority: dict[int, int] = field(default_factory=dict)
    # The lowest priority (largest level) ever queued here: a request at it or below has
    # every queued row ahead of it.
    lowest: int = 0
    rate: _Rate = field(default_factory=_Rate)
    # What the last poll waits for here, besides its time to look again: an arrival that
    # brings the class to ``wake_rows`` (a batch's worth, or the company it waits for) or
    # with an earlier deadline than ``wake_deadline`` (it must start sooner) asks for a new
    # poll. 0: any arrival does (nothing was waited for: the class was empty, or taken from).
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
        always goes, even when its rows alone pass ``max_rows`` (a request is never split, and
        one left behind because its rows cannot all run before its deadline would stay queued
        for good, its rows counted against every request offered after it)."""
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


class DeadlineBatcher:
    def __init__(
        self,
        *,
        max_rows: int,
        instances: int,
        max_queue: int,
        target_utilization: float = 0.8,
        admission_target: float = 0.3,
    ) -> None:
        self.max_rows = max_rows
        self.admission_target = admission_target
        self.instances = instances
        self.max_queue = max_queue
        self.target_utilization = target_utilization
        self._classes: dict[Hashable, _Class] = {}
        # The one class, while there is only one (`_queued_work`'s short way).
        self._only: _Class | None = None
        self._queued = 0
        # Whether requests with a client-set deadline may be queued (only they can expire).
        self._hard = False
        # Whether the last request offered may change what `poll` answers (see `Batcher`).
        self.poll_soon = True
        self._seq = itertools.count()
        # Exponentially weighted mean of a batch's hand-off overhead (seconds), and when it
        # was last learnt: admission uses it faded by the time since (`_overhead`).
        self.overhead_s = 0.0
        self._overhead_at = 0.0
        # How late the event loop runs what is ready: an answer waits about that long before
        # it goes out. (The wait before its request was seen is inside its budget already:
        # the deadline counts from when the server began to read it.)
        self.loop_delay_s = 0.0
        # How busy the event loop's thread is (0..1).
        self.loop_busy = 0.0
        # The loop's time the requests it holds still need (observability.loop_lag): where the
        # loop, not the model, is the bottleneck, the wait an admitted request has ahead.
        self.loop_backlog_s = 0.0
        # How much later than estimated admitted requests were answered (moving average):
        # what the estimate leaves out (idle gaps, contention) is learnt back into it. It fades
        # with time too: were everything refused, nothing would be answered to correct it.
        self.correction_s = 0.0
        self._corrected_at = 0.0
        # The share of recent requests refused (moving average), and the share of the time
        # left it lets a request queue (`share`).
        self.refusals = 0.0
        self._share = 1.0
        # When the last offer counted the work queued, and that work with its own request's
        # (if admitted): what a shed soon after may take for its own count (`shed`).
        self._hint = (-math.inf, 0.0)
        # (The faded overhead, it plus the correction, and when they were worked out: `_learnt`.)
        self._learnt_s = (0.0, 0.0)
        self._learnt_at = -math.inf

    def __len__(self) -> int:
        return self._queued

    # --- admission ------------------------------------------------------------------------

    def offer(self, item: Item, now: float, free_at: Sequence[float]) -> Rejection | None:
        if self._queued >= self.max_queue:
            self._count(refused=True)
            return Rejection("queue_full", f"queue is full ({self.max_queue} requests)", 1.0)
        queue = self._classes.get(item.bucket.key) or self._class(item.bucket)
        cost = queue.cost
        learnt = self._learnt(now)
        alone = cost.fixed_s + cost.per_row_s * item.rows + learnt[0] + self.loop_delay_s
        budget = item.deadline - now
        if budget < alone:
            return Rejection(
                "deadline",
                f"deadline in {budget * 1000:.1f} ms cannot be met: a batch of its "
                f"{item.rows} row(s) alone takes ~{alone * 1000:.1f} ms",
                1.0,
            )
        # Its wait for the work ahead, against a share of the time left once the delays and
        # its own batch are taken off. (Counting its own batch against the share too refused
        # a lone 500-row ranker request at 100 req/s once the share had fallen under overload,
        # and the refusals kept the share down: the worker never recovered.)
        # (What its own rows add: their batch alone, or their share of a batch already queued.)
        work, own_work = self._queued_work(item.priority, item.rows, queue)
        ahead = self._ahead(work, now, free_at)
        own = own_work / (len(free_at) or 1)
        delays = learnt[1] + self.loop_delay_s
        # A request the shed let in before it was read may queue for all of its time left:
        # the share's headroom is for the requests not yet read, and this one was read and
        # decoded (refused now, it saves the model's part of its cost and no more).
        share = 1.0 if item.screened else self._share
        if ahead > (budget - delays - own) * share:
            self._hint = (now, work)
            return self._unmeetable(budget, ahead + own, delays)
        # (Admitted: its own rows are queued ahead of the next request now.)
        self._hint = (now, work + own_work)
        self._count(refused=False)
        item.estimate = now + ahead + own + delays
        queue.push(item, next(self._seq))
        queue.rate.add(now, item.rows)
        self._queued += 1
        if item.hard:
            self._hard = True
        # Whether what the last poll waits for has come (`_Class.wake_rows`).
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
        budget = deadline - now
        if not queue:
            # It may be a cache hit, answered without the model; it still waits for the event
            # loop to read, decode and answer what it holds. (Let in unread, a cached model's
            # requests were refused only once decoded, at nearly the cost of serving them:
            # under overload the loop fell behind, the requests it had not read piled up where
            # no estimate sees them, and it went on refusing them long after.)
            return self._refused_unread(budget, self.loop_backlog_s, self.loop_delay_s)
        if self._queued >= self.max_queue:
            self._count(refused=True)
            return Rejection("queue_full", f"queue is full ({self.max_queue} requests)", 1.0)
        # The last offer's count of the work queued, if recent, is a high one for this
        # request: since then work has only been taken (or has expired), and that offer's
        # priority let no more ahead of it than the highest does. When it admits, that is the
        # answer, without counting the queue again (the offer will check the request itself).
        at, work = self._hint
        if 0.0 <= now - at < _HINT_S:
            ahead = self._ahead(work, now, free_at)
            if ahead <= (budget - self._learnt(now)[1] - self.loop_delay_s) * self._share:
                return None
        queueing, _, delays = self._wait_estimate(priority, 0, None, now, free_at)
        return self._refused_unread(budget, queueing, delays)

    def _refused_unread(self, budget: float, queueing: float, delays: float) -> Rejection | None:
        """The shed's answer for a request with ``budget`` left, ``queueing`` ahead of it and
        ``delays`` besides."""
        if queueing > (budget - delays) * self._share:
            rejection = self._unmeetable(budget, queueing, delays)
            if self._share > self.admission_target + 1e-9:
                return rejection
            # Overloaded (the share at its floor): for a moment, a request with less time left
            # than this one's least would be refused too, and may be without asking again.
            least = queueing / self._share + delays
            return dataclasses.replace(rejection, reusable_s=_REUSE_S, least_budget_s=least)
        return None

    def _unmeetable(self, budget: float, queueing: float, delays: float) -> Rejection:
        """A refusal for the wait ahead, saying what makes it up (the model's queue, the
        event loop's backlog, the other delays) and what share of the budget it may take."""
        self._count(refused=True)
        wait = queueing + delays
        return Rejection(
            "deadline",
            f"deadline in {budget * 1000:.1f} ms cannot be met: the work queued ahead needs "
            f"~{wait * 1000:.1f} ms (the longer of the model's queue and the event loop's "
            f"backlog, {self.loop_backlog_s * 1000:.1f}: {queueing * 1000:.1f}; other delays "
            f"{delays * 1000:.1f}; the queue may take {self.share():.0%} of the time the "
            "delays leave)",
            wait,
        )

    def share(self) -> float:
        """The share of its time left a request may spend queued: all of it while the worker
        refuses next to nothing (a burst that the estimate says will be served in time is
        served), down to ``admission_target`` as refusals near a steady share (overload: the
        rest is headroom for what the worker cannot see, the kernel's queue above all)."""
        return self._share

    def _count(self, *, refused: bool) -> None:
        if not refused and self.refusals <= _REFUSALS_NONE:
            if self.refusals:  # (faded to nothing: the share is whole again)
                self.refusals, self._share = 0.0, 1.0
            return
        refusals = self.refusals = self.refusals + _REFUSAL_RATE * (refused - self.refusals)
        if refusals >= _OVERLOADED_AT:
            self._share = self.admission_target
        else:
            self._share = 1.0 - (1.0 - self.admission_target) * (refusals / _OVERLOADED_AT)

    def refused(self) -> None:
        self._count(refused=True)

    def completed(self, item: Item, done: float) -> None:
        if item.estimate:
            error = done - item.estimate
            if self._corrected_at != done:  # (a batch's members are done at once: faded once)
                self.correction_s = self._correction(done)
            self.correction_s += _CORRECTION_RATE * (error - self.correction_s)
            self._corrected_at = done
            self._learnt_at = -math.inf

    def _correction(self, now: float) -> float:
        return _faded(self.correction_s, self._corrected_at, now)

    def _wait_estimate(
        self,
        priority: int,
        own_rows: int,
        queue: _Class | None,
        now: float,
        free_at: Sequence[float],
    ) -> tuple[float, float, float]:
        """How long until the request is answered, as a fluid estimate (the instances'
        remaining busy time and the work queued ahead, shared between instances, or the event
        loop's backlog where that is longer): the wait for what is ahead of it; the same with
        its own rows added to its class ``queue`` (their batch alone, or their share of one
        already queued); and the delays outside the queues (hand-off, the loop's lag, the
        learnt correction) (the request: of ``priority``, with ``own_rows`` rows)."""
        work, own_work = self._queued_work(priority, own_rows, queue)
        ahead = self._ahead(work, now, free_at)
        delays = self._learnt(now)[1] + self.loop_delay_s
        return ahead, ahead + own_work / (len(free_at) or 1), delays

    def _ahead(self, work: float, now: float, free_at: Sequence[float]) -> float:
        """The wait for what is ahead: the instances' remaining busy time and the ``work``
        queued, shared between the instances, or the event loop's backlog where longer."""
        busy = 0.0
        for at in free_at:
            if at > now:
                busy += at - now
        # The loop's backlog is a queue ahead like the model's, and takes the same share: left
        # among the delays, it could fill the whole budget under overload (admitted requests
        # then spent 45 of churn's 50 ms inside the worker, and the kernel's queue before it
        # took them past the SLO). The two queues drain at once, the loop decoding and
        # answering while the instances run, so the wait is the longer of them: their sum
        # counted a request queued for the model twice, and where the model is the bottleneck
        # (sentiment) it shrank the queue and the batches, and goodput under overload by a
        # quarter.
        ahead = (busy + work) / (len(free_at) or 1)
        return ahead if ahead > self.loop_backlog_s else self.loop_backlog_s

    def _queued_work(
        self, priority: int, own_rows: int, queue: _Class | None
    ) -> tuple[float, float]:
        """The instance time of the work queued ahead of a request of ``priority`` (every
        class, in batches, with a margin of twice their combined error), and what its own
        ``own_rows`` add in their class ``queue`` (their batch alone, or their share of one
        already queued)."""
        max_rows = self.max_rows
        only = self._only
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
        for other in self._classes.values():
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

    def _learnt(self, now: float) -> tuple[float, float]:
        """The delays admission learnt, faded: the hand-off overhead, and it plus the
        correction (when positive)."""
        if not 0.0 <= now - self._learnt_at < _LEARNT_REFRESH_S:
            overhead = self._overhead(now)
            self._learnt_s = (overhead, overhead + max(0.0, self._correction(now)))
            self._learnt_at = now
        return self._learnt_s

    def _batches(self, cost: LinearCost, rows: int) -> tuple[float, float]:
        """The time of ``rows`` in full batches and a last partial one, and its variance."""
        if rows <= 0:
            return 0.0, 0.0
        if rows < self.max_rows:
            return cost.fixed_s + cost.per_row_s * rows, cost.error_s * cost.error_s
        full, rest = divmod(rows, self.max_rows)
        work = full * cost.predict(self.max_rows) + (cost.predict(rest) if rest else 0.0)
        return work, (full + (rest > 0)) * cost.error_s**2

    # --- dispatch ---------------------------------------------------------------------------

    def poll(self, now: float, free_at: Sequence[float], *, draining: bool = False) -> Poll:
        expired = self._expire(now) if self._hard else []
        if not self._queued or not free_at or min(free_at) > now:
            return Poll(expired=expired)
        chosen: tuple[int, float, _Class, int] | None = None
        wake = math.inf
        for queue in self._classes.values():
            urgent = queue.most_urgent()
            if urgent is None:
                continue
            limit = self._rows_in_time(queue, urgent.deadline - now)
            rows = queue.next_batch_rows(limit)
            latest = urgent.deadline - queue.cost.bound(rows) - self.overhead_s
            rate = queue.rate.value(now)
            target = self._target_rows(queue, rate, now)
            # Company for the loop's sake: the rows that arrive within the loop's wait, for no
            # longer than that wait since the most urgent member came.
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
            batch = chosen[2].take(chosen[3])
            self._queued -= len(batch)
            return Poll(batch=batch, expired=expired)
        return Poll(expired=expired, wait_until=None if math.isinf(wake) else wake)

    def _rows_in_time(self, queue: _Class, remaining: float) -> int:
        """The most rows a batch may hold and still end within ``remaining`` seconds.

        When not even one row can (the deadline is already lost), shrinking the batch saves
        nothing and costs throughput, just when the queue is longest: then it is the maximum.
        """
        cost = queue.cost
        spare = remaining - self.overhead_s - cost.bound(0)
        if cost.per_row_s <= 0:
            return self.max_rows
        rows = spare / cost.per_row_s
        if not rows < self.max_rows:  # (inf and nan included: no int() of those)
            return self.max_rows
        fit = int(rows)
        return self.max_rows if fit < 1 else fit

    def _target_rows(self, queue: _Class, rate: float, now: float) -> int:
        """The rows at which the class's arrivals (``rate`` rows a second, now) need no more
        than ``target_utilization`` of the instances' time."""
        if rate <= 0:
            return 1
        # Each batch also costs the event loop its hand-off (dispatch, results back): where the
        # loop is the bottleneck, that is the fixed cost that batching amortises.
        fixed, per_row = queue.cost.fixed_s + self.overhead_s, queue.cost.per_row_s
        # The instance time the other classes need at the least (their per-row part).
        others = 0.0
        if len(self._classes) > 1:
            others = sum(
                other.rate.value(now) * other.cost.per_row_s
                for other in self._classes.values()
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

    def _expire(self, now: float) -> list[Item]:
        expired: list[Item] = []
        for queue in self._classes.values():
            while queue.hard:  # (only client-set deadlines expire)
                urgent = queue.most_urgent_hard()
                if urgent is None or urgent.deadline >= now + queue.cost.predict(urgent.rows):
                    break
                queue.remove(urgent)
                expired.append(urgent)
        self._queued -= len(expired)
        self._hard = any(queue.hard for queue in self._classes.values())
        return expired

    # --- cost models ----------------------------------------------------------------------

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
            learnt = self.overhead_s if now is None else self._overhead(now)
            self.overhead_s = learnt + 0.05 * (min(overhead_s, _MAX_OVERHEAD_S) - learnt)
            if now is not None:
                self._overhead_at = now
            self._learnt_at = -math.inf

    def _overhead(self, now: float) -> float:
        """The hand-off overhead admission counts on: the learnt one, faded since it was last
        learnt. Learnt only from batches that ran, it would otherwise outlive an overload for
        good: a loop stalled under a flood teaches tens of milliseconds, every request after is
        refused for it, and no batch runs to teach otherwise."""
        return _faded(self.overhead_s, self._overhead_at, now)

    def predict(self, bucket: Bucket, rows: int) -> float:
        return self._class(bucket).cost.predict(rows)

    def costs(self) -> dict[str, LinearCost]:
        return {queue.bucket.label: queue.cost for queue in self._classes.values()}

    def drain(self) -> list[Item]:
        items = []
        for queue in self._classes.values():
            while (item := queue.most_urgent()) is not None:
                queue.remove(item)
                items.append(item)
        self._queued = 0
        return items

    def _class(self, bucket: Bucket) -> _Class:
        found = self._classes.get(bucket.key)
        if found is None:
            found = self._classes[bucket.key] = _Class(bucket, self._prior(bucket))
            self._only = found if len(self._classes) == 1 else None
        return found

    def _prior(self, bucket: Bucket) -> LinearCost:
        """A new class starts from the fit of the class nearest below it in padded length (a
        longer class costs at least as much), else from the default guess."""
        if bucket.pad is None or bucket.pad.length is None:
            return LinearCost()
        below = [
            (queue.bucket.pad.length, queue.cost)
            for queue in self._classes.values()
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
