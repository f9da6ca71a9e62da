"""How late the event loop runs what is ready: a timer every few milliseconds, and how late it
fires. A request's task waits about that long before it runs and again before its answer goes
out; when the loop is saturated the wait grows, and admission control must count it, since
nothing else in the worker can see it.

The same timer measures how busy the loop's thread is: the CPU time it used over the wall time
between ticks. A loop near saturation is the worker's bottleneck (HTTP, decoding, hand-offs),
however idle the model's instances are; the batcher then waits a little for company, since
every batch costs the loop a hand-off.

And, given the server's count of the requests in flight, of those answered and of those
refused at once, the loop's backlog: the requests it holds times the loop CPU a request has
cost of late, stretched by the share of the loop's time that refusals take meanwhile. Where the
loop is the bottleneck (a cheap model: churn), an admitted request waits for the loop to decode,
batch, encode and write the requests ahead of it; neither the lag (one turn of the loop) nor a
model's queue (its batches run in a fraction of a millisecond) shows that wait, and admission
let requests in that then spent 70-100 ms inside the worker against a 50 ms SLO.

An idle worker sleeps: after a second with no request in flight and none answered or refused
(the server's counts unchanged), the timer ticks once a second instead, until a tick sees the
counts move (a request, or a scrape of `/metrics`), and it ticks every few milliseconds again.
Idle, the samples would only say that nothing happens, 200 times a second.

A refusal counts as a quarter of a request (churn: 22-24 µs of the loop against 84 µs for a
served request, at 8,000 req/s). Counted as nothing, as it once was, the loop's time spent on
refusals was charged to the few requests answered: a worker refusing most of what came read a
backlog of milliseconds a request, so refused more, and answered fewer. Churn at 12,000 req/s,
a rate it serves with a p99 of 6 ms, once served 9,000 a second and refused 3,000 (p50 17 ms);
after a burst, with a sampling profiler slowing its loop, it answered 788 a second and refused
the rest for six seconds.

A tick's loop CPU is charged to requests up to four times the average so far for each request
answered or held (before anything is learnt, one tick's interval for each answered): more than
that was other work (a model loaded or warmed on the loop, a garbage collection, a scrape).
Charged in full, 2.8 s of warm-up in the tick that answered a worker's first request set the
average to 141 ms, and the worker, a few requests in flight, refused every call against a 50
ms deadline until the average decayed. A burst is charged in full: its requests are held,
read but not yet answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tailserve.observability.host_cpu import HostCpu

# What a request refused at once costs the loop, in requests answered.
REFUSAL_WEIGHT = 0.25
# The most of the loop's time refusals are taken to hold (the backlog is stretched by at most
# 1 / (1 - this)).
_MAX_REFUSING = 0.9
# A tick charges requests at most this many times the average each (see the docstring).
_MAX_RISE = 4.0
_HOST_EVERY_S = 0.25
# Unchanged counts for this long put the timer to sleep; asleep, it ticks this often.
_IDLE_AFTER_S = 1.0
_ASLEEP_INTERVAL_S = 1.0


class LoopLag:
    def __init__(
        self,
        *,
        interval_s: float = 0.005,
        on_sample: Callable[[float], None] | None = None,
        requests: Callable[[], tuple[int, int, int]] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.on_sample = on_sample
        # The server's (requests in flight, requests answered so far, requests refused at once
        # so far), when it tells. Answered: by a task, or at once with a success (a reply kept
        # in the reply memo). Refused: an error answered at once (an overload's 429s).
        self.requests = requests
        # Moving average of the loop CPU an answered request costs (all the loop's work over
        # the requests answered meanwhile, a refusal counted as `REFUSAL_WEIGHT` of one; other
        # models' work included), and the share of the loop's time refusals take (0..0.9):
        # the backlog is the requests in flight times the first, over what the second leaves.
        self.per_request_s = 0.0
        self.refusing = 0.0
        self._answered = 0
        self._refused = 0
        # Moving average of the lateness, seconds (a few hundred milliseconds of memory).
        self.lag_s = 0.0
        # Moving average of the loop thread's CPU time over wall time (0..1).
        self.busy = 0.0
        self._cpu = 0.0
        self._wall = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        # The machine's idle CPU (observability/host_cpu.py), read every _HOST_EVERY_S.
        self.host = HostCpu()
        self._host_due = 0.0
        # The server's counts at the last tick, and since when they have not moved (None:
        # they moved at the last tick); asleep: ticking once a second (see the docstring).
        self._counts: tuple[int, int, int] | None = None
        self._still_since: float | None = None
        self.asleep = False

    @property
    def host_idle(self) -> float:
        """The machine's CPUs' idle share, 0..1 (moving average)."""
        return self.host.idle

    @property
    def backlog_s(self) -> float:
        """The requests in flight now times the loop CPU a request costs. Read when asked:
        a burst read in one turn of the loop takes hundreds of requests in between two ticks,
        and a backlog sampled at the ticks read nothing for the whole burst (every request of
        it admitted) and then far more than was left (the next ones refused)."""
        if self.requests is None or not self.per_request_s:
            return 0.0
        return self.requests()[0] * self.per_request_s / (1.0 - self.refusing)

    def start(self) -> None:
        self._cpu, self._wall = time.thread_time(), time.monotonic()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _count_requests(self, counts: tuple[int, int, int], used: float, wall: float) -> None:
        """Learn the loop CPU a request costs and the share of the loop refusals take, from
        the server's ``counts`` and the loop's CPU ``used`` over ``wall`` seconds."""
        held, answered, refused = counts
        done, self._answered = answered - self._answered, answered
        turned, self._refused = refused - self._refused, refused
        handled = done + REFUSAL_WEIGHT * turned
        if handled > 0:
            if self.per_request_s:
                used = min(used, _MAX_RISE * self.per_request_s * (handled + held))
            else:  # (nothing learnt yet: a tick's interval for each request answered)
                used = min(used, self.interval_s * handled)
            self.per_request_s += 0.05 * (used / handled - self.per_request_s)
        refusing = REFUSAL_WEIGHT * turned * self.per_request_s / wall
        self.refusing += 0.05 * (min(_MAX_REFUSING, refusing) - self.refusing)

    def _schedule(self) -> None:
        interval = _ASLEEP_INTERVAL_S if self.asleep else self.interval_s
        self._due = time.monotonic() + interval
        self._handle = asyncio.get_running_loop().call_later(interval, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        if self._idle(now):
            self._schedule()  # asleep: no sample, nothing learnt from an idle second
            return
        self.sample(now, time.thread_time(), late=max(0.0, now - self._due))
        if now >= self._host_due:
            self._host_due = now + _HOST_EVERY_S
            self.host.sample()
        self._schedule()

    def _idle(self, now: float) -> bool:
        """Whether the server's counts have not moved for `_IDLE_AFTER_S` (then the timer
        sleeps); a tick that sees them move wakes it, and the CPU read restarts from there."""
        if self.requests is None:
            return False
        counts = self.requests()
        if counts != self._counts or counts[0]:
            self._counts, self._still_since = counts, None
            if self.asleep:
                self.asleep = False
                self._cpu, self._wall = time.thread_time(), now
                self._answered, self._refused = counts[1], counts[2]
            return False
        if self._still_since is None:
            self._still_since = now
        self.asleep = now - self._still_since >= _IDLE_AFTER_S
        return self.asleep

    def sample(self, now: float, cpu: float, *, late: float) -> None:
        """One tick: the loop ran it ``late`` seconds after it was due, at ``now``, its thread
        having used ``cpu`` seconds so far. (The timer calls it with the real clocks; a
        simulation, with its own.)"""
        self.lag_s += 0.1 * (late - self.lag_s)
        if now > self._wall:
            used, wall = cpu - self._cpu, now - self._wall
            self.busy += 0.05 * (min(1.0, used / wall) - self.busy)
            if self.requests is not None:
                self._count_requests(self.requests(), used, wall)
        self._cpu, self._wall = cpu, now
        if self.on_sample is not None:
            self.on_sample(late)
