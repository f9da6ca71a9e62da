"""OpenTelemetry traces: one process's tracer, and the W3C ``traceparent`` it reads and writes.

Tracing is an optional extra (``pip install 'tailserve[otel]'``). `start_tracing` returns None
when it is off (no endpoint and no exporter), and nothing in this module imports OpenTelemetry
until it is on: a hot path holds a ``Tracing | None`` and tests it against None, which is all
tracing costs there when it is off.

Sampling is parent-based: a request whose incoming ``traceparent`` says sampled is always
traced, one that says not sampled never is, and one with none is traced with probability
``sample``. Spans go out in batches over OTLP/HTTP (protobuf) from a background thread.

A worker's spans are made after its request is answered, from the times the request took at
each stage (`worker_spans.py`); the cache tiers' moments come from `CacheMarks`, an observer of
the result cache that notes them for the request being traced (a context variable), only while
tracing is on; a pipeline's steps from `StageMarks`, the same way.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import Any

from tailserve.errors import ConfigError

# The standard variable the OTLP exporters read (the endpoint's base URL; /v1/traces is added).
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_PATH = "/v1/traces"


class Marks:
    """What a traced request passed on its way, as `time.monotonic` readings: decoded and
    answered by the data plane, and each cache or pipeline event (what, result, when in ns;
    a pipeline step's event carries its seconds as well)."""

    __slots__ = ("answered_at", "decoded_at", "events", "parameters")

    def __init__(self) -> None:
        self.decoded_at = 0.0
        self.answered_at = 0.0
        self.events: list[tuple[str, str, int, float]] = []
        # The response's parameters (how it was served: cache, batch size, queue and compute).
        self.parameters: dict[str, Any] | None = None


# The request being traced in this task (set by the worker's adapters while tracing is on).
MARKS: contextvars.ContextVar[Marks | None] = contextvars.ContextVar(
    "tailserve_marks", default=None
)


def parse_traceparent(value: str | bytes | None) -> tuple[str, str, bool] | None:
    """A W3C ``traceparent`` as (trace id, parent span id, sampled); None if malformed."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    parts = text.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        if int(parts[1], 16) == 0 or int(parts[2], 16) == 0:
            return None
        flags = int(parts[3], 16)
    except ValueError:
        return None
    return parts[1], parts[2], bool(flags & 1)


class Tracing:
    """One process's tracer (``service``: tailserve-worker, tailserve-router, ...)."""

    def __init__(self, provider: Any, service: str, *, own_provider: bool = True) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.service = service
        self.provider = provider
        self.tracer = provider.get_tracer("tailserve")
        self._trace = trace
        self._kinds = trace.SpanKind
        self._propagator = TraceContextTextMapPropagator()
        self._own = own_provider

    # --- contexts -----------------------------------------------------------------------------

    def parent(self, traceparent: str | bytes | None, tracestate: str | bytes | None = None) -> Any:
        """The remote context a ``traceparent`` (and ``tracestate``) names; None: a root."""
        if traceparent is None:
            return None
        carrier = {"traceparent": _text(traceparent)}
        if tracestate is not None:
            carrier["tracestate"] = _text(tracestate)
        context = self._propagator.extract(carrier)
        span = self._trace.get_current_span(context)
        return context if span.get_span_context().is_valid else None

    def current(self) -> Any:
        """The caller's context (the client library's spans hang under the caller's)."""
        from opentelemetry import context

        return context.get_current()

    def context_of(self, span: Any) -> Any:
        return self._trace.set_span_in_context(span)

    def headers(self, span: Any) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span`` as the parent."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    # --- spans --------------------------------------------------------------------------------

    def start(
        self,
        name: str,
        *,
        parent: Any = None,
        start_ns: int | None = None,
        kind: str = "internal",
        attributes: Mapping[str, Any] | None = None,
        links: list[Any] | None = None,
    ) -> Any:
        """A started span (``kind``: internal, server, client); end it with ``span.end()``."""
        return self.tracer.start_span(
            name,
            context=parent,
            kind=getattr(self._kinds, kind.upper()),
            attributes=dict(attributes) if attributes else None,
            links=links,
            start_time=start_ns,
        )

    def span(
        self,
        name: str,
        parent: Any,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> Any:
        """A span already over: from ``start_ns`` to ``end_ns`` under ``parent`` (a span)."""
        span = self.start(
            name,
            parent=self._trace.set_span_in_context(parent),
            start_ns=start_ns,
            attributes=attributes,
        )
        span.end(end_time=max(end_ns, start_ns))
        return span

    def link(self, span: Any) -> Any:
        return self._trace.Link(span.get_span_context())

    @staticmethod
    def trace_id(span: Any) -> str | None:
        """The hex trace id of a recording (sampled) span; None for one not sampled."""
        if not span.is_recording():
            return None
        return format(span.get_span_context().trace_id, "032x")

    def error(self, span: Any, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, message))

    def flush(self, timeout_s: float = 5.0) -> None:
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        if self._own:
            self.provider.shutdown()


def start_tracing(
    service: str,
    *,
    endpoint: str | None = None,
    sample: float = 1.0,
    env: Mapping[str, str] | None = None,
    exporter: Any = None,
) -> Tracing | None:
    """The process's `Tracing`, or None when tracing is off: no ``endpoint``, no
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` in ``env`` and no ``exporter`` (a test's, in memory)."""
    endpoint = endpoint or (env or {}).get(ENDPOINT_ENV) or None
    if endpoint is None and exporter is None:
        return None
    if not 0.0 <= sample <= 1.0:
        raise ConfigError(f"the trace sample ratio must be between 0 and 1, not {sample}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise ConfigError(
            "tracing needs OpenTelemetry: pip install 'tailserve[otel]' (or give no "
            "--otel-endpoint and unset OTEL_EXPORTER_OTLP_ENDPOINT)"
        ) from None
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(sample)),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if endpoint is not None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                "exporting traces needs opentelemetry-exporter-otlp-proto-http: "
                "pip install 'tailserve[otel]'"
            ) from None
        url = endpoint.rstrip("/")
        if not url.endswith(TRACES_PATH):
            url += TRACES_PATH
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=1000)
        )
    return Tracing(provider, service)


def _mark(what: str, result: str, seconds: float = 0.0) -> None:
    marks = MARKS.get()
    if marks is not None:
        marks.events.append((what, result, time.monotonic_ns(), seconds))


class CacheMarks:
    """The result cache's observer while tracing is on: passes every event on to ``inner``
    (the metrics), and notes the moment of each for the request being traced, if any."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def on_lookup(self, model: str, tier: str, result: str) -> None:
        _mark(tier, result)
        self.inner.on_lookup(model, tier, result)

    def on_compute(self, model: str, recompute: bool) -> None:
        self.inner.on_compute(model, recompute)

    def on_coalesced(self, model: str) -> None:
        _mark("coalesced", "wait")
        self.inner.on_coalesced(model)

    def on_evict(self, model: str, size: int) -> None:
        self.inner.on_evict(model, size)


class StageMarks:
    """The pipelines' observer while tracing is on: each step's end and length, noted for the
    request being traced, and passed on to ``inner`` (the metrics)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def on_stage(self, pipeline: str, stage: str, seconds: float, degradations: list[str]) -> None:
        _mark("stage", stage, seconds)
        self.inner.on_stage(pipeline, stage, seconds, degradations)


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value
