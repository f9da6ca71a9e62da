"""One churn-like worker's admission on a fake clock (tests/support/admission_sim.py): the real
batcher and loop measurement on a simulated event loop, the scenarios of the issue "Hold the
line under real load" at a small scale (docs/decisions/0002-admission-without-feedback.md)."""

from __future__ import annotations

import pytest

from support.admission_sim import Phase, Worker

CAPACITY = 6500.0  # one churn worker, as measured from outside (the simulated loop: ~9,000)
NEIGHBOURS = {"slowdown": 2.0, "slice_s": 0.004}


@pytest.mark.parametrize("shed", ["loop", "model"])
def test_a_fresh_worker_refuses_nothing_it_can_serve(shed: str) -> None:
    result = Worker(shed=shed, settle_s=0.5).run([Phase("fresh", 2, 0.6 * CAPACITY)])
    fresh = result.phases[0]
    assert fresh.refused == 0
    assert fresh.p99() < result.slo_s


@pytest.mark.parametrize("shed", ["loop", "model"])
def test_after_an_overload_the_worker_serves_again_without_refusing(shed: str) -> None:
    # 3x capacity for 3 s, then half of it. A cached model's requests (churn's) were read and
    # decoded before any refusal, at nearly the cost of serving them: the loop fell behind, its
    # goodput went to nothing, and it refused what it had not read for seconds after the burst.
    worker = Worker(shed=shed, settle_s=1.5)
    overload, after = worker.run(
        [Phase("3x", 3, 3 * CAPACITY), Phase("after", 3, 0.5 * CAPACITY)]
    ).phases
    assert overload.goodput > 0.8 * CAPACITY  # the worker still serves near its capacity
    assert after.late_refused == 0
    assert after.p99(late=True) < worker.slo_s


@pytest.mark.parametrize("shed", ["loop", "model"])
def test_neighbours_shrink_the_capacity_and_not_the_goodput(shed: str) -> None:
    worker = Worker(shed=shed, settle_s=1.0)
    during, after = worker.run(
        [
            Phase("neighbours", 3, 0.6 * CAPACITY, **NEIGHBOURS),
            Phase("after", 2, 0.6 * CAPACITY),
        ]
    ).phases
    assert during.good >= 0.9 * during.offered
    assert after.late_refused == 0


def test_a_capacity_search_beside_neighbours_keeps_serving_past_its_overload_step() -> None:
    # A search's steps over 1,000 client connections (wrk2): the overload step leaves the
    # client behind, and it sends what it owes as fast as answers come.
    worker = Worker(shed="loop", connections=1000, settle_s=1.0)
    phases = worker.run(
        [
            Phase("7200", 2, 7200, **NEIGHBOURS),
            Phase("4800", 2, 4800, **NEIGHBOURS),
            Phase("2400", 2, 2400, **NEIGHBOURS),
        ]
    ).phases
    assert phases[1].good > 0.8 * phases[1].offered
    assert phases[2].late_refused == 0
