"""The router's Prometheus metrics: per backend (in flight, EWMA latency, health, ejections)
and per model (requests, hedges sent and won, retries, shed requests, latency).

Counters and histograms are the lock-free loop-thread kind the worker uses; the per-backend
gauges are read from the backends' state when `/metrics` is scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tailserve.observability.loop_metrics import LoopCollector, LoopCounter, LoopHistogram
from tailserve.observability.metrics import CONTENT_TYPE, LATENCY_BUCKETS
from tailserve.router.backends import Backend

__all__ = ["CONTENT_TYPE", "RouterMetrics"]


class _BackendCollector(Collector):
    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        self._backends = backends

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "tailserve_router_backend_in_flight",
            "Requests in flight to each backend.",
            labels=["backend"],
        )
        latency = GaugeMetricFamily(
            "tailserve_router_backend_latency_seconds",
            "EWMA of each backend's reply latency (what p2c weighs).",
            labels=["backend"],
        )
        up = GaugeMetricFamily(
            "tailserve_router_backend_in_service",
            "1 while a backend passes its readiness checks and is not ejected.",
            labels=["backend"],
        )
        now = time.monotonic()
        for backend in self._backends():
            in_flight.add_metric([backend.id], backend.in_flight)
            latency.add_metric([backend.id], backend.latency_s or 0.0)
            up.add_metric([backend.id], 1.0 if backend.in_service(now) else 0.0)
        yield in_flight
        yield latency
        yield up


class RouterMetrics:
    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = LoopCounter(
            "tailserve_router_requests",
            "Requests answered by the router, by status.",
            ["model", "status"],
        )
        self.latency = LoopHistogram(
            "tailserve_router_request_duration_seconds",
            "Time from a request's arrival at the router to its reply.",
            ["model"],
            LATENCY_BUCKETS,
        )
        self.attempts = LoopCounter(
            "tailserve_router_backend_requests",
            "Copies sent to each backend, by kind (first, hedge, retry) and result.",
            ["backend", "kind", "result"],
        )
        self.hedges = LoopCounter(
            "tailserve_router_hedges",
            "Hedged copies by outcome: sent, won (its reply came first), refused (the budget "
            "was short when it came due; it then waits for a token), late (sent after waiting), "
            "suspect (sent at its delay though the budget was short: its replica keeps losing "
            "to hedges).",
            ["model", "outcome"],
        )
        self.retries = LoopCounter(
            "tailserve_router_retries",
            "Requests retried on another replica after a failed connection.",
            ["model"],
        )
        self.shed = LoopCounter(
            "tailserve_router_shed",
            "Requests refused at once: every replica saturated, none healthy, or no budget.",
            ["model", "reason"],
        )
        self.ejections = LoopCounter(
            "tailserve_router_ejections",
            "Outlier ejections by backend and reason.",
            ["backend", "reason"],
        )
        self.registry.register(
            LoopCollector(
                [
                    self.requests,
                    self.latency,
                    self.attempts,
                    self.hedges,
                    self.retries,
                    self.shed,
                    self.ejections,
                ]
            )
        )
        self.registry.register(_BackendCollector(backends))

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
