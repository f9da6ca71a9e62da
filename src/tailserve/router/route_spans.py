"""The routing lane's span of a request (``route``, a server span: the incoming
``traceparent``'s child), the front door's span before it, and where its attempts hang
(`attempt_spans.py`): the tree the lane adds, with tracing on::

    frontdoor            (from the front door's x-frontdoor-received-us to the lane's receipt)
    route                (server span: received to answered)
    ├── attempt first    (client spans: each copy sent to a worker)
    │   └── request      (the worker's: worker_spans.py)
    └── attempt hedge
"""

from __future__ import annotations

import time
from typing import Any

from tailserve.observability.tracing import Tracing
from tailserve.observability.worker_spans import frontdoor_ns
from tailserve.protocols.refusals import HEADER as REFUSAL_HEADER
from tailserve.router.attempt_spans import TraceParent
from tailserve.router.messages import Outcome
from tailserve.transport.request import HttpRequest

# The front door's stamp: the lane makes its span, so the worker is not sent it (it would make
# a second one, under the attempt).
FRONTDOOR_HEADER = b"x-frontdoor-received-us"
_REFUSAL = REFUSAL_HEADER.encode()


def start_route(tracing: Tracing, request: HttpRequest, model: str) -> tuple[Any, TraceParent]:
    """The request's ``route`` span (started at its receipt), and where its attempts hang."""
    received = int(request.received_at * 1e9) + time.time_ns() - time.monotonic_ns()
    parent = tracing.parent(request.header(b"traceparent"), request.header(b"tracestate"))
    door_at = frontdoor_ns(request.header(FRONTDOOR_HEADER), received)
    if door_at is not None:
        waited = {"tailserve.frontdoor.wait_us": (received - door_at) // 1000}
        door = tracing.start("frontdoor", parent=parent, start_ns=door_at, attributes=waited)
        door.end(end_time=received)
        if parent is None and door.is_recording():  # the trace begins at the front door
            parent = tracing.context_of(door)
    attributes = {
        "tailserve.model": model,
        "http.request.method": request.method,
        "url.path": request.path,
    }
    span = tracing.start(
        "route", parent=parent, start_ns=received, kind="server", attributes=attributes
    )
    return span, TraceParent(tracing, tracing.context_of(span))


def end_route(tracing: Tracing, span: Any, status: int, outcome: Outcome | None) -> None:
    """End the ``route`` span with how the request went: its status, the replica that answered,
    whether a hedge won, the attempts it took and a refusal's reason."""
    span.set_attribute("http.response.status_code", status)
    if outcome is not None:
        if outcome.backend is not None:
            span.set_attribute("tailserve.replica", outcome.backend)
        span.set_attribute("tailserve.hedged", outcome.hedged)
        span.set_attribute("tailserve.attempts", outcome.attempts)
        reason = next((v for k, v in outcome.headers if k.lower() == _REFUSAL), None)
        if reason is not None:
            span.set_attribute("tailserve.refusal_reason", reason.decode("latin-1"))
    if status >= 500:
        tracing.error(span, f"answered {status}")
    span.end()
