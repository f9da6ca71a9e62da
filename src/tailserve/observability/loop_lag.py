"""How late the event loop runs what is ready: a timer every few milliseconds, and how late it
fires. A request's task waits about that long before it runs and again before its answer goes
out; when the loop is saturated the wait grows, and admission control must count it, since
nothing else in the worker can see it."""

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
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        self._due = time.monotonic() + self.interval_s
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        late = max(0.0, time.monotonic() - self._due)
        self.lag_s += 0.1 * (late - self.lag_s)
        if self.on_sample is not None:
            self.on_sample(late)
        self._schedule()
