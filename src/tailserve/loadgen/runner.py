"""The open-loop sender: each request goes at its intended time, whatever came back before.

A timer fires at each due time and hands every request then due to the sender (HTTP or gRPC:
`loadgen.sending`); no request waits for an earlier one's reply (a request may wait for a free
connection only when all ``connections`` are busy, or behind a stream's flow control, and that
wait is the server's doing, so it counts). Latency is
measured from the *intended* send time, so a server that stalls cannot hide the stall in a
handful of slow samples (coordinated omission).

The runner also measures itself: how late the timer handed each request over (``lag``). A
generator that cannot keep its schedule says so instead of reporting a quiet server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.loadgen.plan import Plan
from tailserve.loadgen.sending import LOST, Link, Sender, Served
from tailserve.loadgen.timer import timer

F64 = np.ndarray[Any, np.dtype[np.float64]]
I32 = np.ndarray[Any, np.dtype[np.int32]]


@dataclass(slots=True)
class Samples:
    """One entry per request of the plan, times in seconds from the run's start."""

    intended: F64
    dispatched: F64  # when the timer handed it to the sender (intended + generator lag)
    done: F64  # when the response (or the error) came; NaN if never
    status: I32  # the outcome: an HTTP status, a gRPC one, TIMEOUT... (`loadgen.sending`)
    classes: I32
    queue_us: I32  # the server's account, -1 where it gave none
    compute_us: I32
    batch_size: I32
    cache: np.ndarray[Any, np.dtype[np.int8]]  # index into CACHE_TIERS, 0 where none given

    @classmethod
    def empty(cls, plan: Plan) -> Samples:
        n = len(plan)
        return cls(
            intended=plan.offsets.astype(np.float64, copy=True),
            dispatched=np.full(n, np.nan),
            done=np.full(n, np.nan),
            status=np.zeros(n, dtype=np.int32),
            classes=plan.classes.astype(np.int32, copy=True),
            queue_us=np.full(n, -1, dtype=np.int32),
            compute_us=np.full(n, -1, dtype=np.int32),
            batch_size=np.full(n, -1, dtype=np.int32),
            cache=np.zeros(n, dtype=np.int8),
        )

    @classmethod
    def merge(cls, parts: list[Samples]) -> Samples:
        merged = cls(
            **{name: np.concatenate([getattr(p, name) for p in parts]) for name in cls.__slots__}
        )
        order = np.argsort(merged.intended, kind="stable")
        return cls(**{name: getattr(merged, name)[order] for name in cls.__slots__})

    @property
    def latency(self) -> F64:
        """From the intended send time, or the actual one where that came (slightly) first."""
        result: F64 = self.done - np.fmin(self.intended, self.dispatched)
        return result


@dataclass(frozen=True, slots=True)
class Tick:
    """A progress report: counts so far and the latencies (s) completed since the last one."""

    sent: int
    completed: int
    errors: int
    latencies: F64
    lag_max_s: float


class Runner:
    def __init__(
        self,
        plan: Plan,
        link: Link,
        *,
        on_tick: Callable[[Tick], None] | None = None,
        tick_s: float = 1.0,
        fine_timer: bool = True,
    ) -> None:
        self.plan = plan
        self.link = link
        self.timeout_s = link.timeout_s
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.fine_timer = fine_timer
        self.samples = Samples.empty(plan)
        self.cpu_s = 0.0

    async def run(self, start_at: float | None = None) -> Samples:
        """Send the plan; ``start_at`` is the `time.monotonic()` of offset 0 (default: now).

        The monotonic clock is one clock for every process of the machine, so several
        generator processes can share a start; the loop's own clock is coarser (uvloop's
        counts milliseconds), so sends are timed by `tailserve.loadgen.timer`.
        """
        loop = asyncio.get_running_loop()
        start = time.monotonic() if start_at is None else start_at
        state = _State(self, loop, start)
        state.sender = self.link.open(loop, state.complete)
        cpu_before = time.process_time()
        try:
            if len(self.plan):
                state.schedule_fire()
                state.ticker = loop.call_later(self.tick_s, state.tick)
                # Every request ends by its timeout; past that (and a margin) something is
                # stuck, and what is left counts as lost.
                limit = start + float(self.plan.offsets[-1]) + self.timeout_s + 5.0
                await asyncio.wait([state.finished], timeout=max(0.0, limit - time.monotonic()))
                state.ticker.cancel()
                state.tick(final=True)
        finally:
            state.timer.close()
            await state.sender.close()
        lost = np.isnan(self.samples.done)
        self.samples.status[lost & (self.samples.status == 0)] = LOST
        self.cpu_s = time.process_time() - cpu_before
        return self.samples


class _State:
    """The run's moving parts: the next request to fire, counts, the completion future."""

    sender: Sender

    def __init__(self, runner: Runner, loop: asyncio.AbstractEventLoop, start: float):
        self.runner = runner
        self.loop = loop
        self.start = start
        self.due = (runner.plan.offsets + start).tolist()
        self.requests = runner.plan.requests
        self.samples = runner.samples
        self.next = 0
        self.completed = 0
        self.errors = 0
        self.recent: list[float] = []
        self.lag_max = 0.0
        self.ticker: asyncio.TimerHandle | None = None
        self.finished: asyncio.Future[None] = loop.create_future()
        self.timer = timer(loop, self.fire, fine=runner.fine_timer)

    def fire(self) -> None:
        """Hand over every request now due, then sleep until the next one is."""
        now = time.monotonic()
        due, n = self.due, len(self.due)
        i = self.next
        dispatched = self.samples.dispatched
        send = self.sender.send
        requests = self.requests
        # A timer may fire a little early, and one wake-up per request costs more than it is
        # worth at high rates: what is due within the timer's resolution goes now. Those
        # requests leave early by less than that, and their latency counts from the send.
        horizon = now + self.timer.resolution
        while i < n and due[i] <= horizon:
            dispatched[i] = now - self.start
            send(i, requests[i])
            i += 1
        if i > self.next:
            self.lag_max = max(self.lag_max, now - due[self.next])
        self.next = i
        if i < n:
            self.schedule_fire()

    def schedule_fire(self) -> None:
        self.timer.at(self.due[self.next])

    def complete(self, i: int, status: int, served: Served | None) -> None:
        now = time.monotonic() - self.start
        samples = self.samples
        samples.done[i] = now
        samples.status[i] = status
        if not 200 <= status < 400:
            self.errors += 1
        if served is not None:
            samples.queue_us[i] = served.queue_us
            samples.compute_us[i] = served.compute_us
            samples.batch_size[i] = served.batch_size
            samples.cache[i] = served.cache
        if self.runner.on_tick is not None:
            self.recent.append(now - min(samples.intended[i], samples.dispatched[i]))
        self.completed += 1
        if self.completed == len(self.due) and not self.finished.done():
            self.finished.set_result(None)

    def tick(self, final: bool = False) -> None:
        if self.runner.on_tick is not None:
            latencies = np.array(self.recent, dtype=np.float64)
            self.recent = []
            self.runner.on_tick(
                Tick(self.next, self.completed, self.errors, latencies, self.lag_max)
            )
        if not final:
            self.ticker = self.loop.call_later(self.runner.tick_s, self.tick)
