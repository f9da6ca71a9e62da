"""The batch scheduler of one model version: a batcher and one worker task per instance.

The scheduler owns the asyncio side of batching; *what* to run and *when* is the batcher's call
(`engine.batching`, `engine.deadline`). Padding, merging a batch, running the model and
splitting the result happen in an executor thread, so the event loop only moves futures.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tailserve.engine.batching import Batcher, Item
from tailserve.engine.buckets import Bucket, pad_parts
from tailserve.engine.stats import ModelStats
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


@dataclass(frozen=True, slots=True)
class BatchStats:
    """How one request was served: its wait in the queue, its batch's run time and size."""

    queue_s: float
    compute_s: float
    batch_size: int


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch run, for the metrics."""

    model: str
    bucket: str
    rows: int
    compute_s: float  # in the runtime (merge, predict, split)
    wall_s: float  # from dispatch until the results were back on the loop
    predicted_s: float
    queue_s: Sequence[float]
    missed: int  # members answered after their deadline


class BatchObserver(Protocol):
    def on_batch(self, record: BatchRecord) -> None: ...

    def on_reject(self, model: str, reason: str) -> None: ...


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
        runtimes: Sequence[Runtime],
        batcher: Batcher,
        batched: bool,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._model = model
        self._runtimes = list(runtimes)
        self._batcher = batcher
        self._batched = batched
        self._observer = observer
        self._clock = clock
        self.stats = ModelStats()
        self._waiters: set[asyncio.Future[None]] = set()
        self._workers: list[asyncio.Task[None]] = []
        # When each instance is predicted to be free again (0: it is free now).
        self._free_at = [0.0] * len(self._runtimes)
        self._executor = ThreadPoolExecutor(
            max_workers=len(self._runtimes), thread_name_prefix=f"tailserve-{model}"
        )
        self._closing = False

    @property
    def queue_depth(self) -> int:
        return len(self._batcher)

    @property
    def busy_instances(self) -> int:
        now = self._clock()
        return sum(1 for at in self._free_at if at > now)

    @property
    def batcher(self) -> Batcher:
        return self._batcher

    def start(self) -> None:
        for index, runtime in enumerate(self._runtimes):
            task = asyncio.create_task(
                self._worker(index, runtime), name=f"{self._model}-instance-{index}"
            )
            self._workers.append(task)

    def seed(self, bucket: Bucket, rows: int, seconds: float) -> None:
        """A warm-up batch's time, so the cost model starts from a measurement."""
        self._batcher.observe(bucket, rows, seconds, -1.0)

    async def infer(
        self,
        inputs: Arrays,
        rows: int,
        bucket: Bucket,
        *,
        deadline: float = math.inf,
        priority: int = 1,
        hard_deadline: bool = False,
    ) -> tuple[Arrays, BatchStats]:
        if self._closing:
            raise ModelNotReady(f"model {self._model!r} is unloading", retry_after_s=1.0)
        now = self._clock()
        future: asyncio.Future[tuple[Arrays, BatchStats]] = (
            asyncio.get_running_loop().create_future()
        )
        item = Item(rows, bucket, now, deadline, priority, _Pending(inputs, future),
                    hard=hard_deadline)  # fmt: skip
        rejection = self._batcher.offer(item, now, self._free_times(now))
        if rejection is not None:
            self.stats.rejected[rejection.reason] = self.stats.rejected.get(rejection.reason, 0) + 1
            if self._observer is not None:
                self._observer.on_reject(self._model, rejection.reason)
            message = f"model {self._model!r}: {rejection.message}"
            if rejection.reason == "queue_full":
                raise Overloaded(message, retry_after_s=rejection.retry_after_s)
            raise DeadlineUnmeetable(message, retry_after_s=rejection.retry_after_s)
        self._wake()
        try:
            result = await future
        except TailserveError:
            self.stats.on_fail(self._clock() - now)
            raise
        self.stats.on_success(self._clock() - now, result[1].queue_s)
        return result

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
        for item in self._batcher.drain():
            _fail([item], ModelNotReady(f"model {self._model!r} was unloaded"))
        self._executor.shutdown(wait=False)

    # --- the instance loop ---------------------------------------------------------------

    def _free_times(self, now: float) -> list[float]:
        # A batch that overruns its prediction reads as "free now": the estimate, not a promise.
        return [max(at, now) for at in self._free_at]

    async def _worker(self, index: int, runtime: Runtime) -> None:
        while True:
            now = self._clock()
            poll = self._batcher.poll(now, self._free_times(now), draining=self._closing)
            if poll.expired:
                self._expire(poll.expired, now)
            batch = [item for item in poll.batch if not item.payload.future.done()]
            if batch:
                await self._run(index, runtime, batch)
            elif poll.batch:
                continue  # every member had gone (client disconnects): look again
            elif self._closing and not len(self._batcher):
                return
            else:
                await self._sleep(poll.wait_until)

    def _expire(self, items: list[Item], now: float) -> None:
        self.stats.rejected["expired"] = self.stats.rejected.get("expired", 0) + len(items)
        for item in items:
            if self._observer is not None:
                self._observer.on_reject(self._model, "expired")
            late = (now - item.deadline) * 1000.0
            _fail([item], DeadlineExceeded(
                f"model {self._model!r}: the request's deadline can no longer be met "
                f"(it waited {(now - item.enqueued_at) * 1000:.1f} ms; "
                f"{'past it by ' + format(late, '.1f') + ' ms' if late > 0 else 'too close'})"
            ))  # fmt: skip

    async def _sleep(self, until: float | None) -> None:
        """Wait for a new arrival, a free instance, or until the clock reaches ``until``."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.add(waiter)
        timer = None
        if until is not None:
            timer = loop.call_later(max(0.0, until - self._clock()), _resolve, waiter)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        for waiter in self._waiters:
            _resolve(waiter)

    async def _run(self, index: int, runtime: Runtime, batch: list[Item]) -> None:
        loop = asyncio.get_running_loop()
        bucket = batch[0].bucket
        rows = sum(item.rows for item in batch)
        predicted = self._batcher.predict(bucket, rows)
        started = self._clock()
        self._free_at[index] = started + predicted
        try:
            outputs, compute_s = await loop.run_in_executor(
                self._executor,
                self._execute,
                runtime,
                [item.payload.inputs for item in batch],
                [item.rows for item in batch],
                bucket,
            )
        except TailserveError as exc:
            _fail(batch, exc)
            return
        except Exception as exc:
            log.exception("model %r failed on a batch of %d requests", self._model, len(batch))
            _fail(batch, ModelExecutionError(f"model {self._model!r} failed: {exc}"))
            return
        finally:
            self._free_at[index] = 0.0
            # Another instance may be waiting on this one's time to start a deadline's batch.
            self._wake()
        done = self._clock()
        wall = done - started
        # The instance was busy for compute_s; the rest is the hand-off to and from its thread
        # (and the loop's own delay in picking the results up).
        self._batcher.observe(bucket, rows, compute_s, wall - compute_s)
        self.stats.on_batch(rows, compute_s)
        queue_times = [started - item.enqueued_at for item in batch]
        missed = 0
        for item, part, queue_s in zip(batch, outputs, queue_times, strict=True):
            missed += done > item.deadline
            future = item.payload.future
            if not future.done():
                future.set_result((part, BatchStats(queue_s, compute_s, rows)))
        self.stats.deadline_misses += missed
        if self._observer is not None:
            self._observer.on_batch(BatchRecord(self._model, bucket.label, rows, compute_s, wall,
                                                predicted, queue_times, missed))  # fmt: skip

    def _execute(
        self, runtime: Runtime, parts: list[Arrays], sizes: list[int], bucket: Bucket
    ) -> tuple[list[Arrays], float]:
        """In an executor thread: pad and merge the requests, predict, split the rows back."""
        started = time.perf_counter()
        if bucket.pad is not None and (len(parts) > 1 or bucket.pad.length is not None):
            parts = pad_parts(parts, bucket.pad)
        if len(parts) == 1:
            result = runtime.predict(parts[0])
            return [result], time.perf_counter() - started
        if not self._batched:
            raise ModelExecutionError(f"model {self._model!r} takes no batches")
        merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        result = runtime.predict(merged)
        compute_s = time.perf_counter() - started
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
        return split, compute_s


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _fail(batch: list[Item], exc: Exception) -> None:
    for item in batch:
        future: Any = item.payload.future
        if not future.done():
            future.set_exception(exc)
