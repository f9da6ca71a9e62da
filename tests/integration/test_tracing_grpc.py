"""Traces of gRPC requests through a real worker on loopback: the call's traceparent is the
parent of each request's spans (a unary ModelInfer and each request of a ModelStreamInfer), the
front door's stamp becomes a span, and the reply carries the trace id and a refusal's reason."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from support.models import doubler_config, write_model
from support.servers import free_port, run_worker, wait_for
from tailserve.observability.tracing import start_tracing
from tailserve.protocols.grpc import schema
from tailserve.settings import Settings

PARENT = "00-{trace}-b7ad6b7169203331-01"
PARENT_SPAN = 0xB7AD6B7169203331


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[grpc.Channel, Any]]:
    repository = tmp_path_factory.mktemp("traced-grpc")
    write_model(repository, "m", doubler_config(cache={"enabled": True, "ttl_s": 60}))
    exporter = InMemorySpanExporter()
    tracing = start_tracing("tailserve-worker", exporter=exporter, sample=0.0)
    port = free_port()
    settings = Settings(repository=str(Path(repository)), grpc_port=port)
    with (
        run_worker(settings, tracing=tracing),
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield channel, exporter


def infer_request(value: float, request_id: str = "") -> Any:
    message = schema.ModelInferRequest(model_name="m", id=request_id)
    tensor = message.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend([1, 1])
    message.raw_input_contents.append(np.array([[value]], dtype=np.float32).tobytes())
    return message


def unary(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        f"/{schema.SERVICE}/ModelInfer",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=schema.ModelInferResponse.FromString,
    )


def spans_of(exporter: Any, trace_id: str, requests: int = 1) -> list[ReadableSpan]:
    def mine() -> list[ReadableSpan]:
        return [
            s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id
        ]

    wait_for(
        lambda: sum(s.name == "request" for s in mine()) >= requests, what="the request's spans"
    )
    return mine()


def test_a_unary_call_makes_the_span_tree_and_says_its_trace_id(
    traced: tuple[grpc.Channel, Any],
) -> None:
    channel, exporter = traced
    trace = "5af7651916cd43dd8448eb211c80319c"
    stamp = int(time.time() * 1e6) - 2_000  # the front door took it 2 ms ago
    metadata = (
        ("traceparent", PARENT.format(trace=trace)),
        ("x-frontdoor-received-us", str(stamp)),
    )
    reply, call = unary(channel).with_call(infer_request(31.0), metadata=metadata)
    assert dict(call.trailing_metadata())["x-trace-id"] == trace
    assert reply.parameters["trace_id"].string_param == trace
    assert reply.parameters["cache"].string_param == "miss"
    spans = {s.name: s for s in spans_of(exporter, trace)}
    request = spans["request"]
    assert request.parent.span_id == PARENT_SPAN
    assert request.attributes["tailserve.protocol"] == "grpc"
    assert request.attributes["tailserve.route"] == "ModelInfer"
    assert request.attributes["tailserve.cache"] == "miss"
    for name in ("decode", "cache.l1", "queue", "compute", "respond"):
        assert spans[name].parent.span_id == request.context.span_id, name
        assert request.start_time <= spans[name].start_time <= spans[name].end_time
        assert spans[name].end_time <= request.end_time, name
    door = spans["frontdoor"]
    assert door.start_time == stamp * 1000 and door.parent.span_id == PARENT_SPAN


def test_a_unary_refusal_says_why_in_its_trailing_metadata(
    traced: tuple[grpc.Channel, Any],
) -> None:
    channel, exporter = traced
    trace = "6af7651916cd43dd8448eb211c80319c"
    metadata = (("traceparent", PARENT.format(trace=trace)),)
    refused = infer_request(32.0)
    refused.parameters["timeout"].int64_param = 1  # 1 µs: no deadline can be met
    with pytest.raises(grpc.RpcError) as raised:
        unary(channel)(refused, metadata=metadata, timeout=30)
    error: Any = raised.value
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    trailing = dict(error.trailing_metadata())
    assert trailing["x-refusal-reason"] == "deadline_unmeetable"
    assert trailing["x-trace-id"] == trace
    (request,) = [s for s in spans_of(exporter, trace) if s.name == "request"]
    assert request.attributes["tailserve.refusal_reason"] == "deadline_unmeetable"
    assert request.attributes["http.response.status_code"] == 429


def test_each_request_of_a_stream_is_traced_under_the_calls_parent(
    traced: tuple[grpc.Channel, Any],
) -> None:
    channel, exporter = traced
    trace = "7af7651916cd43dd8448eb211c80319c"
    stamp = int(time.time() * 1e6) - 1_000
    metadata = (
        ("traceparent", PARENT.format(trace=trace)),
        ("x-frontdoor-received-us", str(stamp)),
    )
    call = channel.stream_stream(
        f"/{schema.SERVICE}/ModelStreamInfer",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=schema.ModelStreamInferResponse.FromString,
    )
    sends = [infer_request(40.0 + i, f"r{i}") for i in range(3)]
    answers = list(call(iter(sends), metadata=metadata, timeout=30))
    assert [a.error_message for a in answers] == ["", "", ""]
    assert {a.infer_response.parameters["trace_id"].string_param for a in answers} == {trace}
    spans = spans_of(exporter, trace, requests=3)
    requests = [s for s in spans if s.name == "request"]
    assert all(s.parent.span_id == PARENT_SPAN for s in requests)
    assert {s.attributes["tailserve.route"] for s in requests} == {"ModelStreamInfer"}
    computes = [s for s in spans if s.name == "compute"]
    assert {s.parent.span_id for s in computes} <= {s.context.span_id for s in requests}
    # The front door's stamp is the stream's opening: its first request's span only.
    assert len([s for s in spans if s.name == "frontdoor"]) == 1


def test_a_stream_refusal_says_why_in_its_answer(traced: tuple[grpc.Channel, Any]) -> None:
    channel, _ = traced
    call = channel.stream_stream(
        f"/{schema.SERVICE}/ModelStreamInfer",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=schema.ModelStreamInferResponse.FromString,
    )
    refused = infer_request(50.0, "late")
    refused.parameters["timeout"].int64_param = 1  # 1 µs: no deadline can be met
    (answer,) = list(call(iter([refused]), timeout=30))
    assert answer.error_message
    assert answer.infer_response.id == "late"
    assert answer.infer_response.parameters["refusal_reason"].string_param == "deadline_unmeetable"


def test_unsampled_calls_make_no_spans(traced: tuple[grpc.Channel, Any]) -> None:
    channel, exporter = traced
    before = len(exporter.get_finished_spans())
    not_sampled = (("traceparent", "00-8af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),)
    for metadata in ((), not_sampled):
        reply, call = unary(channel).with_call(infer_request(60.0), metadata=metadata)
        assert "trace_id" not in reply.parameters
        assert "x-trace-id" not in dict(call.trailing_metadata())
    assert len(exporter.get_finished_spans()) == before
