"""The metrics of work done per unit: computational debt, batch efficiency, latency a row, and
each model's SLO (what the alert rules compare p99 with).

The histograms are the loop-thread kind of `metrics.py` (whose `Metrics` passes its class in,
registers them and hands each finished batch and each answered request on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tailserve.engine.accounts import BatchRecord
from tailserve.observability.efficiency import batch_cost

if TYPE_CHECKING:
    from tailserve.observability.loop_metrics import LoopHistogram

# A row's share of a request's latency: from 1 µs (a large request) to 10 s.
PER_ROW_BUCKETS = (
    0.000001,
    0.0000025,
    0.000005,
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    10.0,
)
# Debt a request: 0 (a full batch at the cost model's price) up to a second.
DEBT_BUCKETS = (
    0.0,
    0.000001,
    0.00001,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
EFFICIENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class SloCollector(Collector):
    """Each model's latency objective (``slo.p99_ms``), read when scraped."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] | None = None

    def collect(self) -> Iterator[Metric]:
        slo = GaugeMetricFamily(
            "tailserve_model_slo_seconds",
            "Each model's p99 latency objective (model.yaml's slo.p99_ms), seconds.",
            labels=["model"],
        )
        for model, seconds in sorted((self.source() if self.source is not None else {}).items()):
            slo.add_metric([model], seconds)
        yield slo


class WorkMetrics:
    def __init__(self, histogram: type[LoopHistogram]) -> None:
        self.debt = histogram(
            "tailserve_compute_debt_seconds",
            "Computational debt of each computed request: its rows' share of the compute its "
            "batch spent beyond what the same rows cost at the best batch (the largest the "
            "model may run, at the cost model's price); the sum is the model's debt.",
            ["model"],
            DEBT_BUCKETS,
        )
        self.efficiency = histogram(
            "tailserve_batch_efficiency_ratio",
            "Each batch's rows served per second of compute, as a share (0..1) of the best "
            "batch's at the cost model's price.",
            ["model"],
            EFFICIENCY_BUCKETS,
        )
        self.per_row = histogram(
            "tailserve_request_duration_per_row_seconds",
            "Each answered inference request's time, from received to answer ready, divided "
            "by its rows: the latency of one computational unit.",
            ["model"],
            PER_ROW_BUCKETS,
        )
        self.slo = SloCollector()

    def histograms(self) -> list[LoopHistogram]:
        return [self.debt, self.efficiency, self.per_row]

    def on_batch(self, record: BatchRecord) -> None:
        cost = batch_cost(record.rows, record.compute_s, record.best_s_per_row, record.rows_each)
        if cost is None:
            return
        self.efficiency.child(record.model).observe(cost.efficiency)
        debt = self.debt.child(record.model)
        for share in cost.debts_s:
            debt.observe(share)

    def on_served(self, model: str, rows: int, seconds: float) -> None:
        if rows > 0:
            self.per_row.child(model).observe(seconds / rows)
