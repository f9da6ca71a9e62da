"""Batch efficiency and computational debt (observability/efficiency.py), and the histograms
the worker exports them in (observability/work.py)."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailserve.engine.accounts import BatchRecord
from tailserve.observability.efficiency import batch_cost
from tailserve.observability.metrics import Metrics


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_a_batch_at_the_best_price_has_no_debt_and_full_efficiency() -> None:
    cost = batch_cost(rows=64, compute_s=0.0064, best_s_per_row=0.0001, rows_each=[32, 32])
    assert cost is not None
    assert cost.efficiency == pytest.approx(1.0)
    assert cost.debt_s == pytest.approx(0.0)
    assert cost.debts_s == pytest.approx((0.0, 0.0))


def test_a_small_batch_owes_what_it_spent_beyond_the_best_price_split_by_rows() -> None:
    # 4 rows took 2 ms; at the best batch a row costs 0.1 ms: 0.4 ms would have done.
    cost = batch_cost(rows=4, compute_s=0.002, best_s_per_row=0.0001, rows_each=[1, 3])
    assert cost is not None
    assert cost.efficiency == pytest.approx(0.2)
    assert cost.debt_s == pytest.approx(0.0016)
    assert cost.debts_s == pytest.approx((0.0004, 0.0012))
    assert cost.debt_s == pytest.approx(0.002 * (1 - cost.efficiency))


def test_a_batch_faster_than_the_best_price_is_capped_at_full_efficiency() -> None:
    cost = batch_cost(rows=10, compute_s=0.0005, best_s_per_row=0.0001, rows_each=[10])
    assert cost is not None
    assert cost.efficiency == 1.0
    assert cost.debt_s == 0.0


@pytest.mark.parametrize(
    ("rows", "compute_s", "best"),
    [(1, 0.001, 0.0), (0, 0.001, 0.1), (1, 0.0, 0.1), (1, math.nan, 1)],
)
def test_nothing_is_said_without_a_price_rows_or_time(
    rows: int, compute_s: float, best: float
) -> None:
    assert batch_cost(rows, compute_s, best, [rows]) is None


def test_the_worker_exports_debt_per_request_and_efficiency_per_batch() -> None:
    metrics = Metrics()
    record = BatchRecord("m", "all", 4, 0.002, 0.0025, 0.002, [0.001, 0.001], 0, "", [1, 3], 0.0001)
    metrics.on_batch(record)
    got = scrape(metrics)
    model = (("model", "m"),)
    assert got[("tailserve_compute_debt_seconds_count", model)] == 2
    assert got[("tailserve_compute_debt_seconds_sum", model)] == pytest.approx(0.0016)
    # 0.4 ms lies above 0.25 ms, at or under 0.5 ms; 1.2 ms above 1 ms, under 2.5 ms.
    debt = "tailserve_compute_debt_seconds_bucket"
    assert got[(debt, (("le", "0.00025"), *model))] == 0
    assert got[(debt, (("le", "0.0005"), *model))] == 1
    assert got[(debt, (("le", "0.001"), *model))] == 1
    assert got[(debt, (("le", "0.0025"), *model))] == 2
    assert got[("tailserve_batch_efficiency_ratio_count", model)] == 1
    assert got[("tailserve_batch_efficiency_ratio_sum", model)] == pytest.approx(0.2)
    assert got[("tailserve_batch_efficiency_ratio_bucket", (("le", "0.1"), *model))] == 0
    assert got[("tailserve_batch_efficiency_ratio_bucket", (("le", "0.2"), *model))] == 1


def test_a_batch_with_no_price_records_no_debt() -> None:
    metrics = Metrics()
    metrics.on_batch(BatchRecord("m", "all", 1, 0.002, 0.0025, 0.002, [0.001], 0))
    got = scrape(metrics)
    assert ("tailserve_compute_debt_seconds_count", (("model", "m"),)) not in got
    assert got[("tailserve_batch_size_rows_count", (("bucket", "all"), ("model", "m")))] == 1


def test_latency_per_row_and_the_slos_are_exported() -> None:
    metrics = Metrics()
    metrics.on_served("m", 4, 0.008)
    metrics.on_served("m", 0, 0.008)  # (no rows: no unit to divide by)
    metrics.watch_slos(lambda: {"m": 0.05, "n": 0.2})
    got = scrape(metrics)
    model = (("model", "m"),)
    assert got[("tailserve_request_duration_per_row_seconds_count", model)] == 1
    assert got[("tailserve_request_duration_per_row_seconds_sum", model)] == pytest.approx(0.002)
    assert got[("tailserve_model_slo_seconds", model)] == 0.05
    assert got[("tailserve_model_slo_seconds", (("model", "n"),))] == 0.2
