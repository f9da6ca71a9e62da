"""How late the event loop runs what is ready: a timer every few milliseconds, and how late it
fires. A request's task waits about that long before it runs and again before its answer goes
out; when the loop is saturated the wait grows, and admission control must count it, since
nothing else in the worker can see it.

The same timer measures how busy the loop's thread is: the CPU time it used over the wall time
between ticks. A loop near saturation is the worker's bottleneck (HTTP, decoding, hand-offs),
however idle the model's instances are; the batcher then waits a little for company, since
every batch costs the loop a hand-off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopLag:
    def __init__(
        self,
        *,
        interval_s: float = 0.005,
        on_sample: Callable[[float], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.on_sample = on_sample
        # Moving average of the lateness, seconds (a few hundred milliseconds of memory).
        self.lag_s = 0.0
        # Moving average of the loop thread's CPU time over wall time (0..1).
        self.busy = 0.0
        self._cpu = 0.0
        self._wall = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._cpu, self._wall = time.thread_time(), time.monotonic()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        self._due = time.monotonic() + self.interval_s
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        late = max(0.0, now - self._due)
        self.lag_s += 0.1 * (late - self.lag_s)
        cpu = time.thread_time()
        if now > self._wall:
            share = min(1.0, (cpu - self._cpu) / (now - self._wall))
            self.busy += 0.05 * (share - self.busy)
        self._cpu, self._wall = cpu, now
        if self.on_sample is not None:
            self.on_sample(late)
        self._schedule()
