"""The event loop's lag and how busy its thread is, measured by one timer."""

from __future__ import annotations

import asyncio
import time

import pytest

from tailserve.observability.loop_lag import REFUSAL_WEIGHT, LoopLag


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def measure() -> tuple[float, float, float, float]:
    """The loop's reading when saturated, its lag, its reading once idle, and the share of
    wall time the thread really had while saturated."""
    idle_ticks = asyncio.Event()
    ticks = [0]

    def tick(late: float) -> None:
        ticks[0] += 1
        if ticks[0] == 60:
            idle_ticks.set()

    lag = LoopLag(on_sample=tick)
    lag.start()
    try:
        cpu, wall = time.thread_time(), time.monotonic()
        for _ in range(25):  # 0.5 s of work in 20 ms slices: the loop's thread is saturated
            burn(0.020)
            await asyncio.sleep(0)
        had = (time.thread_time() - cpu) / (time.monotonic() - wall)
        busy, lagged = lag.busy, lag.lag_s
        ticks[0] = 0
        await idle_ticks.wait()  # then idle, for 60 ticks however late they come
        return busy, lagged, lag.busy, had
    finally:
        lag.stop()


def test_a_saturated_loop_reads_busy_and_late_and_an_idle_one_does_not() -> None:
    busy, lagged, idle, had = asyncio.run(measure())
    # The share is of wall time: on a machine whose other processes take CPU, a busy loop's
    # thread gets less of it, and that is what it reads (the moving average, after 25 ticks,
    # about 70% of the way there).
    assert busy > 0.25 * had
    assert lagged > 0.002  # ticks due every 5 ms fired 20 ms late or more
    assert idle < 0.5 * busy


async def backlog(
    in_flight: int, *, rounds: int = 40, refused: int = 0, idle_s: float = 0.0
) -> tuple[float, float]:
    """Each round: one request answered (2 ms of the loop's CPU), ``refused`` refused at once
    (a quarter of that each), then ``idle_s`` with nothing to do."""
    counts = [0, 0]
    lag = LoopLag(requests=lambda: (in_flight, counts[0], counts[1]))
    lag.start()
    try:
        for _ in range(rounds):
            burn(0.002)
            counts[0] += 1
            if refused:
                burn(refused * REFUSAL_WEIGHT * 0.002)
                counts[1] += refused
            await asyncio.sleep(idle_s)
        return lag.per_request_s, lag.backlog_s
    finally:
        lag.stop()


def test_the_backlog_is_the_requests_held_times_the_loop_cpu_each_costs() -> None:
    per_request, held = asyncio.run(backlog(in_flight=50))
    # The moving average starts from nothing and the ticks fall between requests: it reads
    # part of the 2 ms within 40 requests, never more than the CPU the loop spent.
    assert 0.0002 < per_request < 0.003
    assert held == pytest.approx(50 * per_request)
    assert asyncio.run(backlog(in_flight=0))[1] == 0.0


async def live_backlog() -> tuple[float, float, float]:
    held = [0]
    answered = 0
    lag = LoopLag(requests=lambda: (held[0], answered, 0))
    lag.start()
    try:
        while not lag.per_request_s:  # a tick has learnt what a request costs the loop
            burn(0.002)
            answered += 1
            await asyncio.sleep(0)
        per_request = lag.per_request_s
        before = lag.backlog_s
        held[0] = 300  # a burst read in one turn of the loop, no tick in between
        return per_request, before, lag.backlog_s
    finally:
        lag.stop()


def test_the_backlog_follows_the_requests_held_between_ticks() -> None:
    per_request, before, after = asyncio.run(live_backlog())
    assert before == 0.0
    assert after == pytest.approx(300 * per_request)


def test_refusals_cost_the_loop_their_share_and_not_the_answered_requests_whole_time() -> None:
    # Each round one request answered (2 ms of the loop) and sixteen refused (8 ms), then
    # 20 ms idle: the loop is a third busy, refusals most of it.
    per_request, held = asyncio.run(backlog(10, rounds=25, refused=16, idle_s=0.020))
    # Charged to the one answered request, the loop's 10 ms would read as 10 ms a request,
    # and ten in flight as a 100 ms backlog: so it read, and a worker that refused most of
    # what came refused ever more (the backlog grew with each refusal).
    assert 0.001 < per_request < 0.003
    # The requests held wait for their own 2 ms each, stretched by the refusals' share of the
    # loop's time (about a quarter here): far under the 10 ms a request charged the old way.
    assert 10 * per_request < held < 10 * per_request / (1 - 0.5)


