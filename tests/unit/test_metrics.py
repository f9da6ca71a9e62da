"""The lock-free histograms expose what Prometheus expects: cumulative buckets, sum, count."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tailserve.engine.accounts import BatchRecord
from tailserve.observability.metrics import CostRow, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def record(rows: int, queue_s: list[float], missed: int = 0) -> BatchRecord:
    return BatchRecord(
        "m",
        "all",
        rows,
        compute_s=0.003,
        wall_s=0.004,
        predicted_s=0.0035,
        queue_s=queue_s,
        missed=missed,
    )


def test_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    metrics = Metrics()
    metrics.on_batch(record(1, [0.0004, 0.02]))
    metrics.on_batch(record(3, [], missed=2))
    got = samples(metrics)
    rows = "tailserve_batch_size_rows_bucket"
    labels = (("bucket", "all"),)
    assert got[(rows, (*labels, ("le", "1.0"), ("model", "m")))] == 1  # 1 <= 1
    assert got[(rows, (*labels, ("le", "2.0"), ("model", "m")))] == 1
    assert got[(rows, (*labels, ("le", "4.0"), ("model", "m")))] == 2
    assert got[(rows, (*labels, ("le", "+Inf"), ("model", "m")))] == 2
    assert got[("tailserve_batch_size_rows_sum", (*labels, ("model", "m")))] == 4
    assert got[("tailserve_queue_duration_seconds_count", (("model", "m"),))] == 2
    queue = "tailserve_queue_duration_seconds_bucket"
    assert got[(queue, (("le", "0.0005"), ("model", "m")))] == 1
    assert got[("tailserve_batch_predicted_seconds_sum", (*labels, ("model", "m")))] == 0.007
    assert got[("tailserve_deadline_misses_total", (("model", "m"),))] == 2


def test_rejections_by_reason_and_cost_models() -> None:
    metrics = Metrics()
    metrics.on_reject("m", "deadline")
    metrics.on_reject("m", "deadline")
    metrics.on_reject("m", "expired")
    metrics.on_reject("m", "deadline", needless=True)
    metrics.watch_costs(lambda: [CostRow("m", "1", "len<=16", 0.002, 0.00001)])
    got = samples(metrics)
    rejected = "tailserve_rejected_requests_total"
    assert got[(rejected, (("model", "m"), ("reason", "deadline")))] == 3
    assert got[("tailserve_false_refusals_total", (("model", "m"),))] == 1
    assert got[(rejected, (("model", "m"), ("reason", "expired")))] == 1
    labels = (("bucket", "len<=16"), ("model", "m"), ("version", "1"))
    assert got[("tailserve_cost_model_fixed_seconds", labels)] == 0.002
    assert got[("tailserve_cost_model_per_row_seconds", labels)] == 0.00001


def test_requests_counted_by_status_and_outcome() -> None:
    metrics = Metrics()
    metrics.on_request("m", "v2", 200, 0.01)
    metrics.on_request("m", "v2", 200, 0.02)
    metrics.on_request("m", "v2", 400, 0.001)
    metrics.set_model_ready("m", True)
    got = samples(metrics)
    assert (
        got[("tailserve_requests_total", (("model", "m"), ("protocol", "v2"), ("status", "200")))]
        == 2
    )
    latency = "tailserve_request_duration_seconds_count"
    assert got[(latency, (("model", "m"), ("outcome", "client_error"), ("protocol", "v2")))] == 1
    assert got[("tailserve_model_ready", (("model", "m"),))] == 1


def test_loads_unloads_cold_requests_and_the_memory_budget() -> None:
    metrics = Metrics()
    metrics.on_model_load("m", 0.3)
    metrics.on_model_unload("m", 0.01, "budget")
    metrics.on_cold_request("m", "waited")
    metrics.on_cold_request("m", "waited")
    metrics.on_cold_request("m", "refused")
    metrics.watch_residency(lambda: (100 * 2**20, {"a": 10 * 2**20, "b": 20 * 2**20}))
    got = samples(metrics)
    assert got[("tailserve_model_load_seconds_count", (("model", "m"),))] == 1
    assert got[("tailserve_model_load_seconds_sum", (("model", "m"),))] == 0.3
    unload = ("tailserve_model_unload_seconds_count", (("model", "m"), ("reason", "budget")))
    assert got[unload] == 1
    waited = ("tailserve_cold_requests_total", (("model", "m"), ("outcome", "waited")))
    assert got[waited] == 2
    assert got[("tailserve_models_loaded", ())] == 2
    assert got[("tailserve_model_memory_bytes", (("model", "b"),))] == 20 * 2**20
    assert got[("tailserve_model_memory_budget_bytes", ())] == 100 * 2**20
