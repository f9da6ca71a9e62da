"""Why a request was refused, in one word: ``x-refusal-reason`` over HTTP, ``reason`` in the
error body, and the ``x-refusal-reason`` trailing metadata over gRPC (docs/observability.md)."""

from __future__ import annotations

from tailserve.errors import (
    DeadlineExceeded,
    DeadlineUnmeetable,
    ModelNotReady,
    Overloaded,
    TailserveError,
    Unavailable,
)

HEADER = "x-refusal-reason"

# Most specific first. (A job queue's QueueFull is an Overloaded.)
_REASONS: tuple[tuple[type[TailserveError], str], ...] = (
    (Overloaded, "queue_full"),
    (DeadlineUnmeetable, "deadline_unmeetable"),
    (DeadlineExceeded, "deadline_exceeded"),
    (ModelNotReady, "not_ready"),
    (Unavailable, "unavailable"),
)
_BY_CLASS: dict[type[TailserveError], str | None] = {}


def refusal_reason(exc: TailserveError) -> str | None:
    """A refusal's reason (429, 503, 504); None for an error that is no refusal."""
    kind = type(exc)
    if kind not in _BY_CLASS:
        _BY_CLASS[kind] = next((why for base, why in _REASONS if isinstance(exc, base)), None)
    return _BY_CLASS[kind]
