"""A client span for each copy of a request the dispatcher sends (first, hedge, retry), and the
``traceparent`` that names it in the copy's head, so that the worker's spans hang under it.

A hedged request shows as sibling spans under the caller's: ``tailserve.attempt`` says which
copy each was, ``tailserve.won`` which one answered, ``tailserve.outcome`` what became of the
others (lost to the winner, cancelled, failed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailserve.observability.tracing import Tracing

_DROPPED = (b"traceparent:", b"tracestate:")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """Where a request's attempts hang: the process's tracing, and the parent context."""

    tracing: Tracing
    context: Any


def start_attempt(
    parent: TraceParent, model: str, kind: str, replica: str, data: bytes
) -> tuple[Any, bytes]:
    """The attempt's span, and the request's bytes carrying its ``traceparent``."""
    tracing = parent.tracing
    span = tracing.start(
        f"attempt {kind}",
        parent=parent.context,
        kind="client",
        attributes={
            "tailserve.model": model,
            "tailserve.attempt": kind,
            "tailserve.hedge": kind == "hedge",
            "tailserve.replica": replica,
        },
    )
    return span, with_headers(data, tracing.headers(span))


def end_attempt(span: Any, outcome: str, status: int | None = None) -> None:
    span.set_attribute("tailserve.outcome", outcome)
    span.set_attribute("tailserve.won", outcome == "won")
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    span.end()


def with_headers(data: bytes, headers: dict[str, str]) -> bytes:
    """A framed HTTP/1.1 request with ``headers`` in place of any trace headers it had."""
    if not headers:
        return data
    head, sep, body = data.partition(b"\r\n\r\n")
    first, _, rest = head.partition(b"\r\n")
    lines = [line for line in rest.split(b"\r\n") if not line.lower().startswith(_DROPPED)]
    added = [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
    return b"\r\n".join([first, *added, *(line for line in lines if line)]) + sep + body
