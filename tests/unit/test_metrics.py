"""The lock-free histograms expose what Prometheus expects: cumulative buckets, sum, count."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tailserve.observability.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    metrics = Metrics()
    metrics.on_batch("m", rows=1, compute_s=0.003, queue_s=[0.0004, 0.02])
    metrics.on_batch("m", rows=3, compute_s=0.003, queue_s=[])
    got = samples(metrics)
    rows = "tailserve_batch_size_rows_bucket"
    assert got[(rows, (("le", "1.0"), ("model", "m")))] == 1  # 1 <= 1
    assert got[(rows, (("le", "2.0"), ("model", "m")))] == 1
    assert got[(rows, (("le", "4.0"), ("model", "m")))] == 2
    assert got[(rows, (("le", "+Inf"), ("model", "m")))] == 2
    assert got[("tailserve_batch_size_rows_sum", (("model", "m"),))] == 4
    assert got[("tailserve_queue_duration_seconds_count", (("model", "m"),))] == 2
    queue = "tailserve_queue_duration_seconds_bucket"
    assert got[(queue, (("le", "0.0005"), ("model", "m")))] == 1


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
