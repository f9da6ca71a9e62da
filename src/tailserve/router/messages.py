"""What goes into the dispatcher and what comes out: a request as a `Framer`, which gives its
bytes for the wire once the deadline left is known, and the `Outcome` that answers it (a
backend's reply, or the router's own JSON error when it shed the request or every attempt
failed)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

from tailserve.transport import http1
from tailserve.transport.http1 import Headers

# A request's bytes, given the seconds left of its deadline (None: it has none).
Framer = Callable[[float | None], bytes]


def request_framer(
    method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
) -> Framer:
    """The `Framer` of a request made from its parts (the client library's, the gRPC
    front's): the deadline left goes upstream as ``X-Deadline-Ms``."""
    given = list(headers)

    def frame(remaining_s: float | None) -> bytes:
        extra = given
        if remaining_s is not None:
            extra = [*given, ("x-deadline-ms", f"{max(remaining_s * 1e3, 0.001):.3f}")]
        return http1.frame_request(method, path, "tailserve", body, extra)

    return frame


@dataclass(slots=True)
class Outcome:
    """What a request came to: a reply (the backend's, or the router's own when it shed the
    request or every attempt failed), which replica gave it, and how."""

    status: int
    headers: Headers
    body: bytes
    backend: str | None = None
    hedged: bool = False
    attempts: int = 0
    reason: str | None = None  # why the router answered itself (shed, upstream failure)


def json_headers() -> Headers:
    return [(b"content-type", b"application/json")]


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def error_message(body: bytes) -> str:
    """The message of an error reply (its ``error``; else the body's start, as text)."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    return str(error) if error else body.decode(errors="replace")[:200]
