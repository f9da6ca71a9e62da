"""Admission: refuse a request at once when its deadline cannot be met.

A request is refused when the queue is full, when not even a batch of its rows alone,
started now, would end in time, or when the wait ahead of it would take more than a share of
the time the known delays leave. The wait ahead is the work queued at its priority or higher in
every class, with what the instances still run, spread over them; or the event loop's backlog,
where that is longer. Refusing early keeps the admitted requests' latency under overload.

The share is whole while the worker refuses next to nothing, and falls to ``admission_target``
as refusals near a fifth of requests: the rest is headroom for the queues the worker cannot see.
While the admitted requests are answered well within the SLO and the event loop has time to spare
(the `RefusalAudit`'s verdict), the evidence says the prediction reads high: the wait ahead may
take twice its allowance. A refusal made then all the same does not count towards the share.

`shed` asks the same before a request is read, for the least request of its deadline. One it
lets in is offered marked `Item.screened` and may queue for all of its time left: refusing it
once decoded would save little.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tailserve.engine.batching import Item, Rejection
from tailserve.engine.delays import Delays
from tailserve.engine.queues import ClassQueue, ClassQueues
from tailserve.engine.refusal_audit import RefusalAudit

# The share of recent requests refused (a moving average over about 1/_REFUSAL_RATE requests)
# at which the worker counts as overloaded: slow enough that a burst does not floor the share.
_REFUSAL_RATE = 0.01
_OVERLOADED_AT = 0.2
# Below this the share of refusals counts as none, and an admitted request has nothing to count.
_REFUSALS_NONE = 1e-4
# While the admitted requests are answered well within the SLO, the predicted wait may take this
# many times its allowance: a prediction read high (a burst after the CPU was taken away for a
# moment, counted at the loop's cost a request at lighter load) is overruled, an overload's is
# not (its backlog grows without bound).
_COMFORTABLE_STRETCH = 2.0
# A shed this soon after an offer may count the work queued as that offer did.
_HINT_S = 0.005
# Under overload, a shed's refusal stands this long for any request with less time left: the
# server may answer those without asking again (refusals are then most of what it does).
_REUSE_S = 0.001


class Admission:
    def __init__(
        self,
        queues: ClassQueues,
        delays: Delays,
        *,
        max_queue: int,
        admission_target: float,
        audit: RefusalAudit | None = None,
    ) -> None:
        self.queues = queues
        self.audit = audit
        # The latest time a decision was asked for (a refusal's count reads the audit then).
        self._now = 0.0
        self.delays = delays
        self.max_queue = max_queue
        self.admission_target = admission_target
        # The share of recent requests refused (moving average), and the share of its time
        # left it lets a request queue (`share`).
        self.refusals = 0.0
        self._share = 1.0
        # When the last offer counted the work queued, and that work with its own request's
        # (if admitted): what a shed soon after may take for its own count.
        self._hint = (-math.inf, 0.0)

    def share(self) -> float:
        """The share of its time left a request may spend queued."""
        return self._share

    def queue_full(self, now: float | None = None) -> Rejection:
        """The refusal of any request while the queue holds ``max_queue``."""
        if now is not None:
            self._now = now
        self._count(refused=True)
        return Rejection("queue_full", f"queue is full ({self.max_queue} requests)", 1.0)

    def admit(
        self,
        item: Item,
        queue: ClassQueue,
        now: float,
        free_at: Sequence[float],
        *,
        count: bool = True,
        headroom: float = 1.0,
    ) -> Rejection | None:
        """Whether ``item`` may join its class ``queue``; admitted, it is given its estimate.
        Not ``count``: a refusal is not counted (the request will be offered another way).
        ``headroom``: the share of the allowance for the queue ahead it may take (a model's
        more accurate variants take less: engine/variants.py)."""
        self._now = now
        delays = self.delays
        cost = queue.cost
        learnt = delays.learnt(now)
        alone = cost.fixed_s + cost.per_row_s * item.rows + learnt[0] + delays.loop_delay_s
        budget = item.deadline - now
        if budget <= 0.0 and not item.hard and self._nothing_ahead(item, queue, now, free_at):
            # Its SLO passed before it was offered (the machine stalled it on its way in), the
            # client set no deadline, and nothing waits ahead: a refusal would spare no one,
            # and a late answer still goes out.
            self._count(refused=False)
            item.estimate = now + alone
            return None
        if budget < alone:
            return Rejection(
                "deadline",
                f"deadline in {budget * 1000:.1f} ms cannot be met: a batch of its "
                f"{item.rows} row(s) alone takes ~{alone * 1000:.1f} ms",
                1.0,
            )
        # Its own rows are taken off the time left, not counted against the share: a lone
        # large request would be refused once the share fell, and keep it down.
        work, own_work = self.queues.work_ahead(item.priority, item.rows, queue)
        ahead = self._ahead(work, now, free_at, loop=not item.inner)
        own = own_work / (len(free_at) or 1)
        waits = learnt[1] + delays.loop_delay_s
        share = (1.0 if item.screened else self._share) * headroom
        if ahead > (budget - waits - own) * share * self._trust():
            self._hint = (now, work)
            return self._unmeetable(budget, ahead + own, waits, count=count)
        self._hint = (now, work + own_work)  # (admitted: its rows are ahead of the next one)
        self._count(refused=False)
        item.estimate = now + ahead + own + waits
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
        """See `Batcher.shed`."""
        self._now = now
        budget = deadline - now
        delays = self.delays
        if not queue:
            # It may be a cache hit, answered without the model, but it still waits for the
            # event loop to read, decode and answer what it holds.
            return self._refused_unread(budget, delays.loop_backlog_s, delays.loop_delay_s)
        if self.queues.queued >= self.max_queue:
            return self.queue_full()
        # A recent offer's count of the work queued is a high one for this request (work has
        # only been taken since): when it admits, that is the answer.
        at, work = self._hint
        if 0.0 <= now - at < _HINT_S:
            ahead = self._ahead(work, now, free_at)
            if ahead <= (budget - delays.learnt(now)[1] - delays.loop_delay_s) * self._share:
                return None
        work = self.queues.work_ahead(priority, 0, None)[0]
        waits = delays.learnt(now)[1] + delays.loop_delay_s
        return self._refused_unread(budget, self._ahead(work, now, free_at), waits)

    def wait_s(self, now: float, free_at: Sequence[float], priority: int) -> float:
        """How long a request of ``priority`` offered now would wait for what is ahead."""
        return self._ahead(self.queues.work_ahead(priority, 0, None)[0], now, free_at)

    def refused(self) -> None:
        """A request was refused on the word of an earlier shed."""
        self._count(refused=True)

    def _ahead(
        self, work: float, now: float, free_at: Sequence[float], *, loop: bool = True
    ) -> float:
        """The wait for what is ahead: the instances' remaining busy time and the ``work``
        queued, shared between the instances, or (``loop``) the event loop's backlog where
        longer."""
        busy = 0.0
        for at in free_at:
            if at > now:
                busy += at - now
        # The loop's backlog and the model's queue drain at the same time: the wait is the
        # longer of them (their sum would count a request queued for the model twice).
        ahead = (busy + work) / (len(free_at) or 1)
        backlog = self.delays.loop_backlog_s if loop else 0.0
        return ahead if ahead > backlog else backlog

    def _nothing_ahead(
        self, item: Item, queue: ClassQueue, now: float, free_at: Sequence[float]
    ) -> bool:
        """No work queued at ``item``'s priority or higher and no instance busy. (The event
        loop's backlog is not asked: it counts the requests in flight, ``item`` among them, so
        it is never nothing while ``item`` waits for an answer.)"""
        work = self.queues.work_ahead(item.priority, item.rows, queue)[0]
        return self._ahead(work, now, free_at, loop=False) <= 0.0

    def _refused_unread(self, budget: float, queueing: float, waits: float) -> Rejection | None:
        """The shed's answer for a request with ``budget`` left, ``queueing`` ahead of it and
        ``waits`` besides. With nothing ahead there is no wait to refuse it for, however little
        time it has left (a stall on its way in): once read, its offer judges it alone."""
        if queueing <= 0.0:
            return None
        if queueing > (budget - waits) * self._share * self._trust():
            rejection = self._unmeetable(budget, queueing, waits)
            if self._share > self.admission_target + 1e-9:
                return rejection
            # Overloaded (the share at its floor): for a moment, a request with less time left
            # than this one's least would be refused too, and may be without asking again.
            least = queueing / self._share + waits
            return dataclasses.replace(rejection, reusable_s=_REUSE_S, least_budget_s=least)
        return None

    def _unmeetable(
        self, budget: float, queueing: float, waits: float, *, count: bool = True
    ) -> Rejection:
        """A refusal for the wait ahead, saying what makes it up and what share of the budget
        it may take."""
        if count:
            self._count(refused=True)
        wait = queueing + waits
        backlog = self.delays.loop_backlog_s
        return Rejection(
            "deadline",
            f"deadline in {budget * 1000:.1f} ms cannot be met: the work queued ahead needs "
            f"~{wait * 1000:.1f} ms (the longer of the model's queue and the event loop's "
            f"backlog, {backlog * 1000:.1f}: {queueing * 1000:.1f}; other delays "
            f"{waits * 1000:.1f}; the queue may take {self._share:.0%} of the time the "
            "delays leave)",
            wait,
        )

    def _trust(self) -> float:
        """How far the evidence stretches the allowance for the predicted wait: the admitted
        requests answered well within the SLO say the prediction reads high."""
        return _COMFORTABLE_STRETCH if self._needless() else 1.0

    def _needless(self) -> bool:
        return self.audit is not None and self.audit.needless(self._now, self.delays.loop_busy)

    def _count(self, *, refused: bool) -> None:
        if refused and self._needless():
            return  # a false refusal: the share stays (see the module's docstring)
        if not refused and self.refusals <= _REFUSALS_NONE:
            if self.refusals:  # (faded to nothing: the share is whole again)
                self.refusals, self._share = 0.0, 1.0
            return
        refusals = self.refusals = self.refusals + _REFUSAL_RATE * (refused - self.refusals)
        if refusals >= _OVERLOADED_AT:
            self._share = self.admission_target
        else:
            self._share = 1.0 - (1.0 - self.admission_target) * (refusals / _OVERLOADED_AT)
