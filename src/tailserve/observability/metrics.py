"""Prometheus metrics of one process, as histograms rather than averages.

Each server owns its own registry (tests run several servers in one process). The request-path
metrics are updated only from the event loop's thread (`observability.loop_metrics`); a
collector turns them into Prometheus families when `/metrics` is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics import exposition as _openmetrics
from prometheus_client.registry import Collector

from tailserve.engine.accounts import BatchRecord
from tailserve.observability.loop_metrics import LoopCollector, LoopCounter, LoopHistogram
from tailserve.observability.work import WorkMetrics

if TYPE_CHECKING:
    from tailserve.cache.replies import ReplyMemo
    from tailserve.cache.tiered import ResultCache

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The format with exemplars (a sampled request's trace id on the latency histograms' buckets).
OPENMETRICS_CONTENT_TYPE = _openmetrics.CONTENT_TYPE_LATEST

# Seconds: from 100 µs to 10 s, dense where a p99 of tens of milliseconds lives.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A job waits and runs for seconds to hours.
JOB_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# A model loads (or unloads) in milliseconds to minutes.
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True, slots=True)
class CostRow:
    model: str
    version: str
    bucket: str
    fixed_s: float
    per_row_s: float


class _CostCollector(Collector):
    def __init__(self) -> None:
        self.source: Callable[[], Iterable[CostRow]] | None = None

    def collect(self) -> Iterator[Metric]:
        source = self.source
        labels = ["model", "version", "bucket"]
        fixed = GaugeMetricFamily(
            "tailserve_cost_model_fixed_seconds",
            "The cost model's fixed time per batch, by cost class.",
            labels=labels,
        )
        per_row = GaugeMetricFamily(
            "tailserve_cost_model_per_row_seconds",
            "The cost model's time per row of a batch, by cost class.",
            labels=labels,
        )
        for row in source() if source is not None else ():
            fixed.add_metric([row.model, row.version, row.bucket], row.fixed_s)
            per_row.add_metric([row.model, row.version, row.bucket], row.per_row_s)
        yield fixed
        yield per_row


class _TrafficCollector(Collector):
    """The requests the protocol adapters hold now, HTTP and gRPC together."""

    def __init__(self) -> None:
        self.source: Callable[[], tuple[int, int, int]] | None = None

    def collect(self) -> Iterator[Metric]:
        in_flight = self.source()[0] if self.source is not None else 0
        yield GaugeMetricFamily(
            "tailserve_requests_in_flight",
            "Requests being answered now, HTTP and gRPC together, the scrape that reads this "
            "among them (what an autoscaler divides by the requests a worker should carry).",
            value=in_flight,
        )


class _CacheStateCollector(Collector):
    """L1 sizes and the L2 breaker, read from the cache when scraped."""

    def __init__(self) -> None:
        self.cache: ResultCache | None = None
        self.memo: ReplyMemo | None = None

    def collect(self) -> Iterator[Metric]:
        cache = self.cache
        entries = GaugeMetricFamily(
            "tailserve_cache_entries", "Results held in L1, by model.", labels=["model"]
        )
        size = GaugeMetricFamily(
            "tailserve_cache_bytes", "Bytes of results held in L1, by model.", labels=["model"]
        )
        breaker = GaugeMetricFamily(
            "tailserve_cache_l2_breaker_state",
            "The Redis tier's circuit breaker: 0 closed, 1 open, 2 half-open.",
        )
        if cache is not None:
            for model, l1 in cache.l1s().items():
                entries.add_metric([model], len(l1))
                size.add_metric([model], l1.bytes)
            if cache.redis is not None:
                breaker.add_metric([], cache.redis.breaker.state.value)
        yield entries
        yield size
        yield breaker
        memo = self.memo
        if memo is not None:
            yield GaugeMetricFamily(
                "tailserve_cache_reply_memo_entries",
                "Encoded replies kept (cache/replies.py).",
                value=len(memo),
            )
            yield GaugeMetricFamily(
                "tailserve_cache_reply_memo_bytes",
                "Bytes of encoded replies kept.",
                value=memo.bytes,
            )
            yield CounterMetricFamily(
                "tailserve_cache_reply_memo_hits",
                "Requests answered with a kept reply (each also counts as an L1 hit).",
                value=memo.hits,
            )
            yield CounterMetricFamily(
                "tailserve_cache_reply_memo_stale",
                "Kept replies dropped when asked for: L1 no longer held their entry fresh.",
                value=memo.stale,
            )


class _ResidencyCollector(Collector):
    """The models loaded and what each holds, against the worker's memory budget."""

    def __init__(self) -> None:
        self.source: Callable[[], tuple[int, dict[str, int]]] | None = None

    def collect(self) -> Iterator[Metric]:
        budget, resident = self.source() if self.source is not None else (0, {})
        yield GaugeMetricFamily(
            "tailserve_models_loaded", "Models loaded on this worker now.", value=len(resident)
        )
        held = GaugeMetricFamily(
            "tailserve_model_memory_bytes",
            "What each loaded model costs: the larger of its artifact bytes and what its last "
            "build was measured to add to the process.",
            labels=["model"],
        )
        for model, size in sorted(resident.items()):
            held.add_metric([model], size)
        yield held
        yield GaugeMetricFamily(
            "tailserve_model_memory_budget_bytes",
            "The memory the worker's models may hold together (0: no budget).",
            value=budget,
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The series the event loop updates (`loop_metrics`), exported by one collector.
        self._series: list[LoopHistogram | LoopCounter] = []
        self._request_series()
        self._refusal_series()
        self._loop_series()
        self._cache_series()
        self._job_and_model_series()
        # Debt, efficiency, latency a row and the SLOs (observability/work.py).
        self.work = WorkMetrics(LoopHistogram)
        self.registry.register(self.work.slo)
        self.registry.register(LoopCollector([*self._series, *self.work.histograms()]))
        # Read when scraped: the cost models, the cache's sizes and breaker, the reply memo
        # (the worker names them with the watch_* methods).
        self._costs = _CostCollector()
        self.registry.register(self._costs)
        self._cache_state = _CacheStateCollector()
        self.registry.register(self._cache_state)
        self._traffic = _TrafficCollector()
        self.registry.register(self._traffic)
        self._residency = _ResidencyCollector()
        self.registry.register(self._residency)
        self.model_ready = Gauge(
            "tailserve_model_ready",
            "1 when the model's served versions are loaded and warm.",
            ["model"],
            registry=self.registry,
        )
        self.jobs_running = Gauge(
            "tailserve_jobs_running", "Jobs this worker holds now.", registry=self.registry
        )

    def _histogram(
        self, name: str, documentation: str, labels: list[str], buckets: Sequence[float]
    ) -> LoopHistogram:
        series = LoopHistogram(name, documentation, labels, buckets)
        self._series.append(series)
        return series

    def _counter(self, name: str, documentation: str, labels: list[str]) -> LoopCounter:
        series = LoopCounter(name, documentation, labels)
        self._series.append(series)
        return series

    def _request_series(self) -> None:
        """Requests, their latency, and the batches that served them."""
        self.request_latency = self._histogram(
            "tailserve_request_duration_seconds",
            "Time from request received to response ready.",
            ["model", "protocol", "outcome"],
            LATENCY_BUCKETS,
        )
        self.requests = self._counter(
            "tailserve_requests",
            "Requests answered, by HTTP status.",
            ["model", "protocol", "status"],
        )
        self.queue_time = self._histogram(
            "tailserve_queue_duration_seconds",
            "Time a request waited in its model's batch queue.",
            ["model"],
            LATENCY_BUCKETS,
        )
        self.compute_time = self._histogram(
            "tailserve_compute_duration_seconds",
            "Time one batch spent in the runtime (merge, predict, split), by cost class: what "
            "tailserve_batch_predicted_seconds predicts.",
            ["model", "bucket"],
            LATENCY_BUCKETS,
        )
        self.batch_size = self._histogram(
            "tailserve_batch_size_rows",
            "Rows in each batch run, by cost class.",
            ["model", "bucket"],
            BATCH_BUCKETS,
        )
        self.batch_time = self._histogram(
            "tailserve_batch_duration_seconds",
            "Time from a batch's dispatch until its results were back, by cost class.",
            ["model", "bucket"],
            LATENCY_BUCKETS,
        )
        self.batch_predicted = self._histogram(
            "tailserve_batch_predicted_seconds",
            "What the cost model predicted each batch would take, by cost class.",
            ["model", "bucket"],
            LATENCY_BUCKETS,
        )

    def _refusal_series(self) -> None:
        """Requests refused, late, and the variants that computed them."""
        self.rejected = self._counter(
            "tailserve_rejected_requests",
            "Requests refused or dropped by the batcher: queue_full, deadline (at admission), "
            "expired (in the queue).",
            ["model", "reason"],
        )
        self.false_refusals = self._counter(
            "tailserve_false_refusals",
            "Refusals made while the model's admitted requests had a p99 within half the SLO "
            "over the last second and the event loop time to spare: not needed.",
            ["model"],
        )
        self.deadline_misses = self._counter(
            "tailserve_deadline_misses", "Requests answered after their deadline.", ["model"]
        )
        self.variant_requests = self._counter(
            "tailserve_variant_requests",
            "Requests a model with variants computed, by the variant that ran them.",
            ["model", "variant"],
        )

    def _loop_series(self) -> None:
        """The event loop: its lag and the full collections it ran."""
        self.loop_lag = self._histogram(
            "tailserve_event_loop_lag_seconds",
            "How late the event loop ran a timer: the wait of anything ready to run.",
            [],
            LATENCY_BUCKETS,
        )
        self.gc_full_pause = self._histogram(
            "tailserve_gc_full_pause_seconds",
            "Full garbage collections the event loop ran (every --gc-full-interval-s), by how "
            "long they stopped it.",
            [],
            LATENCY_BUCKETS,
        )

    def _cache_series(self) -> None:
        """The result cache's tiers and the feature cache."""
        self.cache_lookups = self._counter(
            "tailserve_cache_lookups",
            "Result cache lookups by tier (l1, l2) and result (hit, stale, stale_overloaded = "
            "past the grace window, served because the model was overloaded; misses: cold = "
            "never seen, expired, evicted at L1; miss, expired at L2).",
            ["model", "tier", "result"],
        )
        self.cache_computations = self._counter(
            "tailserve_cache_computations",
            "Results computed on a cache miss: first = never computed here before, recompute = "
            "computed before but expired or evicted (the recomputation rate's numerator).",
            ["model", "kind"],
        )
        self.cache_coalesced = self._counter(
            "tailserve_cache_coalesced_requests",
            "Requests answered by waiting for an identical request in flight.",
            ["model"],
        )
        self.cache_evictions = self._counter(
            "tailserve_cache_evictions", "Results evicted from L1 for room.", ["model"]
        )
        self.feature_lookups = self._counter(
            "tailserve_feature_lookups",
            "Entity feature rows looked up, by entity and result (hit in the in-process feature "
            "cache; cold, expired, evicted: read from the store).",
            ["entity", "result"],
        )
        self.cache_l2_latency = self._histogram(
            "tailserve_cache_l2_duration_seconds",
            "Round-trip time of each batched Redis lookup (MGET).",
            [],
            LATENCY_BUCKETS,
        )
        self.cache_l2_skipped = self._counter(
            "tailserve_cache_l2_skipped",
            "Keys the L2 did without Redis for, by operation (lookup: answered as a miss; write: "
            "not stored) and reason (breaker: open, Redis not asked; budget: no answer in time; "
            "error: Redis or the connection failed).",
            ["operation", "reason"],
        )

    def _job_and_model_series(self) -> None:
        """Jobs, pipeline steps, and models loaded and unloaded."""
        self.jobs_finished = self._counter(
            "tailserve_jobs_finished",
            "Jobs this worker ended, by outcome: succeeded, failed, released (given back to "
            "its queue: the worker stopping, the model unloading).",
            ["model", "outcome"],
        )
        self.job_duration = self._histogram(
            "tailserve_job_duration_seconds",
            "From a job's submission until this worker finished it (succeeded or failed).",
            ["model"],
            JOB_BUCKETS,
        )
        self.stage_time = self._histogram(
            "tailserve_pipeline_stage_seconds",
            "The time each step of a pipeline took, by pipeline and stage.",
            ["pipeline", "stage"],
            LATENCY_BUCKETS,
        )
        self.stage_degradations = self._counter(
            "tailserve_pipeline_degradations",
            "Pipeline steps that ran late and degraded as declared, by pipeline, stage and how "
            "(fewer: fewer rows passed on; variant: a cheaper variant; fallback: the declared "
            "fallback instead of the step's answer).",
            ["pipeline", "stage", "how"],
        )
        self.model_load_time = self._histogram(
            "tailserve_model_load_seconds",
            "Time to load and warm a model (every chosen version), at start, on demand or by "
            "request.",
            ["model"],
            LOAD_BUCKETS,
        )
        self.model_unload_time = self._histogram(
            "tailserve_model_unload_seconds",
            "Time to unload a model (its queued requests drained), by reason: budget (to make "
            "room for another) or request (the repository API).",
            ["model", "reason"],
            LOAD_BUCKETS,
        )
        self.cold_requests = self._counter(
            "tailserve_cold_requests",
            "Requests that found their model unloaded for the memory budget, by outcome: waited "
            "(for its load, then served), refused (the load would end past the deadline), late "
            "(the load outlasted the deadline), failed (the load failed).",
            ["model", "outcome"],
        )

    def watch_costs(self, source: Callable[[], Iterable[CostRow]]) -> None:
        """Export the cost model of each (model, version, cost class) that `source` lists."""
        self._costs.source = source

    def watch_traffic(self, source: Callable[[], tuple[int, int, int]]) -> None:
        """Export the requests in flight: the first of (in flight, answered, refused)."""
        self._traffic.source = source

    def watch_cache(self, cache: ResultCache, memo: ReplyMemo | None = None) -> None:
        """Export the result cache's L1 sizes and L2 breaker, and the reply memo's counts."""
        self._cache_state.cache = cache
        self._cache_state.memo = memo

    def watch_slos(self, source: Callable[[], dict[str, float]]) -> None:
        """Export each model's SLO: ``source`` gives {model: p99 objective in seconds}."""
        self.work.slo.source = source

    def watch_residency(self, source: Callable[[], tuple[int, dict[str, int]]]) -> None:
        """Export the memory budget and the loaded models' sizes: ``source`` gives (budget
        bytes, {model: bytes})."""
        self._residency.source = source

    def on_request(
        self, model: str, protocol: str, status: int, seconds: float, trace_id: str | None = None
    ) -> None:
        outcome = "success" if status < 400 else "client_error" if status < 500 else "error"
        latency = self.request_latency.child(model, protocol, outcome)
        latency.observe(seconds)
        if trace_id is not None:
            latency.exemplar(seconds, trace_id)
        self.requests.inc(model, protocol, str(status))

    def on_traced_compute(self, model: str, bucket: str, seconds: float, trace_id: str) -> None:
        """A traced request's batch time, as the example of its compute-time bucket (the
        batch itself was observed by `on_batch`)."""
        self.compute_time.child(model, bucket).exemplar(seconds, trace_id)

    def on_batch(self, record: BatchRecord) -> None:
        model, bucket = record.model, record.bucket
        self.batch_size.child(model, bucket).observe(record.rows)
        self.compute_time.child(model, bucket).observe(record.compute_s)
        self.batch_time.child(model, bucket).observe(record.wall_s)
        self.batch_predicted.child(model, bucket).observe(record.predicted_s)
        queue = self.queue_time.child(model)
        for seconds in record.queue_s:
            queue.observe(seconds)
        if record.missed:
            self.deadline_misses.values[(model,)] = (
                self.deadline_misses.values.get((model,), 0) + record.missed
            )
        if record.variant:
            self.variant_requests.add(len(record.queue_s), model, record.variant)
        self.work.on_batch(record)

    def on_served(self, model: str, rows: int, seconds: float) -> None:
        """An inference request answered (engine.dataplane.DataPlane.on_served)."""
        self.work.on_served(model, rows, seconds)

    # --- the result cache (tailserve.cache.tiered.CacheObserver) ----------------------------

    def on_lookup(self, model: str, tier: str, result: str) -> None:
        self.cache_lookups.inc(model, tier, result)

    def on_compute(self, model: str, recompute: bool) -> None:
        self.cache_computations.inc(model, "recompute" if recompute else "first")

    def on_coalesced(self, model: str) -> None:
        self.cache_coalesced.inc(model)

    def on_evict(self, model: str, size: int) -> None:
        self.cache_evictions.inc(model)

    def on_feature_lookup(self, entity: str, result: str, count: int) -> None:
        key = (entity, result)
        self.feature_lookups.values[key] = self.feature_lookups.values.get(key, 0) + count

    def on_reject(self, model: str, reason: str, *, needless: bool = False) -> None:
        self.rejected.inc(model, reason)
        if needless:
            self.false_refusals.inc(model)

    def on_job(self, model: str, outcome: str, seconds: float | None) -> None:
        self.jobs_finished.inc(model, outcome)
        if seconds is not None:
            self.job_duration.child(model).observe(seconds)

    def on_stage(self, pipeline: str, stage: str, seconds: float, degradations: list[str]) -> None:
        self.stage_time.child(pipeline, stage).observe(seconds)
        for how in degradations:
            self.stage_degradations.inc(pipeline, stage, how)

    # --- the catalogue (tailserve.repository.manager.LoadObserver) ----------------------------

    def on_model_load(self, model: str, seconds: float) -> None:
        self.model_load_time.child(model).observe(seconds)

    def on_model_unload(self, model: str, seconds: float, reason: str) -> None:
        self.model_unload_time.child(model, reason).observe(seconds)

    def on_cold_request(self, model: str, outcome: str) -> None:
        self.cold_requests.inc(model, outcome)

    def set_model_ready(self, model: str, ready: bool) -> None:
        self.model_ready.labels(model).set(1 if ready else 0)

    def render(self, *, openmetrics: bool = False) -> bytes:
        if openmetrics:
            return bytes(_openmetrics.generate_latest(self.registry))  # type: ignore[no-untyped-call]
        return bytes(generate_latest(self.registry))
