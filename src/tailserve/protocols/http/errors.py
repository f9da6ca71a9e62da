"""Errors to HTTP status codes: the only place the two meet."""

from __future__ import annotations

import math

from tailserve.errors import (
    Conflict,
    DeadlineExceeded,
    DeadlineUnmeetable,
    Forbidden,
    InvalidInput,
    JobNotFound,
    ModelExecutionError,
    ModelNotFound,
    PayloadTooLarge,
    QueueFull,
    TailserveError,
    Unauthorized,
    Unavailable,
)

_STATUS: tuple[tuple[type[TailserveError], int], ...] = (
    (PayloadTooLarge, 413),
    (InvalidInput, 400),
    (Unauthorized, 401),
    (Forbidden, 403),
    (ModelNotFound, 404),
    (JobNotFound, 404),
    (Conflict, 409),
    # 429: refused now, try later or elsewhere (a router sends it to another replica).
    (DeadlineUnmeetable, 429),
    (QueueFull, 429),
    (DeadlineExceeded, 504),
    (Unavailable, 503),
    (ModelExecutionError, 500),
)


# Each error class's status, once looked up (a refusal under overload is one of thousands).
_BY_CLASS: dict[type[TailserveError], int] = {}


def status_of(exc: TailserveError) -> int:
    status = _BY_CLASS.get(type(exc))
    if status is None:
        status = next((code for kind, code in _STATUS if isinstance(exc, kind)), 500)
        _BY_CLASS[type(exc)] = status
    return status


def headers_of(exc: TailserveError) -> list[tuple[bytes, bytes]]:
    if isinstance(exc, Unavailable) and exc.retry_after_s is not None:
        return [(b"retry-after", str(max(1, math.ceil(exc.retry_after_s))).encode())]
    if isinstance(exc, Unauthorized):
        return [(b"www-authenticate", b"Bearer")]
    return []
