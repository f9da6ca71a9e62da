"""The capacity search converges on a simulated server of known capacity."""

from __future__ import annotations

import pytest

from tailserve.loadgen.capacity import CapacitySearch, Step


def simulated(capacity: float, offered: float) -> Step:
    # Below capacity the p99 grows gently; past it the queue grows and p99 explodes.
    if offered <= capacity:
        return Step(offered, offered, 5 + 20 * offered / capacity, 0)
    return Step(offered, capacity, 500.0, 0)


@pytest.mark.parametrize("capacity", [37.0, 420.0, 2500.0])
def test_converges_within_precision_of_a_known_capacity(capacity: float) -> None:
    search = CapacitySearch(slo_ms=50, start_rps=50, precision=0.05)
    while (rate := search.next_rate()) is not None:
        search.record(simulated(capacity, rate))
    found = search.capacity_rps
    assert found is not None
    assert capacity * 0.94 <= found <= capacity
    assert len(search.steps) < search.max_steps


def test_errors_and_falling_behind_fail_a_step() -> None:
    search = CapacitySearch(slo_ms=50)
    assert not Step(100, 100, 10, errors=1).passes(50, 0.95)
    assert not Step(100, 80, 10, errors=0).passes(50, 0.95)
    assert Step(100, 99, 10, errors=0).passes(50, 0.95)
    search.record(Step(50, 50, 10, 3))
    search.record(Step(25, 25, 10, 0))
    assert search.capacity_rps == 25


def test_a_server_that_fails_at_a_trickle_has_no_capacity() -> None:
    search = CapacitySearch(slo_ms=50, start_rps=50)
    while (rate := search.next_rate()) is not None:
        search.record(Step(rate, rate, 900.0, 0))
    assert search.capacity_rps is None


def test_a_failure_counts_only_when_a_second_try_confirms_it() -> None:
    # A server of capacity 2,500 whose first try at 1,600 req/s hits a stall of the machine.
    search = CapacitySearch(slo_ms=50, start_rps=50, precision=0.05)
    stalled = {1600.0}
    tried: list[float] = []
    while (rate := search.next_rate()) is not None:
        tried.append(rate)
        if rate in stalled:
            stalled.discard(rate)
            search.record(Step(rate, rate, 180.0, 0))  # p99 spoilt by the stall
        else:
            search.record(simulated(2500.0, rate))
    assert tried.count(1600.0) == 2
    found = search.capacity_rps
    assert found is not None and 2500 * 0.94 <= found <= 2500
    assert len(search.steps) < search.max_steps


def test_a_confirmed_failure_stops_the_climb() -> None:
    search = CapacitySearch(slo_ms=50, start_rps=100, precision=0.05)
    first = search.next_rate()
    assert first == 100
    search.record(Step(100, 100, 10, 0))
    assert search.next_rate() == 200
    search.record(Step(200, 198, 70, 0))  # over the SLO: tried again
    assert search.next_rate() == 200
    search.record(Step(200, 199, 75, 0))  # and again: confirmed
    assert search.next_rate() == 150  # bisects below it


@pytest.mark.parametrize(
    "failure",
    [Step(200, 120, 500, 0), Step(200, 200, 10, 0, behind=True)],
    ids=["clear overload", "generator behind"],
)
def test_a_clear_failure_is_not_tried_again(failure: Step) -> None:
    search = CapacitySearch(slo_ms=50, start_rps=100)
    search.next_rate()
    search.record(Step(100, 100, 10, 0))
    assert search.next_rate() == 200
    search.record(failure)
    assert not failure.passes(50, 0.95)
    assert search.next_rate() == 150


def test_without_confirmation_the_first_failure_counts() -> None:
    search = CapacitySearch(slo_ms=50, start_rps=100, confirm=False)
    search.next_rate()
    search.record(Step(100, 100, 10, 0))
    search.next_rate()
    search.record(Step(200, 199, 70, 0))
    assert search.next_rate() == 150
