"""A discrete-event simulation of one churn-like worker's admission control, with a fake clock.

What it models, and what it takes from the worker as it is:

- Poisson arrivals of one-row requests, each with the model's SLO as its deadline (counted,
  as the server counts it, from when the loop begins to read it); the latency reported counts
  from the arrival (the intended send time), so the wait before the loop reads a request -- the
  kernel's queue, which no part of the worker sees -- is in it.
- One event loop: a single thread that runs what is ready in FIFO order, each job costing it
  some time. A request costs a read (with the shed), a task that decodes it and offers it, and
  an answer (encode, write): 80-120 µs in all; a refusal at once ~25 µs. Batches run on the
  loop's own thread (churn's `inline_below_ms`), costing a + b·rows. Neighbours taking the CPU
  (a ``slowdown``) stretch each job's wall time, not the CPU time the thread is charged:
  `time.thread_time` does not count the time the thread waits for a core.
- The real `DeadlineBatcher` (shed, offer, poll, observe, completed, refused) and the real
  `LoopLag` driven through `LoopLag.sample` by a timer job on the simulated loop, wired as the
  scheduler wires them (its reading of the loop: lag, busy and backlog before each shed and
  offer), with the HTTP adapter's kept refusals (a shed's refusal standing for a moment).

Deterministic: one seed, no wall clock.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tailserve.engine.batching import Item
from tailserve.engine.buckets import Bucket
from tailserve.engine.deadline_batcher import DeadlineBatcher
from tailserve.observability.loop_lag import LoopLag

BUCKET = Bucket("all", "all")


@dataclass(frozen=True, slots=True)
class Costs:
    """What each step costs the event loop's thread, seconds (churn-like)."""

    read_s: float = 0.000020  # read, parse, shed
    decode_s: float = 0.000040  # the request's task: decode, validate, offer
    answer_s: float = 0.000040  # encode, write
    spread: float = 0.2  # each step's cost varies uniformly by this much either way
    refuse_s: float = 0.000005  # a 429 written at once, after the read (25 µs in all)
    error_s: float = 0.000025  # an error answered by the task, after the decode
    batch_fixed_s: float = 0.0002
    batch_row_s: float = 0.0000005

    def served_s(self) -> float:
        return self.read_s + self.decode_s + self.answer_s


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests a second
    slowdown: float = 1.0  # wall time a job takes over the CPU time it is charged
    # 0: every job is stretched evenly; else the neighbours take the core in turns, as a
    # kernel's scheduler does: the loop runs for this long, then waits (slowdown - 1) times it.
    slice_s: float = 0.0


@dataclass(slots=True)
class Window:
    """What happened to the requests that arrived within one window of time."""

    start: float
    offered: int = 0
    served: int = 0
    good: int = 0  # served within the SLO (from the arrival)
    refused: int = 0
    share: float = 1.0  # the batcher's share at the window's end
    correction_s: float = 0.0
    backlog_s: float = 0.0
    lag_s: float = 0.0


@dataclass(slots=True)
class PhaseResult:
    phase: Phase
    start: float
    offered: int = 0
    served: int = 0
    good: int = 0
    refused: int = 0
    latencies: list[float] = field(default_factory=list)
    # The same counts for the arrivals after the phase's first ``settle_s`` (recovery).
    late_offered: int = 0
    late_refused: int = 0
    late_latencies: list[float] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.good / self.phase.seconds

    def p99(self, late: bool = False) -> float:
        values = self.late_latencies if late else self.latencies
        return float(np.percentile(values, 99)) if values else math.nan


@dataclass(slots=True)
class Result:
    phases: list[PhaseResult]
    windows: list[Window]
    slo_s: float
    settle_s: float


@dataclass(slots=True, eq=False)
class _Request:
    arrival: float
    phase: PhaseResult
    window: Window
    late: bool
    item: Item | None = None


# Job kinds on the loop.
_READ, _TASK, _ANSWER, _WORKER, _TICK = range(5)


