"""Bench statistics from known samples: percentiles, throughput, errors, timeline, lag."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tailserve.loadgen.plan import Plan
from tailserve.loadgen.runner import Samples
from tailserve.loadgen.sending import CONNECT, TIMEOUT
from tailserve.loadgen.stats import generator_account, summarize


def samples(
    latencies_ms: list[float],
    *,
    rate: float = 100.0,
    status: list[int] | None = None,
    classes: list[int] | None = None,
) -> Samples:
    n = len(latencies_ms)
    offsets = np.arange(n) / rate
    plan = Plan(
        offsets=offsets,
        requests=[b""] * n,
        classes=np.array(classes or [0] * n, dtype=np.int32),
        class_names=["a", "b"],
        warmup_s=0.0,
        end_s=n / rate,
    )
    result = Samples.empty(plan)
    result.dispatched[:] = offsets
    result.done[:] = offsets + np.array(latencies_ms) / 1000.0
    result.status[:] = status or [200] * n
    return result


def summary(s: Samples, *, warmup_s: float = 0.0, slo_ms: float = 50.0) -> dict[str, Any]:
    end = float(s.intended[-1]) + 1 / 100.0
    return summarize(s, class_names=["a", "b"], warmup_s=warmup_s, end_s=end, slo_ms=slo_ms)


def test_percentiles_come_from_every_measured_latency() -> None:
    latencies = [float(v) for v in range(1, 1001)]  # 1..1000 ms, one each
    overall = summary(samples(latencies), slo_ms=50.5)["overall"]
    assert overall["p50_ms"] == pytest.approx(500, rel=0.002)
    assert overall["p90_ms"] == pytest.approx(900, rel=0.002)
    assert overall["p99_ms"] == pytest.approx(990, rel=0.002)
    assert overall["p999_ms"] == pytest.approx(999, rel=0.002)
    assert overall["max_ms"] == pytest.approx(1000, rel=0.002)
    assert overall["count"] == overall["ok"] == 1000
    assert overall["slo_misses"] == 950
    assert overall["goodput_rps"] == pytest.approx(5.0)


def test_timeouts_count_in_the_tail_and_other_failures_only_as_errors() -> None:
    latencies = [2.0] * 95 + [1000.0] * 3 + [1.0] * 2
    status = [200] * 95 + [TIMEOUT] * 3 + [CONNECT, 503]
    overall = summary(samples(latencies, status=status))["overall"]
    assert overall["errors"] == 5
    assert overall["errors_by_kind"] == {"timeout": 3, "connection": 1, "status_503": 1}
    assert overall["p99_ms"] == pytest.approx(1000, rel=0.002)  # the stall is not hidden
    assert overall["ok"] == 95


def test_warm_up_is_not_measured_and_classes_are_split() -> None:
    latencies = [100.0] * 50 + [1.0] * 50
    classes = [0, 1] * 50
    result = summary(samples(latencies, classes=classes), warmup_s=0.5)
    assert result["overall"]["count"] == 50
    assert result["overall"]["max_ms"] == pytest.approx(1.0, rel=0.01)
    assert result["classes"]["a"]["count"] == result["classes"]["b"]["count"] == 25


def test_a_server_falling_behind_achieves_less_than_offered() -> None:
    # Offered 100/s for 1 s, but the n-th reply comes at n * 20 ms: 50 answered a second.
    s = samples([0.0] * 100)
    s.done[:] = (np.arange(100) + 1) * 0.020
    overall = summary(s)["overall"]
    assert overall["offered_rps"] == pytest.approx(100)
    assert overall["achieved_rps"] == pytest.approx(50, rel=0.02)


def test_timeline_bins_sends_and_completions_by_second() -> None:
    s = samples([5.0] * 300)
    timeline = summary(s)["timeline"]
    assert [p["sent"] for p in timeline] == [100.0, 100.0, 100.0]
    assert sum(p["completed"] for p in timeline) == 300
    assert timeline[1]["p99_ms"] == pytest.approx(5.0)


def test_generator_lag_and_behind() -> None:
    s = samples([1.0] * 200)
    s.dispatched[:] = s.intended + 0.0005
    quiet = generator_account(s, slo_ms=50, cpu_s=0.1, wall_s=2.0, processes=1)
    assert not quiet["behind"] and quiet["lag_p99_ms"] == pytest.approx(0.5)
    s.dispatched[100:] = s.intended[100:] + 0.030
    late = generator_account(s, slo_ms=50, cpu_s=1.9, wall_s=2.0, processes=1)
    assert late["behind"] and late["lag_max_ms"] == pytest.approx(30)
    assert late["cpu_bound"]
