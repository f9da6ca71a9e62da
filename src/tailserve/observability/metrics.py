"""Prometheus metrics of one process, as histograms rather than averages.

Each server owns its own registry (tests run several servers in one process). Label children are
cached: resolving labels costs more than observing, and this sits on every request's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: from 100 µs to 10 s, dense where a p99 of tens of milliseconds lives.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            "tailserve_request_duration_seconds",
            "Time from request received to response ready.",
            ["model", "protocol", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "tailserve_requests",
            "Requests answered, by HTTP status.",
            ["model", "protocol", "status"],
            registry=r,
        )
        self.queue_time = Histogram(
            "tailserve_queue_duration_seconds",
            "Time a request waited in its model's batch queue.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_time = Histogram(
            "tailserve_compute_duration_seconds",
            "Time one batch spent in the runtime (merge, predict, split).",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "tailserve_batch_size_rows",
            "Rows in each batch run.",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.model_ready = Gauge(
            "tailserve_model_ready",
            "1 when the model's served versions are loaded and warm.",
            ["model"],
            registry=r,
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def on_request(self, model: str, protocol: str, status: int, seconds: float) -> None:
        outcome = "success" if status < 400 else "client_error" if status < 500 else "error"
        self._child(self.request_latency, model, protocol, outcome).observe(seconds)
        self._child(self.requests, model, protocol, str(status)).inc()

    def on_batch(self, model: str, rows: int, compute_s: float, queue_s: Sequence[float]) -> None:
        self._child(self.batch_size, model).observe(rows)
        self._child(self.compute_time, model).observe(compute_s)
        queue = self._child(self.queue_time, model)
        for seconds in queue_s:
            queue.observe(seconds)

    def set_model_ready(self, model: str, ready: bool) -> None:
        self._child(self.model_ready, model).set(1 if ready else 0)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
