"""The batch scheduler of one model version: a batcher and one worker task per instance.

The scheduler owns the asyncio side of batching; *what* to run and *when* is the batcher's call
(`engine.batching`, `engine.deadline_batcher`). Padding, merging a batch, running the model and
splitting the result happen in an executor thread, so the event loop only moves futures.

Except for a batch the cost model predicts to take at most ``inline_below_s`` on a ``steady``
runtime (compute alone, no sleeps or I/O): it runs on the event loop's own thread when the
instance's thread is idle, since handing it over costs more than running it
(docs/decisions/0006-worker-event-loop.md); the loop then yields before the next batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from tailserve.engine.accounts import BatchObserver, BatchRecord, BatchStats, LoopState
from tailserve.engine.background import BackgroundLane
from tailserve.engine.batching import Batcher, Item, Rejection
from tailserve.engine.buckets import Bucket, pad_parts
from tailserve.engine.instances import Instance
from tailserve.engine.refusal_audit import RefusalAudit
from tailserve.engine.stats import ModelStats
from tailserve.engine.variants import VariantChooser, loop_pressure
from tailserve.errors import (
    DeadlineExceeded,
    DeadlineUnmeetable,
    ModelExecutionError,
    ModelNotReady,
    Overloaded,
    TailserveError,
)
from tailserve.runtimes import Arrays, Runtime

log = logging.getLogger(__name__)


# Batches an instance may hold: the one running and the next, queued in its thread so that
# it starts the moment the first ends, not when the (busy) event loop gets round to it.
_LOOKAHEAD = 2
_MAX_HANDOFF_S = 0.02
_MIN_WINDOW_S = 0.0005
_Reply = tuple[Arrays, BatchStats]  # a request's rows of the outputs, and how it was served


class _Pending:
    __slots__ = ("future", "inputs")

    def __init__(self, inputs: Arrays, future: asyncio.Future[tuple[Arrays, BatchStats]]):
        self.inputs = inputs
        self.future = future


class Scheduler:
    def __init__(
        self,
        *,
        model: str,
        runtimes: Sequence[Runtime | Sequence[Runtime]],
        batcher: Batcher,
        batched: bool,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        loop: LoopState | None = None,
        inline_below_s: float = 0.0,
        background: BackgroundLane | None = None,
        variants: VariantChooser | None = None,
        audit: RefusalAudit | None = None,
    ) -> None:
        """``runtimes``: per instance, its runtime, or one per variant of the model (in the
        order of ``variants``, whose policy then chooses per request)."""
        self._model = model
        self.variants = variants if variants is not None and len(variants) > 1 else None
        # Jobs' work, run only in the time online requests leave free (engine/background.py).
        self.background = (
            background if background is not None else BackgroundLane(budget_s=0.0, max_rows=1)
        )
        self._inline_below_s = inline_below_s
        self.best_rows = 1  # the largest batch it may run: the cheapest a row (served.py sets it)
        self.inline_batches = 0
        # Cost classes whose cost has been measured (a class once measured stays so).
        self._measured: set[str] = set()
        instances = [[r] if not isinstance(r, Sequence) else list(r) for r in runtimes]
        self._batcher = batcher
        self._batched = batched
        self._observer = observer
        self._clock = clock
        # What the admitted requests met, to judge each refusal (engine/refusal_audit.py).
        self.audit = audit
        self._loop = loop
        self.stats = ModelStats()
        # Workers asleep: idle (an arrival may give them a batch), or busy (it cannot).
        self._waiters: set[asyncio.Future[None]] = set()
        self._busy_waiters: set[asyncio.Future[None]] = set()
        self._workers: list[asyncio.Task[None]] = []
        self._instances = [Instance(model, i, forms) for i, forms in enumerate(instances)]
        # How long the loop takes to pick a finished batch's results up (moving average).
        self._handoff_s = 0.0005
        self._closing = False

    @property
    def queue_depth(self) -> int:
        return len(self._batcher)

    @property
    def busy_instances(self) -> int:
        return sum(1 for instance in self._instances if instance.outstanding)

    @property
    def batcher(self) -> Batcher:
        return self._batcher

    def start(self) -> None:
        for instance in self._instances:
            task = asyncio.create_task(
                self._worker(instance), name=f"{self._model}-instance-{instance.index}"
            )
            self._workers.append(task)

    def seed(self, bucket: Bucket, rows: int, seconds: float, variant: int = 0) -> None:
        """A warm-up batch's time (on ``variant``): the cost model starts from a measurement."""
        if self.variants is not None:
            bucket = bucket.on(variant, self.variants.names[variant])
        self._batcher.observe(bucket, rows, seconds, -1.0)

    def shed(self, *, deadline: float, priority: int = 1, queue: bool = True) -> None:
        """Refuse now, before the request is read, if even its least form would be refused
        (not ``queue``: for the event loop's backlog alone; it may be a cache hit)."""
        if self._closing:
            raise ModelNotReady(f"model {self._model!r} is unloading", retry_after_s=1.0)
        now = self._clock()
        self._read_loop()
        rejection = self._batcher.shed(
            now, self._free_times(now), deadline=deadline, priority=priority, queue=queue
        )
        if rejection is not None:
            self._refuse(rejection, deadline=deadline, now=now)

    def pressed(self, budget_s: float) -> bool:
        """Whether the model is overloaded now for requests of ``budget_s`` (deadline policy:
        refusing lately, or queued past admission's allowance; others: a queue half full)."""
        now = self._clock()
        pressed = getattr(self._batcher, "pressed", None)
        if pressed is not None:
            self._read_loop()
            return bool(pressed(now, self._free_times(now), budget_s))
        bound = getattr(self._batcher, "max_queue", 0)
        return bool(bound) and len(self._batcher) * 2 >= bound

    def wait_s(self) -> float:
        """How long a request offered now would queue (the deadline policy's estimate, else 0)."""
        wait = getattr(self._batcher, "wait_s", None)
        now = self._clock()
        return float(wait(now, self._free_times(now))) if wait is not None else 0.0

    def refused(self) -> None:
        """Count a request refused on the word of an earlier shed (`DeadlineUnmeetable.
        reusable_until`): in the statistics, the metrics and the batcher's share of refusals."""
        self._count_rejection("deadline")
        self.stats.refusals_reused += 1
        self._batcher.refused()

    def answered(self, latency_s: float) -> None:
        """An admitted request was answered ``latency_s`` after it arrived."""
        if self.audit is not None:
            self.audit.on_answer(latency_s, self._clock())

    def _count_rejection(self, reason: str) -> None:
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        busy = self._loop.busy if self._loop is not None else 0.0
        needless = self.audit is not None and self.audit.needless(self._clock(), busy)
        self.stats.false_refusals += needless
        if self._observer is not None:
            self._observer.on_reject(self._model, reason, needless=needless)

    def _read_loop(self) -> None:
        """Tell the batcher how late and how busy the event loop is now."""
        if self._loop is not None:
            self._batcher.loop_delay_s = self._loop.lag_s
            self._batcher.loop_busy = self._loop.busy
            self._batcher.loop_backlog_s = self._loop.backlog_s

    def _refuse(self, rejection: Rejection, *, deadline: float = 0.0, now: float = 0.0) -> NoReturn:
        self._count_rejection(rejection.reason)
        message = f"model {self._model!r}: {rejection.message}"
        self.stats.recent_rejections.append(f"{rejection.reason}: {rejection.message}")
        if rejection.reason == "queue_full":
            raise Overloaded(message, retry_after_s=rejection.retry_after_s)
        raise DeadlineUnmeetable(
            message,
            retry_after_s=rejection.retry_after_s,
            deadline=deadline,
            least_budget_s=rejection.least_budget_s,
            reusable_until=now + rejection.reusable_s if rejection.reusable_s else 0.0,
        )

    async def infer(
        self,
        inputs: Arrays,
        rows: int,
        bucket: Bucket,
        *,
        deadline: float = math.inf,
        priority: int = 1,
        hard_deadline: bool = False,
        screened: bool = False,
        inner: bool = False,
        variant: int | None = None,
    ) -> tuple[Arrays, BatchStats]:
        """Queue a request and wait for its answer. A model with variants chooses the one to
        run it (engine/variants.py), unless ``variant`` names one."""
        if self._closing:
            raise ModelNotReady(f"model {self._model!r} is unloading", retry_after_s=1.0)
        now = self._clock()
        future: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        item = Item(
            rows,
            bucket,
            now,
            deadline,
            priority,
            _Pending(inputs, future),
            hard=hard_deadline,
            screened=screened or inner,
            inner=inner,
        )
        self._read_loop()
        if self.variants is None:
            rejection = self._batcher.offer(item, now, self._free_times(now))
        else:
            rejection = self._offer_variants(item, now, variant)
        if rejection is not None:
            self._refuse(rejection)
        if self._batcher.poll_soon:  # (else the time the last poll gave still stands)
            self._wake(arrival=True)
        try:
            result = await future
        except TailserveError:
            self.stats.on_fail(self._clock() - now)
            raise
        self.stats.on_success(self._clock() - now, result[1].queue_s)
        return result

    def _offer_variants(self, item: Item, now: float, pinned: int | None) -> Rejection | None:
        """Offer ``item`` as the variants' policy orders: on refusal for its deadline, to the
        next cheaper variant; only the last refusal counts as one."""
        chooser = self.variants
        assert chooser is not None
        free_at = self._free_times(now)
        base = item.bucket
        if pinned is not None:
            item.bucket = base.on(pinned, chooser.names[pinned])
            return self._batcher.offer(item, now, free_at)
        buckets = [base.on(v, name) for v, name in enumerate(chooser.names)]
        size = max(1, round(chooser.batch_rows))
        predict = self._batcher.predict
        costs = [predict(bucket, size) / size * item.rows for bucket in buckets]
        loop = self._loop
        pressure = 0.0
        if loop is not None:
            pressure = loop_pressure(loop.lag_s, loop.busy, getattr(loop, "host_idle", 1.0))
        order = chooser.order(now, costs, pressure)
        rejection = None
        for position, (index, headroom) in enumerate(order):
            item.bucket = buckets[index]
            last = position == len(order) - 1
            rejection = self._batcher.offer(item, now, free_at, final=last, headroom=headroom)
            if rejection is None or rejection.reason != "deadline":
                return rejection
        return rejection

    async def infer_background(
        self, inputs: Arrays, rows: int, bucket: Bucket
    ) -> tuple[Arrays, BatchStats]:
        """Run a job's piece in the background lane: no admission, no deadline; it waits for
        an idle instance and an empty online queue."""
        if self._closing:
            raise ModelNotReady(f"model {self._model!r} is unloading", retry_after_s=1.0)
        future: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        if self.variants is not None:
            bucket = bucket.on(0, self.variants.names[0])
        self.background.add(Item(rows, bucket, self._clock(), payload=_Pending(inputs, future)))
        self._wake(arrival=True)
        return await future

    def predict(self, bucket: Bucket, rows: int) -> float:
        """The cost model's time for ``rows`` of ``bucket`` (on the first variant), seconds."""
        if self.variants is not None and bucket.variant == 0:
            bucket = bucket.on(0, self.variants.names[0])
        return self._batcher.predict(bucket, rows)

    async def close(self, drain_s: float | None = None) -> None:
        """Stop taking requests, run what is queued, wait for the instances, then free them."""
        self._closing = True
        self._wake()
        if self._workers:
            _, pending = await asyncio.wait(self._workers, timeout=drain_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for item in [*self._batcher.drain(), *self.background.drain()]:
            _fail([item], ModelNotReady(f"model {self._model!r} was unloaded"))
        for instance in self._instances:
            instance.executor.shutdown(wait=False)

    # --- the instance loop ---------------------------------------------------------------

    def _free_times(self, now: float, polling: Instance | None = None) -> list[float]:
        # A batch that overruns its prediction reads as "free now": the estimate, not a promise.
        return [now if i is polling else max(i.free_at, now) for i in self._instances]

    async def _worker(self, instance: Instance) -> None:
        while True:
            now = self._clock()
            if instance.outstanding:
                # Busy: the next batch is handed over only just before this one is due to end
                # (so that it takes what arrives meanwhile): within twice the loop's recent
                # hand-off time, as the loop may be that late to wake. Not at all once the
                # running batch has overrun its prediction by far more than its usual noise
                # (a stall: what waits may yet expire).
                ahead = instance.free_at - now
                # (At most half the running batch's time: a cheap batch handed a successor at
                # once would leave it nothing to gather.)
                window = min(2 * self._handoff_s + _MIN_WINDOW_S, instance.predicted / 2)
                if instance.outstanding >= _LOOKAHEAD or -ahead > window + instance.predicted:
                    await self._sleep(None, busy=True)
                    continue
                if ahead > window:
                    await self._sleep(instance.free_at - window, busy=True)
                    continue
            try:
                poll = self._batcher.poll(
                    now, self._free_times(now, instance), draining=self._closing
                )
            except Exception as exc:
                # A policy bug must not strand the queue (nothing else would poll it): what
                # is queued fails with a 500 that says so, and the worker carries on.
                log.exception("the batcher of model %r failed", self._model)
                failure = ModelExecutionError(f"model {self._model!r}: batching failed: {exc}")
                _fail(self._batcher.drain(), failure)
                await asyncio.sleep(0)
                continue
            if poll.expired:
                self._expire(poll.expired, now)
            batch = [item for item in poll.batch if not item.payload.future.done()]
            if batch:
                if self._submit(instance, batch, now):
                    await asyncio.sleep(0)  # ran on the loop: let it read what has come
            elif poll.batch:
                continue  # every member had gone (client disconnects): look again
            elif self._closing and not len(self._batcher):
                if instance.tasks:
                    await asyncio.wait(instance.tasks)
                return
            elif self._run_background(instance, now):
                await asyncio.sleep(0)
            else:
                await self._sleep(poll.wait_until)

    def _run_background(self, instance: Instance, now: float) -> bool:
        """Give an idle instance a batch of the background lane while no online request is
        queued; whether it took one."""
        if not self.background or instance.outstanding or len(self._batcher):
            return False
        idle_others = sum(1 for i in self._instances if i is not instance and not i.outstanding)
        batch = self.background.take(
            self._batcher.predict, idle_others=idle_others, instances=len(self._instances)
        )
        if not batch:
            return False
        self._submit(instance, batch, now)
        return True

    def _submit(self, instance: Instance, batch: list[Item], now: float) -> bool:
        """Run ``batch`` on ``instance``: answers True when it ran there and then, on the loop
        (cheap, and nothing in the instance's thread), False when handed to the thread."""
        bucket = batch[0].bucket
        rows = sum(item.rows for item in batch)
        predicted = self._batcher.predict(bucket, rows)
        if (
            instance.steady
            and not instance.outstanding
            and predicted <= self._inline_below_s
            and self._known(bucket)
        ):
            self.inline_batches += 1
            self._run_inline(instance, batch, bucket, rows, predicted)
            return True
        instance.outstanding += 1
        instance.free_at = max(instance.free_at, now) + predicted
        instance.predicted = predicted
        task = asyncio.get_running_loop().create_task(
            self._run(instance, batch, bucket, rows, predicted)
        )
        instance.tasks.add(task)
        task.add_done_callback(instance.tasks.discard)
        return False

    def _known(self, bucket: Bucket) -> bool:
        """Whether the class's cost has been measured (not the model's first guess)."""
        if bucket.label not in self._measured:
            cost = self._batcher.costs().get(bucket.label)
            if cost is None or not cost.observations:
                return False
            self._measured.add(bucket.label)
        return True

    def _expire(self, items: list[Item], now: float) -> None:
        self.stats.rejected["expired"] = self.stats.rejected.get("expired", 0) + len(items)
        for item in items:
            if self._observer is not None:
                self._observer.on_reject(self._model, "expired")
            late = (now - item.deadline) * 1000.0
            _fail(
                [item],
                DeadlineExceeded(
                    f"model {self._model!r}: the request's deadline can no longer be met "
                    f"(it waited {(now - item.enqueued_at) * 1000:.1f} ms; "
                    f"{'past it by ' + format(late, '.1f') + ' ms' if late > 0 else 'too close'})"
                ),
            )

    async def _sleep(self, until: float | None, *, busy: bool = False) -> None:
        """Wait for a new arrival (not ``busy``), a finished batch, or until the clock reaches
        ``until``."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        waiters = self._busy_waiters if busy else self._waiters
        waiters.add(waiter)
        timer = None
        if until is not None:
            timer = loop.call_later(max(0.0, until - self._clock()), _resolve, waiter)
        try:
            await waiter
        finally:
            waiters.discard(waiter)
            if timer is not None:
                timer.cancel()

    def _wake(self, *, arrival: bool = False) -> None:
        for waiter in self._waiters:
            _resolve(waiter)
        if not arrival:
            for waiter in self._busy_waiters:
                _resolve(waiter)

    async def _run(
        self, instance: Instance, batch: list[Item], bucket: Bucket, rows: int, predicted: float
    ) -> None:
        loop = asyncio.get_running_loop()
        dispatched = self._clock()
        try:
            outputs, started, ended = await loop.run_in_executor(
                instance.executor, self._execute, instance.runtimes[bucket.variant], batch, bucket
            )
        except Exception as exc:
            self._failed(batch, exc)
            return
        finally:
            instance.outstanding -= 1
            if not instance.outstanding:
                instance.free_at = 0.0
            # This instance (or another, waiting on its time) may take the next batch now.
            self._wake()
        self._answer(batch, bucket, rows, predicted, outputs, started, ended, dispatched)

    def _run_inline(
        self, instance: Instance, batch: list[Item], bucket: Bucket, rows: int, predicted: float
    ) -> None:
        dispatched = self._clock()
        try:
            outputs, started, ended = self._execute(
                instance.runtimes[bucket.variant], batch, bucket
            )
        except Exception as exc:
            self._failed(batch, exc)
            return
        finally:
            self._wake()  # another instance, waiting on this one's time, may go now
        self._answer(batch, bucket, rows, predicted, outputs, started, ended, dispatched)

    def _failed(self, batch: list[Item], exc: Exception) -> None:
        if isinstance(exc, TailserveError):
            _fail(batch, exc)
            return
        log.exception(
            "model %r failed on a batch of %d requests", self._model, len(batch), exc_info=exc
        )
        _fail(batch, ModelExecutionError(f"model {self._model!r} failed: {exc}"))

    def _answer(
        self,
        batch: list[Item],
        bucket: Bucket,
        rows: int,
        predicted: float,
        outputs: list[Arrays],
        started: float,
        ended: float,
        dispatched: float,
    ) -> None:
        """Resolve a batch's members with their rows of the outputs, and learn from it."""
        done = self._clock()
        compute_s = ended - started
        # What the loop added: picking the results up after the thread was done.
        handoff = max(0.0, done - ended)
        self._handoff_s += 0.05 * (min(handoff, _MAX_HANDOFF_S) - self._handoff_s)
        best = max(rows, self.best_rows)
        best_s_per_row = self._batcher.predict(bucket, best) / best  # (before learning this one)
        self._batcher.observe(bucket, rows, compute_s, handoff, done)
        self.stats.on_batch(rows, compute_s)
        variant = ""
        if self.variants is not None:
            variant = self.variants.names[bucket.variant]
            self.variants.batched(rows)
        queue_times = [started - item.enqueued_at for item in batch]
        missed = 0
        for item, part, queue_s in zip(batch, outputs, queue_times, strict=True):
            missed += done > item.deadline
            self._batcher.completed(item, done)
            future = item.payload.future
            if not future.done():
                future.set_result(
                    (part, BatchStats(queue_s, compute_s, rows, bucket.label, variant))
                )
        self.stats.deadline_misses += missed
        if self._observer is not None:
            self._observer.on_batch(
                BatchRecord(
                    self._model,
                    bucket.label,
                    rows,
                    compute_s,
                    done - dispatched,
                    predicted,
                    queue_times,
                    missed,
                    variant,
                    [item.rows for item in batch],
                    best_s_per_row,
                )
            )

    def _execute(
        self, runtime: Runtime, batch: list[Item], bucket: Bucket
    ) -> tuple[list[Arrays], float, float]:
        """In the instance's thread (or on the loop, for a cheap batch): pad and merge the
        requests, predict, split the rows back.

        Returns the parts and when (on the scheduler's clock) it began and ended."""
        started = self._clock()
        parts: list[Arrays] = [item.payload.inputs for item in batch]
        sizes = [item.rows for item in batch]
        if bucket.pad is not None and (len(parts) > 1 or bucket.pad.length is not None):
            parts = pad_parts(parts, bucket.pad)
        if len(parts) == 1:
            result = runtime.predict(parts[0])
            return [result], started, self._clock()
        if not self._batched:
            raise ModelExecutionError(f"model {self._model!r} takes no batches")
        merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        result = runtime.predict(merged)
        total = sum(sizes)
        split: list[Arrays] = [{} for _ in parts]
        for name, array in result.items():
            if len(array) != total:
                raise ModelExecutionError(
                    f"model {self._model!r}: output {name!r} has {len(array)} rows "
                    f"for a batch of {total}"
                )
            offset = 0
            for position, size in enumerate(sizes):
                split[position][name] = array[offset : offset + size]
                offset += size
        return split, started, self._clock()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _fail(batch: list[Item], exc: Exception) -> None:
    for item in batch:
        future: Any = item.payload.future
        if not future.done():
            future.set_exception(exc)
