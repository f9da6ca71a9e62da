"""The dashboard's arithmetic: quantiles from bucket deltas as Prometheus's histogram_quantile
makes them, rates over an interval, counter resets, and the totals /metrics shows."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tailserve.fleet.dashboard_series import (
    JOBS_RUNNING,
    WANTED,
    History,
    histogram_quantile,
    increase,
    parse_pages,
)
from tailserve.observability.metrics import Metrics

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_the_rank_falls_in() -> None:
    buckets = {0.01: 10.0, 0.02: 60.0, 0.05: 100.0, INF: 100.0}
    # rank 50 falls in (0.01, 0.02], which holds 50 of them, 40 below the rank
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01 + 0.01 * 40 / 50)
    # rank 99 in (0.02, 0.05]: 40 there, 39 of them up to the rank
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.02 + 0.03 * 39 / 40)
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.05)


def test_the_first_bucket_starts_at_zero_and_the_last_finite_bound_caps_inf() -> None:
    assert histogram_quantile(0.5, {0.01: 10.0, INF: 10.0}) == pytest.approx(0.005)
    # the rank falls among the observations past the last finite bound
    assert histogram_quantile(0.99, {0.01: 5.0, 0.1: 6.0, INF: 10.0}) == 0.1
    # a first bound at or below zero is the answer itself, as Prometheus gives it
    assert histogram_quantile(0.5, {0.0: 4.0, 1.0: 8.0, INF: 8.0}) == 0.0


def test_nothing_to_estimate_is_none() -> None:
    assert histogram_quantile(0.99, {0.01: 0.0, INF: 0.0}) is None
    assert histogram_quantile(0.99, {0.01: 3.0, 0.02: 4.0}) is None  # no +Inf bucket
    assert histogram_quantile(0.99, {}) is None


def test_a_count_lower_than_the_bucket_below_is_taken_as_the_one_below() -> None:
    # scraped mid-update: 0.02's count below 0.01's; monotonic again, as Prometheus fixes it
    buckets = {0.01: 10.0, 0.02: 8.0, 0.05: 20.0, INF: 20.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.02 + 0.03 * 5 / 10)


def test_increase_takes_a_new_series_and_a_reset_from_zero() -> None:
    before = {("a_total", ()): 10.0, ("b_total", ()): 50.0}
    after = {("a_total", ()): 14.0, ("b_total", ()): 3.0, ("c_total", ()): 2.0}
    assert increase(before, after) == {
        ("a_total", ()): 4.0,
        ("b_total", ()): 3.0,  # it restarted: 3 since
        ("c_total", ()): 2.0,
    }


def page(
    buckets: dict[str, int],
    served: int,
    hits: int,
    misses: int,
    *,
    refused: int = 0,
    rows: tuple[int, int] = (0, 0),
    slo: float | None = None,
) -> str:
    """A worker's page for churn: latency buckets (le: cumulative count), requests answered,
    L1 lookups, refusals for a full queue, batch rows (sum, batches)."""
    lines = ["# TYPE tailserve_request_duration_seconds histogram"]
    for le, count in buckets.items():
        lines.append(
            f'tailserve_request_duration_seconds_bucket{{le="{le}",model="churn",'
            f'outcome="ok",protocol="http"}} {count}'
        )
    lines += [
        f'tailserve_request_duration_seconds_count{{model="churn",outcome="ok",'
        f'protocol="http"}} {served}',
        "# TYPE tailserve_requests counter",
        f'tailserve_requests_total{{model="churn",protocol="http",status="200"}} {served}',
        "# TYPE tailserve_rejected_requests counter",
        f'tailserve_rejected_requests_total{{model="churn",reason="queue_full"}} {refused}',
        "# TYPE tailserve_cache_lookups counter",
        f'tailserve_cache_lookups_total{{model="churn",result="hit",tier="l1"}} {hits}',
        f'tailserve_cache_lookups_total{{model="churn",result="cold",tier="l1"}} {misses}',
        "# TYPE tailserve_batch_size_rows histogram",
        f'tailserve_batch_size_rows_bucket{{bucket="0",le="+Inf",model="churn"}} {rows[1]}',
        f'tailserve_batch_size_rows_sum{{bucket="0",model="churn"}} {rows[0]}',
        f'tailserve_batch_size_rows_count{{bucket="0",model="churn"}} {rows[1]}',
    ]
    if slo is not None:
        lines += [
            "# TYPE tailserve_model_slo_seconds gauge",
            f'tailserve_model_slo_seconds{{model="churn"}} {slo}',
        ]
    return "\n".join(lines) + "\n"


def test_a_point_per_interval_from_two_workers() -> None:
    history = History(keep=3)
    first = [
        ("worker-0", page({"0.01": 10, "0.02": 10, "+Inf": 10}, 10, 2, 8)),
        ("worker-1", page({"0.01": 0, "0.02": 0, "+Inf": 0}, 0, 0, 0)),
    ]
    start = history.add(1000.0, 50.0, parse_pages(first), {"serving": 2}, {"churn": 0.05})
    assert start.interval_s == 0 and start.models == {}  # nothing to compare with yet
    assert start.totals.requests == {"churn": 10.0}
    # two seconds on: worker-0 answered 60 more (10 under 10 ms, 50 in (10, 20] ms);
    # worker-1 40 (all in (10, 20] ms)
    second = [
        (
            "worker-0",
            page({"0.01": 20, "0.02": 70, "+Inf": 70}, 70, 32, 38, refused=4, rows=(60, 20)),
        ),
        ("worker-1", page({"0.01": 0, "0.02": 40, "+Inf": 40}, 40, 10, 30, rows=(40, 5))),
    ]
    point = history.add(1002.0, 52.0, parse_pages(second), {"serving": 2}, {"churn": 0.05})
    churn = point.models["churn"]
    assert point.interval_s == 2.0
    assert churn.requests_per_s == pytest.approx(100 / 2)
    # 100 answered: 10 in the first bucket, 90 in the second: rank 50 is 40 into those 90
    assert churn.p50_s == pytest.approx(0.01 + 0.01 * 40 / 90)
    assert churn.p99_s == pytest.approx(0.01 + 0.01 * 89 / 90)
    assert churn.refusals_per_s == {"queue_full": 2.0}
    # L1: 30 + 10 hits of 60 + 40 lookups in the interval
    assert churn.cache_hit_ratio == {"l1": pytest.approx(40 / 100)}
    assert churn.batch_rows_mean == pytest.approx(100 / 25)
    assert churn.batch_efficiency is None  # no worker exports it: tolerated
    assert churn.slo_s == 0.05  # from the repository, as no gauge says otherwise
    assert point.totals.requests == {"churn": 110.0}
    assert point.totals.cache_hits == {"l1": 42.0}
    assert point.totals.cache_lookups == {"l1": 42.0 + 68.0}
    assert point.totals.refusals == {"queue_full": 4.0}


def test_a_restarted_worker_counts_from_zero_and_the_ring_keeps_the_last() -> None:
    history = History(keep=2)
    samples = parse_pages([("worker-0", page({"0.01": 50, "+Inf": 50}, 50, 0, 50))])
    history.add(0.0, 0.0, samples, {}, {})
    restarted = parse_pages([("worker-0", page({"0.01": 5, "+Inf": 5}, 5, 0, 5, slo=0.02))])
    point = history.add(1.0, 1.0, restarted, {"serving": 1}, {"churn": 0.05})
    assert point.models["churn"].requests_per_s == 5.0
    assert point.models["churn"].p99_s == pytest.approx(0.01 * 0.99)
    assert point.models["churn"].slo_s == 0.02  # the workers' gauge, over the repository's
    history.add(2.0, 2.0, restarted, {"serving": 1}, {})
    assert [p.seq for p in history.since(0)] == [2, 3]
    assert [p.seq for p in history.since(2)] == [3]
    idle = history.since(2)[0].models["churn"]
    assert idle.requests_per_s == 0 and idle.p99_s is None


def test_the_line_parser_reads_what_prometheus_clients_parser_reads() -> None:
    metrics = Metrics()
    for model, outcome in [("churn", "ok"), ("churn", "error"), ('odd "name"\\', "ok")]:
        metrics.request_latency.child(model, "http", outcome).observe(0.012)
        metrics.requests.inc(model, "http", "200")
        metrics.cache_lookups.add(3, model, "l1", "hit")
    metrics.jobs_running.set(2)
    page = generate_latest(metrics.registry).decode()
    expected = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in WANTED:
                labels = {**sample.labels, "worker": "worker-0"}
                expected[sample.name, tuple(sorted(labels.items()))] = sample.value
    parsed = parse_pages([("worker-0", page)])
    assert parsed == expected
    assert parsed[JOBS_RUNNING, (("worker", "worker-0"),)] == 2.0
    assert len([k for k in parsed if k[0] == "tailserve_requests_total"]) == 2