def test_samples_on_a_fake_clock_learn_the_loop_cpu_a_request_costs() -> None:
    # (What the admission simulation drives: tests/support/admission_sim.py.)
    counts = [0, 0, 0]
    lag = LoopLag(requests=lambda: (counts[0], counts[1], counts[2]))
    lag.sample(0.0, 0.0, late=0.0)
    for tick in range(1, 200):  # each 5 ms: 40 requests answered, 4 ms of the loop's CPU
        counts[1] += 40
        lag.sample(tick * 0.005, tick * 0.004, late=0.001)
    counts[0] = 30
    assert lag.per_request_s == pytest.approx(0.0001, rel=0.01)
    assert lag.busy == pytest.approx(0.8, rel=0.01)
    assert lag.lag_s == pytest.approx(0.001, rel=0.01)
    assert lag.backlog_s == pytest.approx(30 * 0.0001, rel=0.01)


async def sleeps_and_wakes() -> tuple[bool, int, float]:
    """Whether the timer sleeps after the server's counts stood still, how many samples it took
    asleep, and how soon ten samples came once the counts moved."""
    counts = [0]
    samples: list[float] = []
    woken = asyncio.Event()
    moved_at = [0.0]

    def sampled(late: float) -> None:
        samples.append(time.monotonic())
        if moved_at[0] and sum(t >= moved_at[0] for t in samples) >= 10:
            woken.set()

    lag = LoopLag(requests=lambda: (0, counts[0], 0), on_sample=sampled)
    lag.start()
    try:
        # The behaviour is one of time: a second and a half with nothing answered.
        await asyncio.sleep(1.5)
        slept = lag.asleep
        asleep_from = time.monotonic()
        await asyncio.sleep(0.5)
        quiet = sum(t >= asleep_from for t in samples)
        moved_at[0] = time.monotonic()
        counts[0] += 1  # a request answered: the next (slow) tick wakes the timer
        await asyncio.wait_for(woken.wait(), timeout=5.0)
        return slept, quiet, time.monotonic() - moved_at[0]
    finally:
        lag.stop()


def test_an_idle_loop_sleeps_and_a_request_wakes_it() -> None:
    slept, quiet, took = asyncio.run(sleeps_and_wakes())
    assert slept  # a second with nothing answered: asleep
    assert quiet == 0  # asleep: not a sample in half a second (a 5 ms timer takes 100)
    assert took < 2.0  # the slow tick (once a second) saw the count move; then every 5 ms


def test_a_tick_of_other_work_does_not_read_as_a_dear_request() -> None:
    # A worker's loop loads and warms its models (2.8 s of its CPU) and answers its first
    # request within the same tick, five more in flight, against a 50 ms deadline. Read as
    # one request's cost, the tick set the average to 141 ms, and the backlog to 700 ms:
    # every call refused.
    counts = [0, 0, 0]
    lag = LoopLag(requests=lambda: (counts[0], counts[1], counts[2]))
    lag.sample(0.0, 0.0, late=0.0)
    counts[:2] = [5, 1]
    lag.sample(2.9, 2.8, late=2.8)
    assert lag.backlog_s < 0.010
    # The same with 63 requests held (clients that connected during the warm-up): nothing
    # learnt yet, the held ones are not charged, and they read a backlog well within 50 ms.
    early = LoopLag(requests=lambda: (63, 1, 0))
    early.sample(0.0, 0.0, late=0.0)
    early.sample(2.9, 2.8, late=2.8)
    assert early.backlog_s < 0.025
    # Then requests of 100 µs each, 40 a tick: the average learns them.
    for tick in range(1, 200):
        counts[1] += 40
        lag.sample(2.9 + tick * 0.005, 2.8 + tick * 0.004, late=0.001)
    assert lag.per_request_s == pytest.approx(0.0001, rel=0.02)
    # A stall (a garbage collection of 300 ms) with one request answered and five held: it
    # is charged at most four times the average for each of the six.
    learnt = lag.per_request_s
    counts[1] += 1
    lag.sample(4.0, 3.9, late=0.3)
    assert learnt < lag.per_request_s < learnt * (1 + 0.05 * (4 * 6 - 1)) * 1.01
    assert lag.backlog_s < 0.002


def test_a_true_rise_in_what_requests_cost_is_learnt_within_a_few_dozen_ticks() -> None:
    # 100 µs a request, then 2 ms (another model's traffic): bounded at four times the
    # average a tick, the average still reaches most of the new cost within 40 ticks.
    counts = [0, 0, 0]
    lag = LoopLag(requests=lambda: (counts[0], counts[1], counts[2]))
    now = cpu = 0.0
    lag.sample(now, cpu, late=0.0)
    for cost, ticks in ((0.0001, 200), (0.002, 40)):
        for _ in range(ticks):
            counts[1] += 2
            now, cpu = now + 0.005, cpu + 2 * cost
            lag.sample(now, cpu, late=0.001)
    assert lag.per_request_s > 0.5 * 0.002
