"""Send schedules: counts, spacing and rates of every kind, and the split between processes."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.loadgen.plan import schedule_offsets
from tailserve.loadgen.schedule import arrival_offsets, rate_at
from tailserve.loadgen.workload import Schedule, parse_workload


def test_constant_is_evenly_spaced() -> None:
    offsets = arrival_offsets(Schedule(kind="constant", rate=250), 2.0, seed=1)
    assert len(offsets) == 500
    assert np.allclose(np.diff(offsets), 0.004)
    assert offsets[0] == 0.0 and offsets[-1] < 2.0


def test_poisson_has_the_rate_and_exponential_gaps_and_is_seeded() -> None:
    offsets = arrival_offsets(Schedule(kind="poisson", rate=1000), 20.0, seed=3)
    assert len(offsets) == pytest.approx(20_000, rel=0.03)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.001, rel=0.03)
    # Exponential: the standard deviation equals the mean (a constant schedule's is 0).
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)
    assert np.array_equal(offsets, arrival_offsets(Schedule(kind="poisson", rate=1000), 20.0, 3))
    assert not np.array_equal(offsets[:50], arrival_offsets(Schedule(rate=1000), 20.0, 4)[:50])
    assert (np.diff(offsets) >= 0).all() and offsets[-1] < 20.0


def test_steps_send_each_rate_for_its_time() -> None:
    schedule = Schedule(kind="steps", steps=[(100, 5), (400, 5), (0, 2), (200, 3)])
    offsets = arrival_offsets(schedule, 15.0, seed=1)
    counts = [
        ((offsets >= a) & (offsets < b)).sum() for a, b in ((0, 5), (5, 10), (10, 12), (12, 15))
    ]
    assert counts[0] == pytest.approx(500, rel=0.15)
    assert counts[1] == pytest.approx(2000, rel=0.1)
    assert counts[2] == 0
    assert counts[3] == pytest.approx(600, rel=0.15)
    assert rate_at(schedule, 6.0, 15.0) == 400


def test_ramp_rate_climbs_linearly() -> None:
    offsets = arrival_offsets(Schedule(kind="ramp", rate_from=100, rate=900), 10.0, seed=2)
    # Total: the area under the rate line, (100 + 900) / 2 * 10.
    assert len(offsets) == pytest.approx(5000, rel=0.05)
    first, last = (offsets < 1).sum(), (offsets >= 9).sum()
    assert first == pytest.approx(140, rel=0.3)  # mean rate over [0, 1) is 140
    assert last == pytest.approx(860, rel=0.15)  # and over [9, 10) 860


def test_warm_up_runs_at_the_initial_rate_before_the_schedule() -> None:
    workload = parse_workload(
        {
            "model": "m",
            "warmup_s": 2,
            "duration_s": 4,
            "schedule": {"kind": "constant", "rate": 50},
        },
        source="test",
    )
    offsets = schedule_offsets(workload)
    assert len(offsets) == 300
    assert (offsets < 2).sum() == 100
    assert offsets[-1] < 6.0
