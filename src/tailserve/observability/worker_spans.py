"""A worker request's spans, made once it is answered, from the times it took at each stage.

Nothing is traced while the request is on its way but a few clock readings (`tracing.Marks`):
the spans are started and ended here with those times, so a request that is not sampled costs
one sampling decision and no span. The tree::

    frontdoor            (from the front door's x-frontdoor-received-us to the worker's receipt)
    request              (server span: the incoming traceparent's child)
    ├── decode
    ├── cache.l1         (each tier looked up, with its result: hit, miss, stale...)
    ├── cache.l2
    ├── cache.coalesced  (waited for an identical request in flight)
    ├── queue            (in the model's batch queue)
    ├── compute          (its batch in the runtime: tailserve.batch_size rows)
    ├── stage <name>     (a pipeline's steps)
    └── respond          (encode and hand to the server)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailserve.observability.tracing import Marks, Tracing

# The response parameters that become the request span's attributes.
_ATTRIBUTES = (
    "cache",
    "batch_size",
    "queue_us",
    "compute_us",
    "variant",
    "cost_class",
    "degraded",
    "model_version",
)
_HITS = frozenset(("l1", "l2", "stale", "precomputed", "coalesced"))


@dataclass(slots=True)
class Arrival:
    """How a request came: its trace context, the front door's receipt (µs since the epoch),
    when the worker began to read it (`time.monotonic`), what and over which protocol."""

    traceparent: str | bytes | None
    tracestate: str | bytes | None
    frontdoor_us: str | bytes | None
    received_at: float
    route: str
    model: str
    protocol: str


def record(
    tracing: Tracing,
    arrival: Arrival,
    status: int,
    marks: Marks | None,
    parameters: Mapping[str, Any] | None,
    refusal: str | None = None,
) -> str | None:
    """Emit the request's spans; its trace id when sampled (else None)."""
    offset = time.time_ns() - time.monotonic_ns()

    def wall(monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + offset

    received = wall(arrival.received_at)
    end = time.monotonic_ns() + offset
    parent = tracing.parent(arrival.traceparent, arrival.tracestate)
    frontdoor = frontdoor_ns(arrival.frontdoor_us, received)
    door = None
    if frontdoor is not None:
        waited = {"tailserve.frontdoor.wait_us": (received - frontdoor) // 1000}
        door = tracing.start("frontdoor", parent=parent, start_ns=frontdoor, attributes=waited)
        if not door.is_recording():
            return None
        door.end(end_time=received)
        if parent is None:  # the trace begins at the front door
            parent = tracing.context_of(door)
    attributes: dict[str, Any] = {
        "tailserve.model": arrival.model,
        "tailserve.protocol": arrival.protocol,
        "tailserve.route": arrival.route,
        "http.response.status_code": status,
    }
    for name in _ATTRIBUTES:
        value = parameters.get(name) if parameters else None
        if value is not None and value != "":
            attributes[f"tailserve.{name}"] = value
    if refusal is not None:
        attributes["tailserve.refusal_reason"] = refusal
    span = tracing.start(
        "request", parent=parent, start_ns=received, kind="server", attributes=attributes
    )
    if not span.is_recording():
        span.end(end_time=end)
        return None
    if marks is not None:
        _stages(tracing, span, marks, parameters or {}, wall, received, end)
    if status >= 500:
        tracing.error(span, f"answered {status}")
    trace_id = tracing.trace_id(span)  # (while it records: an ended span no longer does)
    span.end(end_time=end)
    return trace_id


def _stages(
    tracing: Tracing,
    span: Any,
    marks: Marks,
    parameters: Mapping[str, Any],
    wall: Any,
    received: int,
    end: int,
) -> None:
    decoded = wall(marks.decoded_at) if marks.decoded_at else received
    answered = wall(marks.answered_at) if marks.answered_at else end
    tracing.span("decode", span, received, decoded)
    pipeline = parameters.get("cost_class") == "pipeline"
    offset = wall(0.0)  # (what a `time.monotonic_ns` reading needs added for the epoch)
    cursor = decoded
    waiting: int | None = None
    for what, result, at_ns, seconds in marks.events:
        at = at_ns + offset
        if what == "stage":
            tracing.span(f"stage {result}", span, at - int(seconds * 1e9), at)
            continue
        if pipeline:  # (its steps' own models' lookups: the steps' spans cover them)
            continue
        if waiting is not None:
            tracing.span("cache.coalesced", span, waiting, at)
            waiting = None
        if what == "coalesced":
            waiting = cursor = at
            continue
        tracing.span(f"cache.{what}", span, cursor, at, {"tailserve.cache.result": result})
        cursor = at
    if waiting is not None:
        tracing.span("cache.coalesced", span, waiting, answered)
    compute_us = parameters.get("compute_us") or 0
    if compute_us and not pipeline and parameters.get("cache") not in _HITS:
        computed = answered - int(compute_us) * 1000
        queued = computed - int(parameters.get("queue_us") or 0) * 1000
        tracing.span("queue", span, max(queued, cursor), computed)
        batch = {"tailserve.batch_size": parameters.get("batch_size", 1)}
        tracing.span("compute", span, computed, answered, batch)
    tracing.span("respond", span, answered, end)


def frontdoor_ns(value: str | bytes | None, received: int) -> int | None:
    """The front door's receipt in ns since the epoch, if it is a number no later than the
    worker's own (a clock a little ahead is taken as no wait)."""
    if value is None:
        return None
    try:
        at = int(value) * 1000
    except ValueError:
        return None
    if at <= 0 or received - at > 60 * 10**9:
        return None
    return min(at, received)
