"""A gRPC call answered from its bytes, by the worker's own HTTP servers rather than grpcio's:
the unary calls the front door forwards over HTTP/1.1 (`over_http1`) and every call on the
worker's gRPC port over HTTP/2 (`over_http2`).

The handlers are those grpcio's server would run (`common.unary_methods`), given what its
context gave them (`CallContext`): the metadata (the request's headers), the deadline
(``grpc-timeout``) and trailing metadata. A message on the wire is gRPC's frame: a flag byte
(0: not compressed), a 4-byte length, the protobuf. An answer is ``(status, headers, body,
trailers)``: the message framed, then ``grpc-status`` in the trailers; an error is answered
"trailers-only" (its status in the headers, no body and no trailers), as a gRPC server answers
a call that fails before its message, and where the front door's ejection reads it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc

from tailserve.protocols.grpc.common import Handler, Parse, Servicer, serialize, unary_methods

SERVICE = "/inference.GRPCInferenceService/"
GRPC_CONTENT = (b"content-type", b"application/grpc")
COMPRESSED = "compressed messages are not accepted here"
# grpc-timeout's units, in seconds.
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}

Headers = list[tuple[bytes, bytes]]
# (status, headers, body, trailers): trailers None for a trailers-only answer.
Answer = tuple[int, Headers, bytes, Headers | None]


class UnaryCalls:
    """Answers a unary call from its path, headers and body."""

    def __init__(self, servicer: Servicer) -> None:
        self._methods: dict[str, tuple[Handler, Parse]] = unary_methods(servicer)

    async def answer(self, path: str, headers: Headers, body: bytes, received_at: float) -> Answer:
        refused = not_grpc(headers)
        if refused is not None:
            return refused
        method = self._methods.get(path[len(SERVICE) :]) if path.startswith(SERVICE) else None
        if method is None:
            return status(grpc.StatusCode.UNIMPLEMENTED, f"no such method: {path}")
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            return status(grpc.StatusCode.INTERNAL, "the request body is not one gRPC message")
        if body[0]:
            return status(grpc.StatusCode.UNIMPLEMENTED, COMPRESSED)
        try:
            call = CallContext(headers, received_at)
        except ValueError as exc:
            return status(grpc.StatusCode.INTERNAL, str(exc))
        handler, parse = method
        try:
            reply = await handler(parse(body[5:]), call)
        except grpc.aio.AbortError:
            return status(call.code, call.details, call.trailing_metadata())
        return 200, [GRPC_CONTENT], framed(serialize(reply)), ok(call)


class CallContext:
    """What the handlers use of grpcio's ``ServicerContext``, for a call this package reads."""

    __slots__ = ("_deadline", "_headers", "_trailing", "code", "details")

    def __init__(self, headers: Headers, received_at: float) -> None:
        self._headers = headers
        self._deadline = None
        for name, value in headers:
            if name == b"grpc-timeout":
                self._deadline = received_at + timeout_s(value.decode("latin-1"))
                break
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self.code = grpc.StatusCode.UNKNOWN
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in self._headers
        )

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def done(self) -> bool:
        return False


def not_grpc(headers: Headers) -> Answer | None:
    """The answer to a request that is no gRPC call (its content type says so); None: it is
    one."""
    for name, value in headers:
        if name == b"content-type":
            if value.startswith(b"application/grpc"):
                return None
            break
    message = b'{"error": "a gRPC call needs content-type application/grpc"}'
    return 415, [(b"content-type", b"application/json")], message, None


def framed(message: bytes) -> bytes:
    return b"\0" + len(message).to_bytes(4, "big") + message


def ok(call: CallContext) -> Headers:
    """A successful call's trailers."""
    return [(b"grpc-status", b"0"), *metadata(call.trailing_metadata())]


def timeout_s(value: str) -> float:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds."""
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _UNITS:
        raise ValueError(f"grpc-timeout {value!r} is not a gRPC timeout")
    return int(digits) * _UNITS[unit]


def status(code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, Any]] = ()) -> Answer:
    """A "trailers-only" answer: the call's status in its headers, no message."""
    return 200, [GRPC_CONTENT, *status_headers(code, details, trailing)], b"", None


def status_headers(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, Any]] = ()
) -> Headers:
    """A call's end: its status, its message (if any) and trailing metadata."""
    number = code.value[0]
    headers = [(b"grpc-status", str(number).encode())]
    if details:
        headers.append((b"grpc-message", _percent(details)))
    return [*headers, *metadata(trailing)]


def metadata(pairs: Sequence[tuple[str, Any]]) -> Headers:
    return [
        (key.encode("latin-1"), value if isinstance(value, bytes) else str(value).encode())
        for key, value in pairs
    ]


def _percent(text: str) -> bytes:
    """``grpc-message``'s encoding: printable ASCII but ``%`` as it is, the rest %XX."""
    return b"".join(
        bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
        for byte in text.encode("utf-8")
    )
