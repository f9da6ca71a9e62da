"""Traces through a real worker on loopback: the span tree of a request, the trace id in the
reply and on the latency histograms' exemplars, propagation from the client library, and the
refusal reason a refused request carries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from support.models import doubler_config, write_model
from support.servers import RunningWorker, free_port, run_worker, wait_for
from tailserve.client import Client
from tailserve.observability.tracing import start_tracing
from tailserve.settings import Settings

BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [2.0]}]}
SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NOT_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningWorker, Any]]:
    repository = tmp_path_factory.mktemp("traced")
    write_model(repository, "m", doubler_config(cache={"enabled": True, "ttl_s": 60}))
    exporter = InMemorySpanExporter()
    # Sample nothing on its own: only the requests that come with a sampled parent.
    tracing = start_tracing("tailserve-worker", exporter=exporter, sample=0.0)
    with run_worker(Settings(repository=str(Path(repository))), tracing=tracing) as worker:
        yield worker, exporter


def spans_of(exporter: Any, trace_id: str) -> dict[str, ReadableSpan]:
    def mine() -> list[ReadableSpan]:
        return [
            s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id
        ]

    wait_for(lambda: any(s.name == "request" for s in mine()), what="the request's spans")
    return {span.name: span for span in mine()}


def test_a_miss_then_an_l1_hit_make_their_span_trees(traced: tuple[RunningWorker, Any]) -> None:
    worker, exporter = traced
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [7.0]}]}
    headers = {"traceparent": SAMPLED.replace("0af7", "1af7")}
    miss = httpx.post(f"{worker.url}/v2/models/m/infer", json=body, headers=headers)
    assert miss.status_code == 200 and miss.headers["x-cache"] == "miss"
    trace_id = miss.headers["x-trace-id"]
    assert trace_id == "1af7651916cd43dd8448eb211c80319c"
    spans = spans_of(exporter, trace_id)
    request = spans["request"]
    assert request.parent is not None and request.parent.span_id == 0xB7AD6B7169203331
    assert request.attributes["tailserve.model"] == "m"
    assert request.attributes["tailserve.cache"] == "miss"
    assert request.attributes["http.response.status_code"] == 200
    assert {"decode", "cache.l1", "queue", "compute", "respond"} <= set(spans)
    for name in ("decode", "cache.l1", "queue", "compute", "respond"):
        assert spans[name].parent.span_id == request.context.span_id, name
        assert request.start_time <= spans[name].start_time <= spans[name].end_time
        assert spans[name].end_time <= request.end_time, name
    assert spans["compute"].attributes["tailserve.batch_size"] >= 1
    assert spans["cache.l1"].attributes["tailserve.cache.result"] in ("miss", "cold")

    headers = {"traceparent": SAMPLED.replace("0af7", "2af7")}
    hit = httpx.post(f"{worker.url}/v2/models/m/infer", json=body, headers=headers)
    assert hit.headers["x-cache"] == "l1"
    spans = spans_of(exporter, hit.headers["x-trace-id"])
    assert spans["cache.l1"].attributes["tailserve.cache.result"] == "hit"
    assert spans["request"].attributes["tailserve.cache"] == "l1"
    assert "compute" not in spans and "queue" not in spans


def test_the_front_door_stamp_becomes_a_span(traced: tuple[RunningWorker, Any]) -> None:
    worker, exporter = traced
    import time

    stamp = int(time.time() * 1e6) - 2_000  # the front door took it 2 ms ago
    headers = {
        "traceparent": SAMPLED.replace("0af7", "3af7"),
        "x-frontdoor-received-us": str(stamp),
    }
    reply = httpx.post(f"{worker.url}/v2/models/m/infer", json=BODY, headers=headers)
    spans = spans_of(exporter, reply.headers["x-trace-id"])
    door = spans["frontdoor"]
    assert door.start_time == stamp * 1000
    assert door.parent.span_id == spans["request"].parent.span_id  # both the caller's children
    assert door.end_time <= spans["request"].start_time + 1_000_000


def test_unsampled_requests_make_no_spans(traced: tuple[RunningWorker, Any]) -> None:
    worker, exporter = traced
    before = len(exporter.get_finished_spans())
    for headers in ({}, {"traceparent": NOT_SAMPLED}):
        reply = httpx.post(f"{worker.url}/v2/models/m/infer", json=BODY, headers=headers)
        assert reply.status_code == 200 and "x-trace-id" not in reply.headers
    assert len(exporter.get_finished_spans()) == before


def test_exemplars_in_an_openmetrics_scrape_only(traced: tuple[RunningWorker, Any]) -> None:
    worker, _ = traced
    headers = {"traceparent": SAMPLED.replace("0af7", "4af7")}
    reply = httpx.post(f"{worker.url}/v2/models/m/infer", json=BODY, headers=headers)
    trace_id = reply.headers["x-trace-id"]
    scraped = httpx.get(
        f"{worker.url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert scraped.headers["content-type"].startswith("application/openmetrics-text")
    lines = [line for line in scraped.text.splitlines() if "trace_id=" in line]
    assert any(
        line.startswith("tailserve_request_duration_seconds_bucket") and trace_id in line
        for line in lines
    ), lines
    assert any(line.startswith("tailserve_compute_duration_seconds_bucket") for line in lines)
    plain = httpx.get(f"{worker.url}/metrics")
    assert plain.headers["content-type"].startswith("text/plain")
    assert "trace_id" not in plain.text


def test_a_refusal_says_why(traced: tuple[RunningWorker, Any]) -> None:
    worker, _ = traced
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [11.0]}]}
    reply = httpx.post(
        f"{worker.url}/v2/models/m/infer", json=body, headers={"x-deadline-ms": "0.001"}
    )
    assert reply.status_code == 429, reply.text
    assert reply.headers["x-refusal-reason"] == "deadline_unmeetable"
    assert reply.json()["reason"] == "deadline_unmeetable"


async def test_the_client_library_propagates_its_context(
    traced: tuple[RunningWorker, Any],
) -> None:
    worker, exporter = traced
    client_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(client_spans))
    async with Client([worker.url], tracer_provider=provider, hedge=False) as client:
        with provider.get_tracer("test").start_as_current_span("caller") as caller:
            result = await client.infer("m", {"x": np.array([[5.0]], dtype=np.float32)})
    trace_id = f"{caller.get_span_context().trace_id:032x}"
    assert result.trace_id == trace_id
    (attempt,) = [s for s in client_spans.get_finished_spans() if s.name.startswith("attempt")]
    assert attempt.parent.span_id == caller.get_span_context().span_id
    assert attempt.attributes["tailserve.attempt"] == "first"
    assert attempt.attributes["tailserve.won"] is True
    assert attempt.attributes["tailserve.replica"] == result.replica
    request = spans_of(exporter, trace_id)["request"]
    assert request.parent.span_id == attempt.context.span_id


def test_an_open_l2_breaker_degrades_and_refuses_nothing(tmp_path: Path) -> None:
    # Redis gone (nothing listens at its port): the L2 breaker opens and lookups are answered
    # as misses; the request is computed, not refused, so it carries no refusal reason.
    write_model(tmp_path, "m", doubler_config(cache={"enabled": True, "ttl_s": 60}))
    exporter = InMemorySpanExporter()
    tracing = start_tracing("tailserve-worker", exporter=exporter, sample=0.0)
    settings = Settings(repository=str(tmp_path), redis_url=f"redis://127.0.0.1:{free_port()}")
    with run_worker(settings, tracing=tracing) as worker:
        sent = iter(range(1000))

        def breaker_open() -> bool:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": []}]}
            body["inputs"][0]["data"] = [float(next(sent))]
            assert httpx.post(f"{worker.url}/v2/models/m/infer", json=body).status_code == 200
            metrics = httpx.get(f"{worker.url}/metrics").text
            return "tailserve_cache_l2_breaker_state 1.0" in metrics

        wait_for(breaker_open, timeout=10, what="the L2 breaker to open")
        headers = {"traceparent": SAMPLED.replace("0af7", "5af7")}
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [-1.0]}]}
        reply = httpx.post(f"{worker.url}/v2/models/m/infer", json=body, headers=headers)
        assert reply.status_code == 200 and reply.headers["x-cache"] == "miss"
        assert "x-refusal-reason" not in reply.headers
        request = spans_of(exporter, reply.headers["x-trace-id"])["request"]
        assert request.attributes["http.response.status_code"] == 200
        assert "tailserve.refusal_reason" not in request.attributes
