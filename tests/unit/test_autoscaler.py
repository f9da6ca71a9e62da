"""The autoscaler's policy with a fake clock (plain floats, one sample a second): up within
seconds on SLO pressure, down slowly, within its bounds, and steady under an oscillating load."""

from __future__ import annotations

import math
import random
from itertools import pairwise
from typing import Any

import pytest

from tailserve.errors import ConfigError
from tailserve.fleet.autoscaler import Autoscaler, Decision, ScalingConfig, WorkerLoad

CONFIG = ScalingConfig(
    min_workers=1,
    max_workers=8,
    slo_s=0.050,
    target_in_flight=8.0,
    upscale_delay_s=3.0,
    panic_delay_s=1.0,
    downscale_delay_s=60.0,
)


def worker(
    in_flight: int = 2,
    p99_s: float | None = 0.010,
    queue_delay_s: float = 0.0,
    refusals_per_s: float = 0.0,
    cpu: float = 0.3,
) -> WorkerLoad:
    return WorkerLoad(
        in_flight=in_flight,
        queue_delay_s=queue_delay_s,
        p99_s=p99_s,
        refusals_per_s=refusals_per_s,
        cpu=cpu,
    )


def fleet(count: int, **load: Any) -> list[WorkerLoad]:
    return [worker(**load) for _ in range(count)]


def run(scaler: Autoscaler, times: range, count: int, **load: Any) -> list[Decision]:
    """Samples at each of ``times`` (seconds) of ``count`` workers under the same load."""
    return [scaler.decide(float(t), fleet(count, **load)) for t in times]


def wanted(decisions: list[Decision]) -> list[int]:
    return [d.wanted for d in decisions]


def changes(decisions: list[Decision]) -> list[tuple[int, int]]:
    """(sample, new count) of each decision that changed the count."""
    pairs = pairwise(enumerate(wanted(decisions)))
    return [(t, count) for (_, before), (t, count) in pairs if count != before]


class Simulation:
    """Serving workers follow the wanted count (a new one serves after ``warm_s``, a removed one
    leaves at once); the offered requests in flight split evenly over them, and each worker's
    p99 grows with what it carries: 4 ms a request, so 8 each is 32 ms of a 50 ms SLO."""

    def __init__(self, scaler: Autoscaler, serving: int, warm_s: float = 2.0) -> None:
        self.scaler, self.serving, self.warm_s = scaler, serving, warm_s
        self._ready_at: list[float] = []

    def step(self, now: float, in_flight: int) -> Decision:
        self.serving += sum(1 for at in self._ready_at if at <= now)
        self._ready_at = [at for at in self._ready_at if at > now]
        each = in_flight / self.serving
        loads = fleet(self.serving, in_flight=math.ceil(each), p99_s=0.004 * each)
        decision = self.scaler.decide(now, loads)
        coming = self.serving + len(self._ready_at)
        if decision.wanted > coming:
            self._ready_at += [now + self.warm_s] * (decision.wanted - coming)
        elif decision.wanted < self.serving:
            self.serving, self._ready_at = decision.wanted, []
        return decision


def test_slo_pressure_adds_a_worker_within_seconds() -> None:
    decisions = run(Autoscaler(CONFIG), range(4), 2, p99_s=0.045)
    assert wanted(decisions) == [2, 2, 2, 3]
    assert decisions[1].reason == "p99 45 ms over 80% of the 50 ms SLO for 1.0 s of 3 s: holding 2"
    assert decisions[3].reason == "p99 45 ms over 80% of the 50 ms SLO for 3.0 s: 2 -> 3"
    assert decisions[3].inputs["p99_s"] == 0.045
    assert decisions[3].inputs["serving"] == 2.0


@pytest.mark.parametrize(
    ("load", "words"),
    [
        ({"queue_delay_s": 0.045}, "queue wait 45 ms over 80% of the 50 ms SLO"),
        ({"refusals_per_s": 2.5}, "5.0 refusals/s"),
        ({"in_flight": 12}, "24 in flight need 3 workers at 8 each"),
    ],
)
def test_each_kind_of_pressure_adds_a_worker(load: dict[str, Any], words: str) -> None:
    decisions = run(Autoscaler(CONFIG), range(4), 2, **load)
    assert wanted(decisions) == [2, 2, 2, 3]
    assert decisions[3].reason.startswith(words)


def test_a_worker_coming_up_is_not_added_again() -> None:
    scaler = Autoscaler(CONFIG)
    assert run(scaler, range(4), 2, p99_s=0.045)[-1].wanted == 3
    # The third worker is still warming: two serve, under the same pressure.
    assert wanted(run(scaler, range(4, 10), 2, p99_s=0.045)) == [3] * 6
    # Once it serves, pressure that lasts adds the next one.
    assert wanted(run(scaler, range(10, 14), 3, p99_s=0.045)) == [3, 3, 3, 4]