class Worker:
    """One worker on a simulated clock. Build, then `run` a list of phases."""

    def __init__(
        self,
        *,
        costs: Costs | None = None,
        slo_s: float = 0.050,
        seed: int = 1,
        max_rows: int = 256,
        max_queue: int = 2048,
        admission_target: float = 0.3,
        shed: str = "model",
        window_s: float = 0.5,
        settle_s: float = 5.0,
        connections: int | None = None,
        batcher: Callable[[], DeadlineBatcher] | None = None,
    ) -> None:
        self.costs = costs or Costs()
        self.slo_s = slo_s
        self.rng = np.random.default_rng(seed)
        # What is checked before a request is read (`DataPlane.shed`): "model", the model's
        # queue and the loop's backlog (a model without a result cache); "loop", the loop's
        # backlog alone (with one: the request may be a hit); "none" (with one, until 0002).
        self.shed = shed
        self.window_s = window_s
        self.settle_s = settle_s
        # The client's connections, each with one request at a time (wrk2's model): a request
        # due while all are busy waits in the client (its latency still counts from when it
        # was due). None: as many as it takes.
        self.connections = math.inf if connections is None else connections
        self._waiting: deque[_Request] = deque()
        self._open = 0
        self.batcher = (
            batcher()
            if batcher is not None
            else DeadlineBatcher(
                max_rows=max_rows,
                instances=1,
                max_queue=max_queue,
                admission_target=admission_target,
            )
        )
        # Warm-up, as `tailserve serve` runs it (churn: 1, 16, 256 rows, twice).
        for rows in (1, 16, 256) * 2:
            self.batcher.observe(BUCKET, rows, self._batch_cost(rows), -1.0)
        self.in_flight = self.answered = self.refused = 0
        self.lag = LoopLag(requests=lambda: (self.in_flight, self.answered, self.refused))
        self.cpu = 0.0
        self.now = 0.0
        self._ready: deque[tuple[int, object]] = deque()
        self._timers: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._worker_idle = True
        self._worker_wake: float | None = None
        self._batch: list[Item] = []
        self._batch_start = 0.0
        self._tick_due = 0.0
        # The HTTP adapter's kept refusal: until when it stands, and the least budget.
        self._kept = (-math.inf, 0.0)

    def _batch_cost(self, rows: int) -> float:
        return self.costs.batch_fixed_s + self.costs.batch_row_s * rows

    def _cost(self, base: float) -> float:
        spread = self.costs.spread
        return base * (1.0 + spread * (2.0 * float(self.rng.random()) - 1.0))

    def _at(self, when: float, kind: int, data: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, kind, data))

    def _read_loop(self) -> None:
        b, lag = self.batcher, self.lag
        b.loop_delay_s, b.loop_busy, b.loop_backlog_s = lag.lag_s, lag.busy, lag.backlog_s

    # --- the run ----------------------------------------------------------------------------

    def run(self, phases: Sequence[Phase]) -> Result:
        results: list[PhaseResult] = []
        windows: list[Window] = []
        start = self.now
        arrivals: list[tuple[float, PhaseResult]] = []
        for phase in phases:
            result = PhaseResult(phase, start)
            results.append(result)
            gaps = self.rng.exponential(
                1.0 / phase.rate, size=int(phase.rate * phase.seconds * 1.3) + 20
            )
            times = start + np.cumsum(gaps)
            arrivals += [(float(t), result) for t in times[times < start + phase.seconds]]
            start += phase.seconds
        end = start
        for at, result in arrivals:
            index = int((at - self.now) / self.window_s)
            while len(windows) <= index:
                windows.append(Window(self.now + len(windows) * self.window_s))
            request = _Request(at, result, windows[index], at >= result.start + self.settle_s)
            self._at(at, _READ, request)
        self.lag.sample(self.now, self.cpu, late=0.0)
        self._tick_due = self.now + self.lag.interval_s
        self._at(self._tick_due, _TICK)
        bounds = [(r.start, r.start + r.phase.seconds, r.phase) for r in results]
        next_window = 0
        while self._timers or self._ready:
            if not self._ready:
                when = self._timers[0][0]
                if when > end + 1.0 and not self.in_flight and not len(self.batcher):
                    break
                self.now = max(self.now, when)
            while self._timers and self._timers[0][0] <= self.now:
                _, _, kind, data = heapq.heappop(self._timers)
                if kind == _WORKER:  # a sleeping worker's time to look again
                    if self._worker_idle and self._worker_wake == data:
                        self._wake_worker()
                    continue
                if kind == _READ:  # due from the client: sent if it has a connection free
                    if self._open >= self.connections:
                        assert isinstance(data, _Request)
                        self._waiting.append(data)
                        continue
                    self._open += 1
                self._ready.append((kind, data))
            while next_window < len(windows) and windows[next_window].start <= self.now:
                if next_window:
                    self._snapshot(windows[next_window - 1])
                next_window += 1
            if not self._ready:
                continue
            kind, data = self._ready.popleft()
            phase = next((p for a, b, p in bounds if a <= self.now < b), None)
            if phase is not None and phase.slice_s:
                self._advance(0.0, phase)  # (a stalled loop starts nothing)
            cost = self._job(kind, data)
            self.cpu += cost
            self._advance(cost, phase)
            self._finish(kind, data)
        if windows:
            self._snapshot(windows[-1])
        return Result(results, windows, self.slo_s, self.settle_s)

    def _advance(self, cost: float, phase: Phase | None) -> None:
        """The clock past a job that costs ``cost`` of CPU, as the neighbours let it run."""
        if phase is None or phase.slowdown == 1.0:
            self.now += cost
        elif not phase.slice_s:
            self.now += cost * phase.slowdown
        else:
            period = phase.slice_s * phase.slowdown
            k = math.floor(self.now / period)
            while True:
                left = k * period + phase.slice_s - self.now
                if left <= 1e-12:  # the core is the neighbours' until the next period
                    k += 1
                    self.now = max(self.now, k * period)
                    continue
                if cost <= 0.0:
                    return
                run = min(cost, left)
                self.now += run
                cost -= run
                if cost <= 1e-12:
                    return

    def _snapshot(self, window: Window) -> None:
        b = self.batcher
        window.share, window.correction_s = b.share(), b.correction_s
        window.backlog_s, window.lag_s = self.lag.backlog_s, self.lag.lag_s

    # --- the jobs ---------------------------------------------------------------------------

    def _job(self, kind: int, data: object) -> float:
        """Run a job's decisions at ``now`` (its start); answers its cost (CPU seconds)."""
        costs = self.costs
        if kind == _READ:
            assert isinstance(data, _Request)
            data.phase.offered += 1
            data.window.offered += 1
            data.phase.late_offered += data.late
            if self.shed != "none" and not self._screen(data):
                return self._cost(costs.read_s) + costs.refuse_s
            self.in_flight += 1
            screened = self.shed != "none"
            data.item = Item(1, BUCKET, self.now, self.now + self.slo_s, screened=screened)
            return self._cost(costs.read_s)
        if kind == _TASK:
            assert isinstance(data, _Request) and data.item is not None
            cost = self._cost(costs.decode_s)
            self._read_loop()
            if self.batcher.offer(data.item, self.now, [self.now]) is not None:
                data.item = None
                return cost + costs.error_s
            if self.batcher.poll_soon and self._worker_idle:
                self._wake_worker()
            return cost
        if kind == _ANSWER:
            return self._cost(costs.answer_s)
        if kind == _WORKER:
            poll = self.batcher.poll(self.now, [self.now])
            if not poll.batch:
                self._worker_idle = True
                self._worker_wake = poll.wait_until
                if poll.wait_until is not None:
                    self._at(poll.wait_until, _WORKER, poll.wait_until)
                return 0.0
            self._batch, self._batch_start = poll.batch, self.now
            return self._cost(self._batch_cost(sum(item.rows for item in poll.batch)))
        assert kind == _TICK
        self.lag.sample(self.now, self.cpu, late=max(0.0, self.now - self._tick_due))
        return 0.0

    def _finish(self, kind: int, data: object) -> None:
        """What a job does at its end (the clock past its cost)."""
        if kind == _READ:
            assert isinstance(data, _Request)
            if data.item is None:
                self._refused(data)
            else:
                data.item.payload = data
                self._ready.append((_TASK, data))
        elif kind == _TASK:
            assert isinstance(data, _Request)
            if data.item is None:
                self.in_flight -= 1
                self.answered += 1  # (an error answered by a task counts as answered)
                self._count_refusal(data)
                self._closed()
        elif kind == _ANSWER:
            assert isinstance(data, _Request)
            self.in_flight -= 1
            self.answered += 1
            self._closed()
            latency = self.now - data.arrival
            phase, window = data.phase, data.window
            phase.served += 1
            window.served += 1
            phase.latencies.append(latency)
            if data.late:
                phase.late_latencies.append(latency)
            if latency <= self.slo_s:
                phase.good += 1
                window.good += 1
        elif kind == _WORKER and self._batch:
            batch, self._batch = self._batch, []
            rows = sum(item.rows for item in batch)
            # (Its time as the runtime measures it: wall time, stretched by the neighbours.)
            self.batcher.observe(BUCKET, rows, self.now - self._batch_start, 0.0, self.now)
            for item in batch:
                self.batcher.completed(item, self.now)
                self._ready.append((_ANSWER, item.payload))
            self._ready.append((_WORKER, None))  # (sleep(0): what has come is read first)
        elif kind == _TICK:
            self._tick_due = self.now + self.lag.interval_s
            self._at(self._tick_due, _TICK)

    def _screen(self, request: _Request) -> bool:
        """The shed, with the adapter's kept refusals: whether the request goes on."""
        until, least = self._kept
        if self.now < until and self.slo_s < least:
            self.batcher.refused()
            return False
        self._read_loop()
        deadline = self.now + self.slo_s
        queue = self.shed == "model"
        rejection = self.batcher.shed(
            self.now, [self.now], deadline=deadline, priority=1, queue=queue
        )
        if rejection is None:
            return True
        if rejection.reusable_s:
            self._kept = (self.now + rejection.reusable_s, rejection.least_budget_s)
        return False

    def _refused(self, request: _Request) -> None:
        self.refused += 1
        self._count_refusal(request)
        self._closed()

    def _closed(self) -> None:
        """A request answered: its connection sends the next one waiting in the client."""
        self._open -= 1
        if self._waiting:
            self._open += 1
            self._ready.append((_READ, self._waiting.popleft()))

    def _count_refusal(self, request: _Request) -> None:
        request.phase.refused += 1
        request.window.refused += 1
        request.phase.late_refused += request.late

    def _wake_worker(self) -> None:
        self._worker_idle = False
        self._worker_wake = None
        self._ready.append((_WORKER, None))


def report(result: Result) -> list[str]:
    """Lines: per phase, then the refusal share over time."""
    lines = [
        f"{'phase':<14}{'rate/s':>8}{'slow':>6}{'offered':>9}{'served':>9}{'refused':>9}"
        f"{'goodput/s':>11}{'p99 ms':>8}{'refused>5s':>11}{'p99>5s':>8}"
    ]
    for r in result.phases:
        p = r.phase
        lines.append(
            f"{p.name:<14}{p.rate:>8.0f}{p.slowdown:>6.1f}{r.offered:>9}{r.served:>9}"
            f"{r.refused:>9}{r.goodput:>11.0f}{r.p99() * 1000:>8.1f}{r.late_refused:>11}"
            f"{r.p99(late=True) * 1000:>8.1f}"
        )
    lines.append("  t(s)  offered  refused  share  correction_ms  backlog_ms  lag_ms")
    for w in result.windows:
        refused = w.refused / w.offered if w.offered else 0.0
        lines.append(
            f"{w.start:6.1f}{w.offered:9d}{refused:9.0%}{w.share:7.2f}"
            f"{w.correction_s * 1000:15.2f}{w.backlog_s * 1000:12.2f}{w.lag_s * 1000:8.2f}"
        )
    return lines
