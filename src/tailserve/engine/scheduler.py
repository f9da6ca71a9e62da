"""The batch scheduler of one model version: a bounded queue and one worker task per instance.

The scheduler owns the asyncio side of batching; *what* to run and *when* is the policy's call
(`engine.batching`). Merging a batch, running the model and splitting the result happen in an
executor thread, so the event loop only moves futures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tailserve.engine.batching import BatchPolicy
from tailserve.errors import ModelExecutionError, ModelNotReady, Overloaded, TailserveError
from tailserve.runtimes import Arrays, Runtime

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatchStats:
    """How one request was served: its wait in the queue, its batch's run time and size."""

    queue_s: float
    compute_s: float
    batch_size: int


class BatchObserver(Protocol):
    def on_batch(
        self, model: str, rows: int, compute_s: float, queue_s: Sequence[float]
    ) -> None: ...


class _Pending:
    __slots__ = ("enqueued_at", "future", "group", "inputs", "rows")

    def __init__(
        self, inputs: Arrays, rows: int, group: Hashable, enqueued_at: float, future: Any
    ) -> None:
        self.inputs = inputs
        self.rows = rows
        self.group = group
        self.enqueued_at = enqueued_at
        self.future: asyncio.Future[tuple[Arrays, BatchStats]] = future


class Scheduler:
    def __init__(
        self,
        *,
        model: str,
        runtimes: Sequence[Runtime],
        policy: BatchPolicy,
        max_queue_size: int,
        batched: bool,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._model = model
        self._runtimes = list(runtimes)
        self._policy = policy
        self._max_queue_size = max_queue_size
        self._batched = batched
        self._observer = observer
        self._clock = clock
        self._queue: deque[_Pending] = deque()
        self._waiters: set[asyncio.Future[None]] = set()
        self._workers: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(
            max_workers=len(self._runtimes), thread_name_prefix=f"tailserve-{model}"
        )
        self._closing = False
        self._busy = 0

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def busy_instances(self) -> int:
        return self._busy

    def start(self) -> None:
        for index, runtime in enumerate(self._runtimes):
            task = asyncio.create_task(
                self._worker(runtime), name=f"{self._model}-instance-{index}"
            )
            self._workers.append(task)

    async def infer(
        self, inputs: Arrays, rows: int, group: Hashable = ()
    ) -> tuple[Arrays, BatchStats]:
        if self._closing:
            raise ModelNotReady(f"model {self._model!r} is unloading", retry_after_s=1.0)
        if len(self._queue) >= self._max_queue_size:
            raise Overloaded(
                f"model {self._model!r}: queue is full ({self._max_queue_size} requests)",
                retry_after_s=1.0,
            )
        future: asyncio.Future[tuple[Arrays, BatchStats]] = (
            asyncio.get_running_loop().create_future()
        )
        self._queue.append(_Pending(inputs, rows, group, self._clock(), future))
        self._wake()
        return await future

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
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(ModelNotReady(f"model {self._model!r} was unloaded"))
        self._executor.shutdown(wait=False)

    # --- the instance loop ---------------------------------------------------------------

    async def _worker(self, runtime: Runtime) -> None:
        while True:
            self._drop_cancelled()
            if not self._queue:
                if self._closing:
                    return
                await self._sleep(None)
                continue
            decision = self._policy.decide(self._clock(), self._queue, draining=self._closing)
            if decision.take:
                batch = [self._queue.popleft() for _ in range(decision.take)]
                await self._run(runtime, batch)
            else:
                await self._sleep(decision.wait_until)

    def _drop_cancelled(self) -> None:
        # A caller that went away (client disconnect, server shutdown) cancels its future.
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()

    async def _sleep(self, until: float | None) -> None:
        """Wait for a new arrival or until the clock reaches ``until``."""
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

    async def _run(self, runtime: Runtime, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        started = self._clock()
        self._busy += 1
        try:
            outputs, compute_s = await loop.run_in_executor(
                self._executor,
                self._execute,
                runtime,
                [p.inputs for p in batch],
                [p.rows for p in batch],
            )
        except TailserveError as exc:
            _fail(batch, exc)
            return
        except Exception as exc:
            log.exception("model %r failed on a batch of %d requests", self._model, len(batch))
            _fail(batch, ModelExecutionError(f"model {self._model!r} failed: {exc}"))
            return
        finally:
            self._busy -= 1
        rows = sum(p.rows for p in batch)
        queue_times = [started - p.enqueued_at for p in batch]
        if self._observer is not None:
            self._observer.on_batch(self._model, rows, compute_s, queue_times)
        for pending, part, queue_s in zip(batch, outputs, queue_times, strict=True):
            if not pending.future.done():
                pending.future.set_result((part, BatchStats(queue_s, compute_s, rows)))

    def _execute(
        self, runtime: Runtime, parts: list[Arrays], sizes: list[int]
    ) -> tuple[list[Arrays], float]:
        """In an executor thread: merge the requests, predict, split the rows back."""
        started = time.perf_counter()
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
            for index, size in enumerate(sizes):
                split[index][name] = array[offset : offset + size]
                offset += size
        return split, compute_s


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _fail(batch: list[_Pending], exc: Exception) -> None:
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(exc)
