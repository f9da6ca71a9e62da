"""The one error tree of tailserve.

    TailserveError
    ├── InvalidInput          bad request data: JSON, shapes, datatypes, values (a field is named)
    │   └── PayloadTooLarge   the body is over the configured limit
    ├── Unauthorized          an admin route without the configured bearer token
    ├── Forbidden             an admin route that no token opens (beyond loopback, none set)
    ├── ModelNotFound         no such model, or no such version of it
    ├── JobNotFound           no such job (never submitted, or its result has expired)
    ├── Conflict              the request contradicts the state it acts on (cancel a finished job)
    ├── Unavailable           the model or server cannot take the request now
    │   ├── ModelNotReady     known, but not loaded or not warm yet
    │   ├── Overloaded        a bounded queue is full; carries a retry-after hint
    │   │   └── QueueFull     a model's job queue is at its bound (429, not 503: try later)
    │   ├── DeadlineUnmeetable  refused at admission: its deadline cannot be met
    │   └── DeadlineExceeded  its deadline passed (or came too close) while it was queued
    ├── ModelExecutionError   the runtime raised while predicting
    ├── UpstreamError         a server this process calls (bench, router) did not answer
    │   ├── ConnectFailed     no connection could be opened
    │   ├── ConnectionLost    the connection closed or broke before the response was complete
    │   └── UpstreamTimeout   no complete response within the request's time limit
    └── ConfigError           a model.yaml or setting is invalid (names the file and field)
        └── ModelLoadError    a model's artifact could not be loaded or warmed
            └── ModelNotServed  the model needs what this worker was not given (Redis)

No web framework appears here: adapters map these to status codes (see `protocols/http/errors.py`).
"""

from __future__ import annotations


class TailserveError(Exception):
    """Base of every error tailserve raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(TailserveError):
    pass


class PayloadTooLarge(InvalidInput):
    pass


class Unauthorized(TailserveError):
    pass


class Forbidden(TailserveError):
    pass


class ModelNotFound(TailserveError):
    pass


class JobNotFound(TailserveError):
    pass


class Conflict(TailserveError):
    pass


class Unavailable(TailserveError):
    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotReady(Unavailable):
    pass


class Overloaded(Unavailable):
    pass


class QueueFull(Overloaded):
    pass


class DeadlineUnmeetable(Unavailable):
    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        deadline: float = 0.0,
        least_budget_s: float = 0.0,
        reusable_until: float = 0.0,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        # A refusal before the request was read, under overload: until ``reusable_until``
        # (monotonic clock), a request of the same kind with under ``least_budget_s`` left
        # may be refused the same way. ``deadline``: the refused request's.
        self.deadline = deadline
        self.least_budget_s = least_budget_s
        self.reusable_until = reusable_until


class DeadlineExceeded(Unavailable):
    pass


class ModelExecutionError(TailserveError):
    pass


class UpstreamError(TailserveError):
    pass


class ConnectFailed(UpstreamError):
    pass


class ConnectionLost(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class ConfigError(TailserveError):
    pass


class ModelLoadError(ConfigError):
    pass


class ModelNotServed(ModelLoadError):
    """Not a fault of the model: the worker was started without a service it needs (a
    feature store with no --redis-url). Reported, but no failure for readiness."""


def field_message(message: str) -> str:
    """Say a decoder's "Expected `int`, got `str` - at `$.inputs[0].shape`" as
    "field 'inputs[0].shape': Expected `int`, got `str`" (the form every config error takes)."""
    text, sep, where = message.partition(" - at `")
    path = where.rstrip("`").removeprefix("$").removeprefix(".")
    return f"field '{path}': {text}" if sep and path else text


def shown(value: object, limit: int = 64) -> str:
    """A value a client sent, quoted for an error message: bytes decoded (what is not UTF-8
    shown as U+FFFD), control characters escaped, and cut to ``limit`` characters, so a reply
    never echoes raw bytes nor a whole megabyte of them."""
    if isinstance(value, bytes | bytearray | memoryview):
        value = bytes(value).decode("utf-8", errors="replace")
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    text = text[:limit]
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"'{text}'" + (f" (cut to {limit} characters)" if cut else "")
