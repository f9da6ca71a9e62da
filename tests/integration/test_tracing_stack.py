"""Traces from the client library through a real `tailserve up` (HAProxy, the workers) to an
OTLP/HTTP receiver: the receiver here is a small HTTP server on loopback that decodes what the
workers' exporters send, as a collector would."""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from support.models import doubler_config, write_model
from support.servers import wait_for
from support.up import tailserve_up
from tailserve.client import Client


@dataclass(frozen=True)
class Received:
    service: str
    name: str
    trace_id: str
    span_id: int
    parent_id: int | None
    attributes: dict[str, object]


class Receiver:
    """POST /v1/traces (OTLP/HTTP, protobuf): every span received, kept in order."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    parent = int.from_bytes(span.parent_span_id) if span.parent_span_id else None
                    found.append(
                        Received(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            int.from_bytes(span.span_id),
                            parent,
                            attributes,
                        )
                    )
        with self._lock:
            self.spans += found

    def of_trace(self, trace_id: str) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        thread.join(timeout=5)


async def test_a_request_is_traced_from_the_client_through_the_front_door(
    tmp_path: Path, receiver: Receiver
) -> None:
    repository = tmp_path / "repository"
    write_model(repository, "m", doubler_config())
    flags = ("--workers", "2", "--otel-endpoint", receiver.url, "--otel-sample", "1.0")
    client_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(client_spans))
    with tailserve_up(repository, tmp_path, *flags) as up:
        async with Client([up.url], tracer_provider=provider, hedge=False) as client:
            with provider.get_tracer("test").start_as_current_span("caller") as caller:
                result = await client.infer("m", {"x": np.array([[3.0]], dtype=np.float32)})
        trace_id = f"{caller.get_span_context().trace_id:032x}"
        assert result.trace_id == trace_id  # the worker's reply says the client's trace

        def arrived() -> bool:
            names = {s.name for s in receiver.of_trace(trace_id)}
            return {"request", "frontdoor", "compute"} <= names

        with contextlib.suppress(AssertionError):
            wait_for(arrived, timeout=10, what="the worker's spans at the receiver")
        spans = {s.name: s for s in receiver.of_trace(trace_id)}
        assert {"request", "frontdoor", "decode", "queue", "compute", "respond"} <= set(spans), (
            spans
        )
    (attempt,) = [s for s in client_spans.get_finished_spans() if s.name == "attempt first"]
    attempt_id = attempt.context.span_id
    request, door = spans["request"], spans["frontdoor"]
    assert {s.service for s in spans.values()} == {"tailserve-worker"}
    # HAProxy passed the client's traceparent on unchanged: the worker's spans hang under the
    # client's attempt, the front door's beside the request's.
    assert request.parent_id == attempt_id and door.parent_id == attempt_id
    assert request.attributes["tailserve.model"] == "m"
    assert isinstance(door.attributes["tailserve.frontdoor.wait_us"], int)
    for name in ("decode", "queue", "compute", "respond"):
        assert spans[name].parent_id == request.span_id, name