def test_a_spike_shorter_than_the_delay_adds_nothing() -> None:
    scaler = Autoscaler(CONFIG)
    spikes = {
        5: {"p99_s": 0.300},
        12: {"refusals_per_s": 50.0},
        20: {"in_flight": 200},  # a one-sample panic
        30: {"p99_s": 0.300},
        31: {"p99_s": 0.300},
    }
    decisions = [scaler.decide(float(t), fleet(2, **spikes.get(t, {}))) for t in range(60)]
    assert set(wanted(decisions)) == {2}


def test_panic_goes_straight_to_what_demand_needs() -> None:
    scaler = Autoscaler(ScalingConfig(max_workers=16))
    decisions = run(scaler, range(2), 2, in_flight=40)  # 80 is over 2x what 2 of 8 carry
    assert wanted(decisions) == [2, 10]
    assert decisions[1].reason == (
        "panic: 80 in flight need 10 workers at 8 each, over 2x what 2 carry for 1.0 s: 2 -> 10"
    )
    capped = run(Autoscaler(CONFIG), range(2), 2, in_flight=40)[-1]
    assert capped.wanted == 8
    assert capped.reason.endswith("; capped at max_workers 8 for 1.0 s: 2 -> 8")


def test_panic_scales_to_the_lowest_demand_of_its_window() -> None:
    scaler = Autoscaler(ScalingConfig(max_workers=32, panic_delay_s=2.0))
    loads = [40, 60, 50]  # need 10, 15, 13 on 2 workers of 8
    decisions = [scaler.decide(float(t), fleet(2, in_flight=n)) for t, n in enumerate(loads)]
    assert wanted(decisions) == [2, 2, 10]


def test_down_waits_a_full_window_of_low_load_and_goes_one_at_a_time() -> None:
    scaler = Autoscaler(CONFIG)
    decisions = []
    for t in range(400):
        count = decisions[-1].wanted if decisions else 4
        decisions.append(scaler.decide(float(t), fleet(count, in_flight=1, p99_s=0.005)))
    assert changes(decisions) == [(60, 3), (121, 2), (182, 1)]
    assert decisions[59].reason.endswith("for 59 s of 60 s: holding 4")
    assert decisions[60].reason == (
        "calm (4 in flight need 1 worker at 8 each, latency 5 ms) for 60 s: 4 -> 3, one at a time"
    )


def test_latency_between_calm_and_pressure_holds_the_count() -> None:
    scaler = Autoscaler(CONFIG)
    decisions = run(scaler, range(600), 4, in_flight=1, p99_s=0.030)
    assert set(wanted(decisions)) == {4}
    assert decisions[-1].reason == "latency 30 ms between 50% and 80% of the 50 ms SLO: holding 4"


def test_one_warm_sample_restarts_the_window_for_removing() -> None:
    scaler = Autoscaler(CONFIG)
    run(scaler, range(50), 4, in_flight=1, p99_s=0.005)
    run(scaler, range(50, 51), 4, in_flight=1, p99_s=0.030)
    assert set(wanted(run(scaler, range(51, 111), 4, in_flight=1, p99_s=0.005))) == {4}
    assert scaler.decide(111.0, fleet(4, in_flight=1, p99_s=0.005)).wanted == 3


def test_never_below_what_the_requests_in_flight_need() -> None:
    scaler = Autoscaler(CONFIG)
    decisions = run(scaler, range(900), 6, in_flight=4, p99_s=0.005)  # 24 in flight: 3 of 8
    assert wanted(decisions)[-1] == 3
    assert min(wanted(decisions)) == 3


def test_within_min_and_max() -> None:
    bounded = ScalingConfig(min_workers=2, max_workers=3)
    low = Autoscaler(bounded)
    assert low.decide(0.0, []).wanted == 2  # nothing serving yet: starts at the minimum
    assert set(wanted(run(low, range(1, 600), 2, in_flight=0, p99_s=None))) == {2}
    high = Autoscaler(bounded)
    decisions = run(high, range(60), 3, p99_s=0.200, refusals_per_s=10.0)
    assert set(wanted(decisions)) == {3}
    assert decisions[-1].reason.endswith("capped at max_workers 3: holding 3")


def test_no_workers_serving_holds_the_count() -> None:
    scaler = Autoscaler(CONFIG)
    scaler.decide(0.0, fleet(3))
    decisions = run(scaler, range(1, 300), 0)
    assert set(wanted(decisions)) == {3}
    assert decisions[-1].reason == "no worker serving: holding 3"


