"""The deadline batcher with a fake clock: a small discrete-event simulation of one model with
instances whose batches take exactly what a known cost function says. No asyncio, no model."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from tailserve.engine.batching import Item
from tailserve.engine.buckets import Bucket
from tailserve.engine.cost import LinearCost
from tailserve.engine.deadline_batcher import _LOOP_WAIT_S, DeadlineBatcher
from tailserve.engine.queues import ClassQueue

SHORT, LONG = Bucket("short", "len<=16"), Bucket("long", "len<=512")
MAX_ROWS = 64


def linear(fixed: float, per_row: float) -> Callable[[Bucket, int], float]:
    return lambda bucket, rows: fixed + per_row * rows


@dataclass
class Arrival:
    at: float
    budget: float
    rows: int = 1
    bucket: Bucket = SHORT
    priority: int = 1


@dataclass
class Run:
    start: float
    end: float
    items: list[Item]


@dataclass
class Outcome:
    runs: list[Run] = field(default_factory=list)
    rejected: list[tuple[Item, str]] = field(default_factory=list)
    expired: list[Item] = field(default_factory=list)
    # Polls made with the instance free (`simulate`).
    polls: int = 0

    @property
    def served(self) -> list[tuple[Item, Run]]:
        return [(item, run) for run in self.runs for item in run.items]

    def mean_rows(self) -> float:
        return float(np.mean([sum(i.rows for i in run.items) for run in self.runs]))


def batcher(
    instances: int = 1, max_queue: int = 10_000, admission_target: float = 0.5
) -> DeadlineBatcher:
    return DeadlineBatcher(
        max_rows=MAX_ROWS,
        instances=instances,
        max_queue=max_queue,
        admission_target=admission_target,
    )


def seeded(b: DeadlineBatcher, cost: Callable[[Bucket, int], float], *buckets: Bucket) -> None:
    for bucket in buckets or (SHORT,):
        for rows in (1, MAX_ROWS) * 4:
            b.observe(bucket, rows, cost(bucket, rows), 0.0)


def simulate(
    b: DeadlineBatcher,
    arrivals: list[Arrival],
    cost: Callable[[Bucket, int], float],
    instances: int = 1,
    *,
    lazy: bool = True,
) -> Outcome:
    """Polls as the scheduler does: when an instance comes free, at the time the last poll
    gave, and after an arrival only where the batcher asks for it (``poll_soon``); or, not
    ``lazy``, after every arrival."""
    outcome = Outcome()
    free_at = [0.0] * instances
    wake: float | None = None
    now, i = 0.0, 0
    while True:
        events = [f for f in free_at if f > now]
        if i < len(arrivals):
            events.append(arrivals[i].at)
        if wake is not None and wake > now:
            events.append(wake)
        if not events:
            if not len(b):
                return outcome
            events.append(now)
        now = max(now, min(events))
        due = now in free_at or wake is None or now >= wake
        while i < len(arrivals) and arrivals[i].at <= now:
            a = arrivals[i]
            item = Item(a.rows, a.bucket, now, now + a.budget, a.priority)
            rejection = b.offer(item, now, [max(f, now) for f in free_at])
            if rejection is not None:
                outcome.rejected.append((item, rejection.reason))
            else:
                due = due or b.poll_soon or not lazy
            i += 1
        if not due and i < len(arrivals):
            continue
        wake = None
        for k in range(instances):
            if free_at[k] > now:
                continue
            poll = b.poll(now, [max(f, now) for f in free_at], draining=i == len(arrivals))
            outcome.polls += 1
            outcome.expired += poll.expired
            if poll.batch:
                rows = sum(item.rows for item in poll.batch)
                took = cost(poll.batch[0].bucket, rows)
                free_at[k] = now + took
                outcome.runs.append(Run(now, now + took, poll.batch))
                b.observe(poll.batch[0].bucket, rows, took, 0.0)
            elif poll.wait_until is not None:
                wake = poll.wait_until if wake is None else min(wake, poll.wait_until)


def poisson(rate: float, seconds: float, budget: float, seed: int = 0) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * seconds * 1.2) + 10))
    return [Arrival(float(t), budget) for t in times[times < seconds]]


COST = linear(0.002, 0.00002)  # 2 ms a batch plus 20 µs a row: 64 rows take 3.28 ms


def test_at_low_load_a_lone_request_goes_at_once() -> None:
    b = batcher()
    seeded(b, COST)
    arrivals = [Arrival(0.1 * k, budget=0.050) for k in range(1, 30)]
    outcome = simulate(b, arrivals, COST)
    assert len(outcome.runs) == 29
    waits = [run.start - item.enqueued_at for item, run in outcome.served]
    assert max(waits) <= 0.0005  # no waiting for company that is not coming
    assert outcome.mean_rows() == 1


def test_at_high_load_batches_fill() -> None:
    # Full batches serve 64 / 3.28 ms = 19,500 rows/s; offer 15,000 a second.
    b = batcher()
    seeded(b, COST)
    arrivals = poisson(15_000, 1.0, budget=0.100)
    outcome = simulate(b, arrivals, COST)
    assert not outcome.rejected and not outcome.expired
    # Polled when a batch's worth has come or an instance is free, not after every arrival.
    assert outcome.polls < 0.2 * len(arrivals)
    late = outcome.runs[len(outcome.runs) // 5 :]  # past the first fifth, the rate is known
    assert np.mean([sum(i.rows for i in run.items) for run in late]) >= 0.75 * MAX_ROWS
    # Batches grow with the load: just big enough to keep the instance 80% busy.
    sizes = []
    for rate in (300, 3_000):
        light = batcher()
        seeded(light, COST)
        sizes.append(simulate(light, poisson(rate, 1.0, budget=0.100), COST).mean_rows())
    assert sizes[0] < 2 < sizes[1] < 16 < 0.75 * MAX_ROWS


def test_no_admitted_request_misses_a_deadline_the_rule_could_meet() -> None:
    rng = np.random.default_rng(3)
    arrivals = [
        Arrival(a.at, budget=float(rng.uniform(0.010, 0.100)), priority=int(rng.integers(1, 3)))
        for a in poisson(12_000, 1.0, budget=0.0, seed=4)
    ]
    b = batcher()
    seeded(b, COST)
    outcome = simulate(b, arrivals, COST)
    assert len(outcome.served) > 0.9 * len(arrivals)
    assert not outcome.expired
    misses = [item for item, run in outcome.served if run.end > item.deadline + 1e-9]
    assert misses == []


def test_a_tight_deadline_cuts_a_wait_for_company_short() -> None:
    b = batcher(admission_target=1.0)  # admit up to the deadline: the dispatch rule is tested
    seeded(b, COST)
    # Busy traffic for a while: the batcher expects company and lets batches grow.
    busy = poisson(14_000, 0.3, budget=0.200)
    tight = Arrival(0.3005, budget=0.004)  # 4 ms: only a batch started at once can make it
    outcome = simulate(b, [*busy, tight], COST)
    served = {id(item): run for item, run in outcome.served}
    item = next(i for i, _ in outcome.served if i.deadline - i.enqueued_at == pytest.approx(0.004))
    assert served[id(item)].end <= item.deadline


def test_classes_never_share_a_batch() -> None:
    cost = lambda bucket, rows: 0.001 + (0.0001 if bucket is LONG else 0.00001) * rows  # noqa: E731
    b = batcher()
    seeded(b, cost, SHORT, LONG)
    arrivals = [Arrival(0.0001 * k, 0.2, bucket=SHORT if k % 3 else LONG) for k in range(3000)]
    outcome = simulate(b, arrivals, cost)
    assert len(outcome.served) == 3000
    assert all(len({item.bucket.key for item in run.items}) == 1 for run in outcome.runs)
    assert {run.items[0].bucket.key for run in outcome.runs} == {"short", "long"}


def test_infeasible_requests_are_refused_at_once() -> None:
    b = batcher()
    seeded(b, COST)
    # Even alone, one row takes 2.02 ms: a 1 ms deadline cannot be met.
    alone = b.offer(Item(1, SHORT, 0.0, 0.001), 0.0, [0.0])
    assert alone is not None and alone.reason == "deadline" and "alone takes" in alone.message
    assert len(b) == 0
    # 20 full batches queued ahead (~66 ms of work): a 30 ms deadline cannot be met after them.
    for _ in range(20):
        assert b.offer(Item(MAX_ROWS, SHORT, 0.0, 1.0), 0.0, [0.0]) is None
    behind = b.offer(Item(1, SHORT, 0.0, 0.030), 0.0, [0.0])
    assert behind is not None and "queued ahead" in behind.message
    assert behind.retry_after_s == pytest.approx(20 * 0.00328 + 0.00202, rel=0.05)
    # A higher priority does not wait behind lower ones, so it gets in.
    assert b.offer(Item(1, SHORT, 0.0, 0.030, priority=1), 0.0, [0.0]) is not None
    urgent = Item(1, LONG, 0.0, 0.030, priority=1)
    b2 = batcher()
    seeded(b2, COST)
    for _ in range(20):
        assert b2.offer(Item(MAX_ROWS, SHORT, 0.0, 1.0, priority=2), 0.0, [0.0]) is None
    assert b2.offer(urgent, 0.0, [0.0]) is None


def test_a_request_stalled_past_its_slo_on_its_way_in_is_served_when_nothing_is_ahead() -> None:
    def fresh() -> DeadlineBatcher:
        b = batcher()
        seeded(b, COST)
        return b

    # Its deadline (the model's SLO: the client set none) passed before it was offered.
    assert fresh().offer(Item(1, SHORT, 0.0, 0.050), 0.056, [0.0]) is None
    # So it is with the event loop's backlog, which counts the requests in flight, this one
    # among them (a lone request over HTTP: dashboard test, a 429 at -2.9 ms).
    backlogged = fresh()
    backlogged.loop_backlog_s = 0.010
    assert backlogged.offer(Item(1, SHORT, 0.0, 0.050), 0.056, [0.0]) is None
    # Refused all the same: a deadline the client set, an instance busy, or work queued ahead.
    assert fresh().offer(Item(1, SHORT, 0.0, 0.050, hard=True), 0.056, [0.0]) is not None
    assert fresh().offer(Item(1, SHORT, 0.0, 0.050), 0.056, [0.060]) is not None
    queued = fresh()
    assert queued.offer(Item(1, SHORT, 0.0, 1.0), 0.0, [0.0]) is None
    assert queued.offer(Item(1, SHORT, 0.0, 0.050), 0.056, [0.0]) is not None


def test_the_shed_refuses_for_a_wait_ahead_and_not_without_one() -> None:
    b = batcher()
    seeded(b, COST)
    # 6 ms past the deadline when read, nothing ahead: the offer judges it once it is read.
    assert b.shed(0.056, [0.0], deadline=0.050, priority=1) is None
    b.loop_backlog_s = 0.010
    refused = b.shed(0.056, [0.0], deadline=0.050, priority=1)
    assert refused is not None and "queued ahead" in refused.message


def test_a_class_keeps_deadline_and_priority_order_as_priorities_mix_and_part() -> None:
    # One heap serves both orders while one priority level is queued; a second level gives
    # deadline order a heap of its own until the class empties. Checked against a plain scan.
    rng = np.random.default_rng(11)
    queue = ClassQueue(SHORT, LinearCost())
    queued: list[tuple[int, Item]] = []
    for step in range(3000):
        phase = (step // 500) % 2  # mixed priorities, then a single level, and so on
        if rng.random() < 0.55:
            level = int(rng.integers(1, 4)) if phase == 0 else 2
            item = Item(1, SHORT, 0.0, float(rng.uniform(0.0, 1.0)), level)
            queue.push(item, step)
            queued.append((step, item))
        elif queued:
            for item in queue.take(int(rng.integers(1, 4))):
                queued.remove(next(entry for entry in queued if entry[1] is item))
        urgent = min(queued, key=lambda e: (e[1].deadline, e[0]), default=(0, None))[1]
        assert queue.most_urgent() is urgent
        assert queue.best_priority() == min((i.priority for _, i in queued), default=0)
        assert queue.rows == len(queued)
    assert not queue.mixed or queued  # (an empty class went back to its single heap)


def test_the_one_class_count_of_the_work_ahead_agrees_with_the_many_class_one() -> None:
    # With one class the batcher counts the work queued ahead a shorter way; a second class,
    # empty, must change nothing of what admission estimates.
    rng = np.random.default_rng(5)
    one, two = batcher(), batcher()
    seeded(one, COST)
    seeded(two, COST, SHORT, LONG)
    one.observe(SHORT, 1, COST(SHORT, 1) * 1.5, 0.0)  # a non-zero error margin
    two.observe(SHORT, 1, COST(SHORT, 1) * 1.5, 0.0)
    for k in range(300):
        now = k * 0.0001
        rows, level = int(rng.integers(1, 9)), int(rng.integers(1, 3))
        items = [Item(rows, SHORT, now, now + 1.0, level) for _ in range(2)]
        answers = [b.offer(item, now, [now]) for b, item in zip((one, two), items, strict=True)]
        assert answers == [None, None]
        assert items[0].estimate == pytest.approx(items[1].estimate, rel=1e-9, abs=1e-12)
        if k % 7 == 6:  # batches leave now and then: the queue passes a batch's worth and back
            took = [len(b.poll(now, [now], draining=True).batch) for b in (one, two)]
            assert took[0] == took[1]
    assert len(one) == len(two) > 0


def test_higher_priority_goes_first_within_a_class() -> None:
    b = DeadlineBatcher(max_rows=2, instances=1, max_queue=100)
    seeded(b, COST)
    early = [Item(1, SHORT, 0.0, 0.5, priority=2) for _ in range(3)]
    vip = Item(1, SHORT, 0.001, 0.9, priority=1)
    for item in [*early, vip]:
        assert b.offer(item, item.enqueued_at, [0.0]) is None
    first = b.poll(0.001, [0.001], draining=True).batch
    assert first[0] is vip and first[1] is early[0]


def test_a_queued_request_whose_deadline_passes_expires() -> None:
    b = batcher()
    seeded(b, COST)
    item = Item(1, SHORT, 0.0, 0.010, hard=True)
    soft = Item(1, SHORT, 0.0, 0.010)
    assert b.offer(item, 0.0, [0.0]) is None
    assert b.offer(soft, 0.0, [0.0]) is None
    # The only instance turned out busy far longer than predicted.
    assert b.poll(0.005, [0.030]).expired == []
    poll = b.poll(0.009, [0.030])
    assert poll.expired == [item] and poll.batch == [] and len(b) == 1
    # The one without a client deadline is still served, late.
    assert b.poll(0.030, [0.030]).batch == [soft]


def test_a_full_queue_refuses() -> None:
    b = batcher(max_queue=2)
    seeded(b, COST)
    for _ in range(2):
        assert b.offer(Item(1, SHORT, 0.0, 1.0), 0.0, [0.0]) is None
    refused = b.offer(Item(1, SHORT, 0.0, 1.0), 0.0, [0.0])
    assert refused is not None and refused.reason == "queue_full"


def test_a_new_class_starts_from_the_nearest_shorter_class() -> None:
    from tailserve.engine.buckets import Pad

    b = batcher()
    short = Bucket("s", "len<=16", Pad("t", 1, 16, 0))
    longer = Bucket("l", "len<=64", Pad("t", 1, 64, 0))
    seeded(b, linear(0.001, 0.0001), short)
    assert b.predict(longer, 10) == pytest.approx(0.001 + 0.0001 * 4 * 10, rel=0.01)
    assert math.isfinite(b.predict(Bucket("other", "x"), 1))


def test_a_batch_holds_no_more_rows_than_can_run_before_its_deadline() -> None:
    slow = linear(0.001, 0.001)  # 1 ms a row: 64 rows would take 65 ms
    b = batcher()
    seeded(b, slow)
    for _ in range(MAX_ROWS):
        assert b.offer(Item(1, SHORT, 0.0, 0.200), 0.0, [0.0]) is None
    urgent = Item(1, SHORT, 0.0, 0.020)
    assert b.offer(urgent, 0.0, [0.0]) is not None  # 65 rows ahead: refused
    b2 = batcher()
    seeded(b2, slow)
    assert b2.offer(urgent, 0.0, [0.0]) is None
    for _ in range(40):
        assert b2.offer(Item(1, SHORT, 0.0, 0.200), 0.0, [0.0]) is None
    batch = b2.poll(0.0, [0.0]).batch
    assert batch[0] is urgent
    assert 10 <= len(batch) <= 19  # what fits in the 20 ms left, not all 41
    assert slow(SHORT, len(batch)) <= 0.020


def test_a_lost_deadline_does_not_shrink_the_batch() -> None:
    slow = linear(0.001, 0.001)
    b = batcher()
    seeded(b, slow)
    for _ in range(40):
        assert b.offer(Item(1, SHORT, 0.0, 0.100), 0.0, [0.0]) is None
    # 150 ms later every member is late already (soft deadlines): batch for throughput.
    assert len(b.poll(0.150, [0.150]).batch) == 40


def test_what_admission_learnt_fades_when_nothing_is_admitted_to_correct_it() -> None:
    b = batcher()
    seeded(b, COST)
    for _ in range(200):  # every answer came half a second later than admission expected
        item = Item(1, SHORT, 0.0, 10.0)
        assert b.offer(item, 0.0, [0.0]) is None
        b.completed(item, item.estimate + 0.5)
        b.poll(0.0, [0.0], draining=True)
    refused = b.offer(Item(1, SHORT, 0.0, 0.2), 0.0, [0.0])
    assert refused is not None and refused.reason == "deadline"
    # Nothing admitted, nothing answered: seconds later the lesson has faded, and the
    # batcher admits again (and learns afresh) instead of refusing everything for good.
    assert b.offer(Item(1, SHORT, 5.0, 5.2), 5.0, [5.0]) is None


def test_a_hand_off_stalled_by_overload_neither_teaches_more_than_its_cap_nor_lasts() -> None:
    # Under a flood the loop picks results up late: hand-offs of 200 ms. Learnt as they were,
    # every request with a tighter budget would be refused, no batch would run to teach
    # otherwise, and the worker would refuse for good (seen: a ranker refusing every cache miss
    # at a quarter of its capacity after a capacity search).
    b = batcher()
    seeded(b, COST)
    for _ in range(200):
        b.observe(SHORT, 1, COST(SHORT, 1), 0.200, now=1.0)
    assert b.overhead_s == pytest.approx(0.020, rel=0.01)  # capped
    refused = b.offer(Item(1, SHORT, 1.0, 1.015), 1.0, [1.0])
    assert refused is not None and "alone takes" in refused.message
    # Nothing ran since: seconds later the lesson has faded and the request is admitted.
    assert b.offer(Item(1, SHORT, 4.0, 4.015), 4.0, [4.0]) is None


def test_a_request_with_more_rows_than_fit_before_its_deadline_still_goes() -> None:
    # 1 ms a row: 40 rows take 41 ms. Admitted with room to spare, then time passes (the loop
    # was busy) until its 40 rows no longer fit before its deadline. It must still go, alone;
    # left queued, its rows would count against every request offered after it, for good.
    slow = linear(0.001, 0.001)
    b = batcher()
    seeded(b, slow)
    wide = Item(40, SHORT, 0.0, 0.200)
    assert b.offer(wide, 0.0, [0.0]) is None
    assert b.offer(Item(1, SHORT, 0.0, 0.300), 0.0, [0.0]) is None
    batch = b.poll(0.170, [0.170]).batch  # 30 ms left: room for ~28 rows
    assert batch == [wide]
    assert len(b) == 1
    assert b.offer(Item(1, SHORT, 0.170, 0.270), 0.170, [0.170]) is None


def admitted_before_a_refusal(b: DeadlineBatcher, now: float) -> int:
    """Lone requests with 20 ms to go offered at once until one is refused: how many went in."""
    admitted = 0
    while b.offer(Item(1, SHORT, now, now + 0.020), now, [now]) is None:
        admitted += 1
    return admitted


def test_admission_keeps_its_headroom_only_under_overload() -> None:
    calm = batcher(admission_target=0.5)
    seeded(calm, COST)
    # Refusing next to nothing: a burst is admitted while the estimate says it will be served
    # in time (the work ahead may take all of the 20 ms left, less the margins).
    burst = admitted_before_a_refusal(calm, 0.0)
    assert COST(SHORT, MAX_ROWS) * (burst / MAX_ROWS) > 0.012

    overloaded = batcher(admission_target=0.5)
    seeded(overloaded, COST)
    for _ in range(10 * MAX_ROWS):  # a backlog of 10 full batches, then a flood refused
        assert overloaded.offer(Item(1, SHORT, 0.0, 10.0), 0.0, [0.0]) is None
    for _ in range(300):
        assert overloaded.offer(Item(1, SHORT, 0.0, 0.020), 0.0, [0.0]) is not None
    while overloaded.poll(1.0, [1.0], draining=True).batch:
        pass
    # Refusing steadily: a request may queue for only half of what it has left.
    assert admitted_before_a_refusal(overloaded, 1.0) < 0.6 * burst


def test_a_saturated_event_loop_makes_batches_wait_for_company() -> None:
    # A cheap model (0.2 ms a batch) at 2,000 req/s: its instance is mostly idle, so batches
    # go at once, one or two rows each. When the loop's thread is saturated (HTTP, hand-offs)
    # the loop is the bottleneck: batches wait up to ~4 ms for company, and fill.
    cheap = linear(0.0002, 0.000002)
    arrivals = [Arrival(a.at, 0.050) for a in poisson(2000.0, 1.0, 0.050, seed=3)]
    rows = {}
    for busy in (0.3, 1.0):
        b = batcher()
        seeded(b, cheap)
        b.loop_busy = busy
        outcome = simulate(b, arrivals, cheap)
        assert not outcome.rejected
        assert all(run.end <= item.deadline for item, run in outcome.served)
        rows[busy] = outcome.mean_rows()
    assert rows[0.3] < 2.0
    assert rows[1.0] > 2.5 * rows[0.3]


def test_a_wait_for_company_for_the_loops_sake_is_bounded_in_time() -> None:
    # A saturated, lagging loop and a burst at 2,000 req/s that stops: the batcher expects
    # company (rows arriving within the loop's wait), but no member waits for it longer than
    # that wait, however much the rate it learnt says more is coming, nor until its deadline.
    cheap = linear(0.0002, 0.000002)
    arrivals = [Arrival(a.at, 0.050) for a in poisson(2000.0, 0.2, 0.050, seed=5)]
    b = batcher()
    seeded(b, cheap)
    b.loop_busy, b.loop_delay_s = 1.0, 0.020
    outcome = simulate(b, arrivals, cheap)
    assert not outcome.rejected and len(outcome.served) == len(arrivals)
    waits = [run.start - item.enqueued_at for item, run in outcome.served]
    assert max(waits) <= _LOOP_WAIT_S + 1e-9
    assert outcome.mean_rows() > 2.0  # it did wait for company


def test_after_overload_an_idle_worker_admits_a_request_its_own_batch_fills_half_of() -> None:
    # 500 rows take ~10 ms; the budget is 25 ms. Under overload the share falls to 0.3, but a
    # request's own batch is not waiting: once the queue is empty, it is admitted again.
    cost = linear(0.0002, 0.00002)
    b = DeadlineBatcher(max_rows=4096, instances=1, max_queue=10_000, admission_target=0.3)
    for rows in (1, 500, 1000) * 4:
        b.observe(SHORT, rows, cost(SHORT, rows), 0.0)
    for _ in range(20):
        assert b.offer(Item(500, SHORT, 0.0, 10.0), 0.0, [0.0]) is None
    for _ in range(300):  # a flood refused: overload
        assert b.offer(Item(500, SHORT, 0.0, 0.025), 0.0, [0.0]) is not None
    assert b.share() == pytest.approx(0.3, abs=0.01)
    while b.poll(1.0, [1.0], draining=True).batch:
        pass
    assert b.offer(Item(500, SHORT, 2.0, 2.025), 2.0, [2.0]) is None


def test_the_event_loops_backlog_counts_against_a_deadline() -> None:
    # A cheap model whose queue is empty: only the loop's backlog (the requests the worker
    # holds, times the loop CPU each needs) stands between a request and its answer.
    b = batcher()
    seeded(b, COST)
    b.loop_backlog_s = 0.040
    assert b.shed(0.0, [0.0], deadline=0.050, priority=1) is None
    assert b.offer(Item(1, SHORT, 0.0, 0.050), 0.0, [0.0]) is None
    b.loop_backlog_s = 0.060  # more than the whole budget: refused before it is read...
    refused = b.shed(0.0, [0.0], deadline=0.050, priority=1)
    assert refused is not None and refused.reason == "deadline"
    assert refused.retry_after_s >= 0.060
    late = b.offer(Item(1, SHORT, 0.0, 0.050), 0.0, [0.0])  # ...and when it is offered
    assert late is not None and late.reason == "deadline" and len(b) == 1
    assert b.offer(Item(1, SHORT, 0.0, 0.200), 0.0, [0.0]) is None  # a looser one gets in


def admits(b: DeadlineBatcher, deadline: float, free_at: float = 0.0) -> bool:
    """Whether a one-row request judged at time 0 is let in, before it is read (shed) and
    when it is offered; the two must agree."""
    shed = b.shed(0.0, [free_at], deadline=deadline, priority=1)
    offered = b.offer(Item(1, SHORT, 0.0, deadline), 0.0, [free_at])
    assert (shed is None) == (offered is None)
    return offered is None


def test_under_overload_the_event_loops_backlog_takes_only_the_share() -> None:
    # The loop's backlog is a queue ahead like the model's. Counted among the fixed delays,
    # it could fill the whole budget under overload: admitted requests spent 45 of churn's
    # 50 ms in the worker, and the wait in the kernel before it took them past the SLO.
    b = batcher()
    seeded(b, COST)
    b.loop_backlog_s = 0.030
    assert admits(b, 0.050)  # nothing refused yet: the whole time left
    for _ in range(300):  # a flood of tighter deadlines refused: overload
        assert not admits(b, 0.020)
    assert b.share() == pytest.approx(b.admission_target, abs=0.01)
    refused = b.shed(0.0, [0.0], deadline=0.050, priority=1)
    assert refused is not None and "the event loop's backlog, 30.0" in refused.message
    b.loop_backlog_s = 0.010  # within the share of the time left
    assert admits(b, 0.050)


def test_the_model_and_the_event_loop_drain_their_queues_at_once() -> None:
    # The instance is busy for 30 ms and the loop's backlog is 30 ms: the loop decodes and
    # answers while the instance runs, so the wait is ~30 ms, not 60, and a 50 ms budget holds.
    b = batcher()
    seeded(b, COST)
    b.loop_backlog_s = 0.030
    assert admits(b, 0.050, free_at=0.030)
    b.loop_backlog_s = 0.055  # the longer one past the budget
    refused = b.shed(0.0, [0.030], deadline=0.050, priority=1)
    assert refused is not None and "backlog, 55.0" in refused.message
    assert not admits(b, 0.050, free_at=0.030)


@pytest.mark.parametrize("rate", [300, 3_000, 15_000])
def test_polling_only_when_asked_serves_as_polling_after_every_arrival(rate: int) -> None:
    rng = np.random.default_rng(rate)
    arrivals = [
        Arrival(
            a.at,
            budget=float(rng.uniform(0.020, 0.100)),
            priority=int(rng.integers(1, 3)),
            bucket=SHORT if rng.random() < 0.8 else LONG,
        )
        for a in poisson(rate, 0.5, budget=0.0, seed=rate)
    ]
    cost = linear(0.0005, 0.00002)
    outcomes = []
    for lazy in (False, True):
        b = batcher()
        seeded(b, cost, SHORT, LONG)
        outcomes.append(simulate(b, arrivals, cost, lazy=lazy))
    eager, lazy_ = outcomes
    for outcome in outcomes:
        assert not outcome.rejected and not outcome.expired
        assert len(outcome.served) == len(arrivals)
        assert [item for item, run in outcome.served if run.end > item.deadline + 1e-9] == []
    # The same batching: as many batches (within a tenth) and the same wait, give or take.
    assert abs(len(lazy_.runs) - len(eager.runs)) <= 0.1 * len(eager.runs) + 2
    waits = [np.mean([run.start - item.enqueued_at for item, run in o.served]) for o in outcomes]
    assert waits[1] <= waits[0] * 1.1 + 0.0002
    assert lazy_.polls <= eager.polls


def test_an_arrival_asks_for_a_poll_only_when_it_changes_what_a_poll_would_answer() -> None:
    b = batcher()
    seeded(b, COST)
    for k in range(200):  # 10,000 rows a second: a batch of ~30 rows is the target
        b.offer(Item(1, SHORT, k * 0.0001, k * 0.0001 + 1.0), k * 0.0001, [0.0])
    while b.poll(0.02, [0.02], draining=True).batch:
        pass
    now = 0.02
    assert b.offer(Item(1, SHORT, now, now + 1.0), now, [now]) is None
    assert b.poll_soon  # the first of a new batch: its time to look again is not known yet
    poll = b.poll(now, [now])
    assert not poll.batch and poll.wait_until is not None
    assert b.offer(Item(1, SHORT, now, now + 1.0), now, [now]) is None
    assert not b.poll_soon  # one more row towards the batch: the poll's time stands
    assert b.offer(Item(1, SHORT, now, now + 0.010), now, [now]) is None
    assert b.poll_soon  # an earlier deadline: the batch may have to start sooner
    poll = b.poll(now, [now])
    assert not poll.batch
    asked = []
    while True:
        assert b.offer(Item(1, SHORT, now, now + 1.0), now, [now]) is None
        asked.append(b.poll_soon)
        if b.poll_soon:
            break
    assert len(asked) > 5  # asked for once the rows made the poll's batch
    poll = b.poll(now, [now])
    # (All came at once, so the rate and with it the batch wanted grew meanwhile: the poll
    # may ask for more, with a new time to look again.)
    assert poll.batch or poll.wait_until is not None
    assert b.offer(Item(1, SHORT, now, now + 1.0), now, [now]) is None
    assert b.poll_soon  # taken from: the class starts over


def test_a_bursts_few_refusals_leave_the_share_well_above_its_floor() -> None:
    # Refusals lower the share only as they near a steady fifth of requests (overload). A
    # burst's handful took it to its floor once, and at the floor an ordinary queue went past
    # it often enough to keep it there (the ranker, at two thirds of its capacity).
    b = batcher(admission_target=0.3)
    seeded(b, COST)
    for _ in range(100):
        assert admits(b, 0.050)
    b.loop_backlog_s = 0.060  # a burst: more work ahead than the whole budget
    for _ in range(8):  # (offered: `admits` would count each refusal twice, shed and offer)
        assert b.offer(Item(1, SHORT, 0.0, 0.050), 0.0, [0.0]) is not None
    assert b.share() > 0.6
    b.loop_backlog_s = 0.020  # 40% of the budget ahead: in (the floor, 0.3, refused it)
    assert admits(b, 0.050)
    b.loop_backlog_s = 0.060
    for _ in range(300):  # a flood refused: overload, and the floor
        assert not admits(b, 0.050)
    assert b.share() == pytest.approx(0.3, abs=0.01)
    b.loop_backlog_s = 0.020
    assert not admits(b, 0.050)


def test_under_overload_a_shed_says_how_long_its_refusal_stands_and_for_what() -> None:
    b = batcher(admission_target=0.3)
    seeded(b, COST)
    b.loop_backlog_s = 0.030
    calm = b.shed(0.0, [0.0], deadline=0.020, priority=1)
    assert calm is not None and calm.reusable_s == 0.0  # the share not at its floor: ask again
    for _ in range(300):  # a flood refused: overload
        assert b.offer(Item(1, SHORT, 0.0, 0.020), 0.0, [0.0]) is not None
    refused = b.shed(0.0, [0.0], deadline=0.050, priority=1)
    assert refused is not None and 0.0 < refused.reusable_s <= 0.005
    # The least budget it names is the one the same count lets through, and no less.
    least = refused.least_budget_s
    assert b.shed(0.0, [0.0], deadline=least * 0.99, priority=1) is not None
    assert b.shed(0.0, [0.0], deadline=least * 1.01, priority=1) is None
    refusals = b.refusals
    b.refused()  # a refusal made on its word counts as one
    assert b.refusals > refusals


def test_a_request_the_shed_let_in_may_queue_for_all_of_its_time_left() -> None:
    # Under overload the shed lets a request in on the share of its time left; by its offer
    # (read, decoded) the wait ahead may have grown past the share. Refused then, the worker
    # would have spent most of a request's cost for nothing: it is let in while the wait fits
    # in the whole of its time left.
    b = batcher(admission_target=0.3)
    seeded(b, COST)
    b.loop_backlog_s = 0.060
    for _ in range(300):  # a flood refused: overload, and the floor
        assert b.offer(Item(1, SHORT, 0.0, 0.050), 0.0, [0.0]) is not None
    assert b.share() == pytest.approx(0.3, abs=0.01)
    b.loop_backlog_s = 0.010
    assert b.shed(0.0, [0.0], deadline=0.050, priority=1) is None
    b.loop_backlog_s = 0.025  # a burst read meanwhile: half its time left ahead of it
    assert b.offer(Item(1, SHORT, 0.0, 0.050), 0.0, [0.0]) is not None  # not screened
    assert b.offer(Item(1, SHORT, 0.0, 0.050, screened=True), 0.0, [0.0]) is None
    b.loop_backlog_s = 0.052  # more than all of its time: refused, screened or not
    refused = b.offer(Item(1, SHORT, 0.0, 0.050, screened=True), 0.0, [0.0])
    assert refused is not None and refused.reason == "deadline"


def test_a_request_that_may_be_a_cache_hit_is_shed_for_the_event_loops_backlog_alone() -> None:
    # A cached model's request may be answered without the model, so its queue does not
    # refuse it unread; the loop's backlog, which a hit waits for too, does (not shed at all,
    # churn's requests were refused only once decoded, and under overload the loop fell
    # behind for good: docs/decisions/0002-admission-without-feedback.md).
    b = batcher(max_queue=100)
    seeded(b, COST)
    for _ in range(100):  # the model's queue full, and seconds of work
        assert b.offer(Item(1, SHORT, 0.0, 10.0), 0.0, [0.0]) is None
    assert b.shed(0.0, [0.0], deadline=0.050, priority=1) is not None
    assert b.shed(0.0, [0.0], deadline=0.050, priority=1, queue=False) is None
    b.loop_backlog_s = 0.060  # more than the whole budget
    refused = b.shed(0.0, [0.0], deadline=0.050, priority=1, queue=False)
    assert refused is not None and refused.reason == "deadline"
    assert "backlog, 60.0" in refused.message
