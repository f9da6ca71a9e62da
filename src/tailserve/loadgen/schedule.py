"""When each request is due: the open-loop send schedule, as offsets in seconds from the start.

Pure and seeded, so a schedule is the same every time and can be split between generator
processes (each takes every n-th send, which keeps the overall arrival process).

- ``constant``: one send every 1/rate seconds.
- ``poisson``: exponential gaps of mean 1/rate (independent arrivals, as from many users).
- ``steps``: Poisson arrivals at each ``[rate, seconds]`` in turn.
- ``ramp``: Poisson arrivals whose rate climbs linearly from ``rate_from`` to ``rate``.
- ``trace``: the recorded arrival times (see `loadgen.trace`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tailserve.loadgen.workload import Schedule

Offsets = np.ndarray[Any, np.dtype[np.float64]]


def arrival_offsets(schedule: Schedule, duration_s: float, seed: int) -> Offsets:
    """Send offsets in ``[0, duration_s)``, ascending. (``trace`` schedules come from the file.)"""
    rng = np.random.default_rng([seed, 0x5C4ED])
    if schedule.kind == "constant":
        count = math.ceil(duration_s * schedule.rate - 1e-9)
        return np.arange(count, dtype=np.float64) / schedule.rate
    if schedule.kind == "poisson":
        return _poisson(rng, schedule.rate, 0.0, duration_s)
    if schedule.kind == "steps":
        parts, start = [], 0.0
        for rate, seconds in schedule.steps:
            end = min(start + seconds, duration_s)
            if end > start and rate > 0:
                parts.append(_poisson(rng, rate, start, end))
            start += seconds
            if start >= duration_s:
                break
        return np.concatenate(parts) if parts else np.empty(0)
    if schedule.kind == "ramp":
        return _ramp(rng, schedule.rate_from, schedule.rate, duration_s)
    raise ValueError(f"schedule kind {schedule.kind!r} has no generated arrivals")


def steps_duration(schedule: Schedule) -> float:
    return float(sum(seconds for _, seconds in schedule.steps))


def rate_at(schedule: Schedule, t: float, duration_s: float) -> float:
    """The offered rate the schedule means at time ``t`` (for reports)."""
    if schedule.kind == "steps":
        start = 0.0
        for rate, seconds in schedule.steps:
            if t < start + seconds:
                return float(rate)
            start += seconds
        return float(schedule.steps[-1][0])
    if schedule.kind == "ramp":
        share = min(max(t / duration_s, 0.0), 1.0)
        return schedule.rate_from + (schedule.rate - schedule.rate_from) * share
    return schedule.rate


def _poisson(rng: np.random.Generator, rate: float, start: float, end: float) -> Offsets:
    # Draw a little more than the expected count, then top up in the rare case it fell short.
    expected = (end - start) * rate
    gaps = rng.exponential(1.0 / rate, size=int(expected + 6 * math.sqrt(expected) + 16))
    times = start + np.cumsum(gaps)
    while times[-1] < end:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=len(gaps)))
        times = np.concatenate([times, more])
    result: Offsets = times[times < end]
    return result


def _ramp(rng: np.random.Generator, rate_from: float, rate_to: float, duration_s: float) -> Offsets:
    """A Poisson process of rate r(t) = a + b t, by inverting its cumulative intensity.

    Unit-rate arrivals u_k map to the t_k with a t + b t^2 / 2 = u_k.
    """
    a = rate_from
    b = (rate_to - rate_from) / duration_s
    total = a * duration_s + b * duration_s**2 / 2
    unit = _poisson(rng, 1.0, 0.0, total)
    if abs(b) < 1e-12:
        result: Offsets = unit / a
        return result
    times = (-a + np.sqrt(a * a + 2 * b * unit)) / b
    result = times[times < duration_s]
    return result
