"""Latency as a dial: the variants' policy with a fake clock, and a scheduler choosing between
real runtimes of different costs."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest

from tailserve.engine.buckets import Bucket
from tailserve.engine.deadline_batcher import DeadlineBatcher
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.variants import VariantChooser, loop_pressure
from tailserve.errors import DeadlineUnmeetable
from tailserve.runtimes import Arrays, Signature

ALL = Bucket("all", "all")


def feed(chooser: VariantChooser, rate: float, seconds: float, costs: list[float]) -> list[int]:
    """Offer requests at ``rate`` a second for ``seconds``; the first variant each got."""
    firsts = []
    for i in range(int(rate * seconds)):
        firsts.append(chooser.order(i / rate, costs)[0][0])
    return firsts


def test_within_capacity_every_request_gets_the_most_accurate_variant() -> None:
    chooser = VariantChooser(["fp32", "int8"], instances=1, target_utilization=0.8)
    # 1 ms a request at 500 a second: half the instance's time.
    firsts = feed(chooser, 500, 2.0, [0.001, 0.0004])
    assert set(firsts) == {0}
    # The cheaper variants stay behind it, for a request the queue would refuse; the full
    # model may take half of admission's allowance for the queue ahead, the cheaper all.
    assert chooser.order(2.0, [0.001, 0.0004]) == [(0, 0.5), (1, 1.0)]


def test_past_capacity_the_mix_is_what_fits() -> None:
    chooser = VariantChooser(["fp32", "int8"], instances=1, target_utilization=0.8)
    # 1,200 a second: fp32 alone needs 1.2 s a second, int8 alone 0.48; 0.8 fits a mix of
    # f fp32: 1.2 f + 0.48 (1 - f) = 0.8  =>  f = 0.444.
    firsts = feed(chooser, 1200, 3.0, [0.001, 0.0004])
    late = firsts[len(firsts) // 2 :]  # once the rate estimate has settled
    share = late.count(0) / len(late)
    assert share == pytest.approx(0.444, abs=0.03)
    assert set(late) == {0, 1}


def test_beyond_the_cheapest_all_go_to_it() -> None:
    chooser = VariantChooser(["fp32", "int8", "small"], instances=2, target_utilization=0.8)
    firsts = feed(chooser, 10_000, 2.0, [0.002, 0.001, 0.0005])
    assert set(firsts[len(firsts) // 2 :]) == {2}


def test_three_variants_mix_the_neighbours_that_fit() -> None:
    chooser = VariantChooser(["fp32", "int8", "small"], instances=1, target_utilization=1.0)
    # Demand 2.0 in fp32 seconds: allowed 0.5 of fp32's cost, between int8 (0.6) and small (0.2).
    firsts = feed(chooser, 1000, 3.0, [0.002, 0.0012, 0.0004])
    late = firsts[len(firsts) // 2 :]
    assert set(late) == {1, 2}
    assert late.count(1) / len(late) == pytest.approx((0.5 - 0.2) / (0.6 - 0.2), abs=0.03)


def test_a_variant_no_cheaper_than_a_more_accurate_one_is_never_chosen() -> None:
    chooser = VariantChooser(["fp32", "int8", "small"], instances=1, target_utilization=0.8)
    firsts = feed(chooser, 5000, 2.0, [0.001, 0.0015, 0.0004])  # int8 is slower here
    assert 1 not in firsts
    assert [v for v, _ in chooser.order(2.0, [0.001, 0.0015, 0.0004])] in ([0, 2], [2])


class Costly:
    """Adds ``offset`` to x, taking ``per_row_s`` a row of real time (a model's compute)."""

    steady = False

    def __init__(self, offset: float, per_row_s: float) -> None:
        self.offset = offset
        self.per_row_s = per_row_s
        self.batches = 0

    def load(self) -> None: ...

    def describe(self) -> Signature:
        return Signature((), ())

    def predict(self, inputs: Arrays) -> Arrays:
        self.batches += 1
        time.sleep(self.per_row_s * len(inputs["x"]))
        return {"y": inputs["x"] + self.offset}

    def unload(self) -> None: ...


def x(value: float) -> Arrays:
    return {"x": np.array([[value]], dtype=np.float32)}


def dial(fp32: Costly, int8: Costly) -> Scheduler:
    batcher = DeadlineBatcher(max_rows=4, instances=1, max_queue=1000, admission_target=1.0)
    chooser = VariantChooser(["fp32", "int8"], instances=1)
    s = Scheduler(
        model="m", runtimes=[[fp32, int8]], batcher=batcher, batched=True, variants=chooser
    )
    for rows in (1, 2, 4):
        s.seed(ALL, rows, fp32.per_row_s * rows, 0)
        s.seed(ALL, rows, int8.per_row_s * rows, 1)
    s.start()
    return s


async def test_a_quiet_model_serves_the_first_variant_and_says_so() -> None:
    fp32, int8 = Costly(100, 0.002), Costly(200, 0.0005)
    s = dial(fp32, int8)
    outputs, stats = await s.infer(x(1), 1, ALL, deadline=time.monotonic() + 1.0)
    await s.close()
    assert outputs["y"][0, 0] == 101
    assert stats.variant == "fp32"
    assert stats.cost_class == "fp32/all"
    assert int8.batches == 0


async def test_a_pinned_variant_runs_that_variant() -> None:
    fp32, int8 = Costly(100, 0.002), Costly(200, 0.0005)
    s = dial(fp32, int8)
    outputs, stats = await s.infer(x(1), 1, ALL, deadline=time.monotonic() + 1.0, variant=1)
    await s.close()
    assert outputs["y"][0, 0] == 201
    assert stats.variant == "int8"


async def test_a_burst_the_first_variant_cannot_meet_is_served_by_the_cheaper_not_refused() -> None:
    # 40 requests at once with 150 ms each: fp32 (10 ms a row) could answer at most 15 in
    # time; int8 (0.5 ms a row) all of them. (A loaded machine took 30 ms to offer the 40: a
    # budget of 60 ms left the last ones too little for the work queued ahead.)
    fp32, int8 = Costly(100, 0.010), Costly(200, 0.0005)
    s = dial(fp32, int8)
    # (A full collection of what earlier tests left, in the middle of the burst, once
    # stalled the loop for a quarter of a second: done before the clock starts.)
    gc.collect()
    deadline = time.monotonic() + 0.150
    results = await asyncio.gather(
        *(s.infer(x(i), 1, ALL, deadline=deadline) for i in range(40)), return_exceptions=True
    )
    await s.close()
    refused = [r for r in results if isinstance(r, DeadlineUnmeetable)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert not refused
    variants = [stats.variant for _, stats in served]
    assert "fp32" in variants and "int8" in variants
    for i, (outputs, stats) in enumerate(served):
        assert outputs["y"][0, 0] == i + (100 if stats.variant == "fp32" else 200)
    # Only the cheaper variant's refusals would have counted; there were none.
    assert s.stats.rejected.get("deadline", 0) == 0


async def test_what_even_the_cheapest_cannot_meet_is_refused_once() -> None:
    fp32, int8 = Costly(100, 0.010), Costly(200, 0.005)
    s = dial(fp32, int8)
    with pytest.raises(DeadlineUnmeetable):
        await s.infer(x(1), 1, ALL, deadline=time.monotonic() + 0.001)
    await s.close()
    assert s.stats.rejected == {"deadline": 1}


def test_a_saturated_event_loop_takes_the_capacity_the_model_would_use() -> None:
    # The instances have room for the demand (0.5 of 0.8), but the loop that shares their
    # cores is saturated: a cheaper variant gives it CPU back.
    assert loop_pressure(lag_s=0.0005, busy=0.3) == 0.0
    assert loop_pressure(lag_s=0.010, busy=0.3) == 1.0
    assert loop_pressure(lag_s=0.0005, busy=0.65) == pytest.approx(0.5)
    quiet = VariantChooser(["fp32", "int8"], instances=1, target_utilization=0.8)
    pressed = VariantChooser(["fp32", "int8"], instances=1, target_utilization=0.8)
    costs = [0.001, 0.0004]
    calm = [quiet.order(i / 500, costs, 0.0)[0][0] for i in range(1000)]
    late = [pressed.order(i / 500, costs, 1.0)[0][0] for i in range(1000)]
    assert set(calm[500:]) == {0}
    assert set(late[500:]) == {1}


def test_a_variant_only_a_little_cheaper_is_not_worth_its_accuracy() -> None:
    chooser = VariantChooser(["fp32", "int8"], instances=1, target_utilization=0.8)
    assert chooser.order(0.0, [0.001, 0.00095], 1.0) == [(0, 1.0)]
    assert [v for v, _ in chooser.order(0.0, [0.001, 0.0008], 1.0)] == [1]