def test_on_two_cores_a_third_worker_is_not_wanted() -> None:
    scaler = Autoscaler(ScalingConfig(max_workers=8, cores=2))
    decisions = run(scaler, range(30), 2, p99_s=0.200, cpu=1.0)
    assert set(wanted(decisions)) == {2}
    assert decisions[-1].reason == (
        "p99 200 ms over 80% of the 50 ms SLO; CPU busy on every worker, but no core of 2 is "
        "spare; capped at 2: the machine has 2 cores: holding 2"
    )


def test_busy_cpus_are_pressure_only_with_a_core_to_spare() -> None:
    spare = Autoscaler(ScalingConfig(max_workers=8, cores=4))
    decisions = run(spare, range(4), 2, cpu=0.95)
    assert wanted(decisions) == [2, 2, 2, 3]
    assert decisions[-1].reason == "CPU busy on every worker for 3.0 s: 2 -> 3"
    full = Autoscaler(ScalingConfig(max_workers=8, cores=4))
    assert set(wanted(run(full, range(30), 4, cpu=0.95))) == {4}


def test_no_flapping_under_a_load_that_oscillates_faster_than_the_window() -> None:
    """A square wave, 10 s of 40 requests in flight then 10 s of 8, for ten minutes: the
    fleet grows once to carry the peaks and then holds."""
    sim = Simulation(Autoscaler(CONFIG), serving=2)
    decisions = [sim.step(float(t), 40 if (t // 10) % 2 == 0 else 8) for t in range(600)]
    assert len(changes(decisions)) <= 2
    assert changes(decisions)[-1][0] < 60
    assert decisions[-1].wanted >= 5  # the peaks' 40 in flight need 5 at 8 each


def test_a_slow_wave_scales_up_on_the_peaks_and_down_in_the_troughs() -> None:
    sim = Simulation(Autoscaler(CONFIG), serving=2)
    decisions = [sim.step(float(t), 40 if (t // 300) % 2 == 0 else 4) for t in range(1200)]
    counts = wanted(decisions)
    assert max(counts[:300]) >= 5
    assert counts[599] < counts[299]
    assert max(counts[600:900]) >= 5


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"min_workers": 0}, "min_workers"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers"),
        ({"slo_s": 0.0}, "slo_s"),
        ({"target_in_flight": -1.0}, "target_in_flight"),
        ({"panic_delay_s": 5.0, "upscale_delay_s": 3.0}, "panic_delay_s"),
        ({"upscale_delay_s": 90.0, "downscale_delay_s": 60.0}, "upscale_delay_s"),
        ({"panic_factor": 1.0}, "panic_factor"),
        ({"calm_fraction": 0.9, "pressure_fraction": 0.8}, "calm_fraction"),
        ({"cpu_busy": 0.0}, "cpu_busy"),
        ({"cores": 0}, "cores"),
    ],
)
def test_a_config_that_cannot_work_is_refused_naming_the_field(
    options: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^autoscaling: {field} .*must be"):
        ScalingConfig(**options)


def test_random_loads_keep_the_invariants() -> None:
    """Random load, held for random stretches, with the fleet following the count at once: the
    count stays within its bounds, falls one at a time and only a window after a change, never
    below what is in flight now, and never stays below a demand that lasted."""
    rng = random.Random(20261125)
    config = ScalingConfig(min_workers=2, max_workers=7, cores=6, upscale_delay_s=3.0)
    scaler = Autoscaler(config)
    count, changed_at, needs, in_flight, load = 2, 0.0, [], 0, {}
    for t in range(5000):
        if rng.random() < 0.15:
            in_flight = rng.choice([0, 3, 10, 30, 80, 200])
            load = {
                "p99_s": rng.choice([None, 0.005, 0.030, 0.045, 0.500]),
                "queue_delay_s": rng.choice([0.0, 0.0, 0.010, 0.060]),
                "refusals_per_s": rng.choice([0.0, 0.0, 0.0, 3.0]),
                "cpu": rng.choice([0.2, 0.95]),
            }
        each = math.ceil(in_flight / count)
        decision = scaler.decide(float(t), fleet(count, in_flight=each, **load))
        need = min(math.ceil(each * count / config.target_in_flight), config.ceiling)
        needs.append(need)
        assert config.min_workers <= decision.wanted <= config.ceiling == 6
        if decision.wanted < count:
            assert decision.wanted == count - 1
            assert decision.wanted >= need
            assert t - changed_at >= config.downscale_delay_s
        # Seven samples cover a delay of 3 s twice: enough for any change under way to end.
        assert decision.wanted >= min(needs[-7:]) or t < 7
        if decision.wanted != count:
            changed_at = t
        count = decision.wanted
