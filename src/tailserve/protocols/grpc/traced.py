"""A gRPC request's spans, while tracing is on: what the call's metadata says (``traceparent``,
``tracestate``, the front door's ``x-frontdoor-received-us``) and the marks of one request of
it, made into the same spans as an HTTP request's (`observability/worker_spans.py`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from tailserve.observability.metrics import Metrics
from tailserve.observability.tracing import MARKS, Marks, Tracing
from tailserve.observability.worker_spans import Arrival, record

_READ = ("traceparent", "tracestate", "x-frontdoor-received-us")


@dataclass(frozen=True, slots=True)
class Heads:
    """The call's trace metadata, and the method (ModelInfer, ModelStreamInfer)."""

    traceparent: str | None
    tracestate: str | None
    frontdoor_us: str | None
    method: str

    @classmethod
    def of(cls, context: Any, method: str) -> Heads:
        found: dict[str, str] = {}
        for key, value in context.invocation_metadata() or ():
            if key in _READ and isinstance(value, str):
                found.setdefault(key, value)
        return cls(
            found.get("traceparent"),
            found.get("tracestate"),
            found.get("x-frontdoor-received-us"),
            method,
        )

    def later(self) -> Heads:
        """The heads for a stream's later requests: the front door's stamp was the stream's
        opening, not theirs."""
        return dataclasses.replace(self, frontdoor_us=None)


class RequestTrace:
    """One request's marks and, once it is answered, its spans and trace id."""

    __slots__ = ("heads", "marks", "trace_id", "tracing")

    def __init__(self, tracing: Tracing | None, heads: Heads) -> None:
        assert tracing is not None
        self.tracing = tracing
        self.heads = heads
        self.marks: Marks | None = None
        self.trace_id: str | None = None

    def decoded(self) -> Marks:
        """The request's marks, noted from now on (the cache and pipelines note theirs)."""
        marks = self.marks = Marks()
        marks.decoded_at = time.monotonic()
        MARKS.set(marks)
        return marks

    def record(
        self, model: str, received_at: float, status: int, refusal: str | None
    ) -> str | None:
        """Emit the request's spans (once); its trace id when sampled."""
        heads = self.heads
        arrival = Arrival(
            heads.traceparent,
            heads.tracestate,
            heads.frontdoor_us,
            received_at,
            heads.method,
            model,
            "grpc",
        )
        marks = self.marks
        parameters = marks.parameters if marks is not None else None
        self.trace_id = record(self.tracing, arrival, status, marks, parameters, refusal)
        return self.trace_id

    def exemplify(self, metrics: Metrics, model: str) -> None:
        """The trace id as the example of its compute-time bucket, where it computed."""
        parameters = self.marks.parameters if self.marks is not None else None
        if self.trace_id is not None and parameters and parameters.get("compute_us"):
            bucket = str(parameters.get("cost_class", ""))
            metrics.on_traced_compute(model, bucket, parameters["compute_us"] / 1e6, self.trace_id)
