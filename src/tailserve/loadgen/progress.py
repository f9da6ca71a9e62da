"""The live progress line of a bench run: rate, sends, completions, errors, p99, lag.

Ticks come once a second from each generator process; the line is redrawn in place on a
terminal and printed every few seconds otherwise (a CI log).
"""

from __future__ import annotations

import time
from typing import TextIO

from tailserve.loadgen.plan import Plan
from tailserve.loadgen.runner import Tick
from tailserve.loadgen.stats import new_histogram


class Progress:
    def __init__(self, plan: Plan, slo_ms: float, stream: TextIO, *, every_s: float = 5.0):
        self.plan = plan
        self.slo_ms = slo_ms
        self.stream = stream
        self.tty = stream.isatty()
        self.every_s = 1.0 if self.tty else every_s
        self.started = time.monotonic()
        self.shown = 0.0
        self.counts: dict[int, Tick] = {}
        self.recent: list[float] = []
        self.histogram = new_histogram()
        self.width = 0

    def add(self, tick: Tick, source: int = 0) -> None:
        self.counts[source] = tick
        values = (tick.latencies * 1e6).astype("int64").tolist()
        self.recent.extend(values)
        for micros in values:
            self.histogram.record_value(max(1, micros))
        now = time.monotonic()
        if now - self.shown >= self.every_s:
            self.shown = now
            self._show(now)

    def finish(self) -> None:
        self._show(time.monotonic())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, now: float) -> None:
        ticks = list(self.counts.values())
        sent = sum(t.sent for t in ticks)
        done = sum(t.completed for t in ticks)
        errors = sum(t.errors for t in ticks)
        lag = max((t.lag_max_s for t in ticks), default=0.0) * 1000.0
        elapsed = now - self.started
        recent = sorted(self.recent)
        self.recent = []
        p99_now = recent[int(0.99 * (len(recent) - 1))] / 1000.0 if recent else 0.0
        p99_all = self.histogram.get_value_at_percentile(99) / 1000.0
        line = (
            f"{elapsed:6.1f}s  sent {sent:,}/{len(self.plan):,}  done {done:,}  "
            f"rate {sent / max(elapsed, 1e-9):,.0f}/s  errors {errors:,}  "
            f"p99 now {p99_now:,.1f} ms  p99 {p99_all:,.1f} ms (SLO {self.slo_ms:g})  "
            f"lag max {lag:.1f} ms"
        )
        if self.tty:
            self.width = max(self.width, len(line))
            self.stream.write("\r" + line.ljust(self.width))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
