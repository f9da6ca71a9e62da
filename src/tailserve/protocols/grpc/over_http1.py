"""gRPC's unary calls over HTTP/1.1, as the front door forwards them to a worker's HTTP port.

HAProxy speaks HTTP/2 to gRPC clients and HTTP/1.1 to the worker. A call arrives as a POST of
``/inference.GRPCInferenceService/<Method>`` (``content-type: application/grpc``), its one
message framed as gRPC frames it: a flag byte (0: not compressed), a 4-byte length, the
protobuf. The answer goes back chunked, the message framed the same way, then
``grpc-status`` as a trailer, which HAProxy turns into HTTP/2's trailers. An error is answered
"trailers-only": its status in the headers and no body, as a gRPC server answers a call that
fails before its message (the front door's ejection reads it there).

The handlers are those of grpcio's server (`common.unary_methods`), into the same data plane,
given what grpcio's context gave them: the metadata (the request's headers), the deadline
(``grpc-timeout``) and trailing metadata. A unary call so costs the worker what an HTTP request
with a binary body does: its HTTP server, protobuf's C parser, no grpcio call object, thread
hop or poller. The worker's own gRPC port (grpcio) still serves the clients that connect to it
directly, and streams (``ModelStreamInfer``: HTTP/1.1 does not carry a stream both ways).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc

from tailserve.protocols.grpc.common import Handler, Parse, Servicer, serialize, unary_methods
from tailserve.transport.request import HttpRequest

SERVICE = "/inference.GRPCInferenceService/"
_GRPC = (b"content-type", b"application/grpc")
# grpc-timeout's units, in seconds.
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}

Headers = list[tuple[bytes, bytes]]


class GrpcOverHttp1:
    """Answers a unary gRPC call that came as an HTTP/1.1 request."""

    prefix = SERVICE

    def __init__(self, servicer: Servicer) -> None:
        self._methods: dict[str, tuple[Handler, Parse]] = unary_methods(servicer)

    async def answer(
        self, request: HttpRequest
    ) -> tuple[int, Headers, bytes] | tuple[int, Headers, bytes, Headers]:
        content_type = request.header(b"content-type") or b""
        if not content_type.startswith(b"application/grpc"):
            message = b'{"error": "a gRPC call needs content-type application/grpc"}'
            return 415, [(b"content-type", b"application/json")], message
        method = self._methods.get(request.path[len(SERVICE) :])
        if method is None:
            return _status(grpc.StatusCode.UNIMPLEMENTED, f"no such method: {request.path}")
        body = request.raw_body
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            return _status(grpc.StatusCode.INTERNAL, "the request body is not one gRPC message")
        if body[0]:
            return _status(
                grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not accepted here"
            )
        try:
            call = _Call(request)
        except ValueError as exc:
            return _status(grpc.StatusCode.INTERNAL, str(exc))
        handler, parse = method
        try:
            reply = await handler(parse(body[5:]), call)
        except grpc.aio.AbortError:
            return _status(call.code, call.details, call.trailing_metadata())
        message = serialize(reply)
        framed = b"\0" + len(message).to_bytes(4, "big") + message
        return 200, [_GRPC], framed, [(b"grpc-status", b"0"), *_metadata(call.trailing_metadata())]


class _Call:
    """What the handlers use of grpcio's ``ServicerContext``, for a call over HTTP/1.1."""

    __slots__ = ("_deadline", "_metadata", "_trailing", "code", "details")

    def __init__(self, request: HttpRequest) -> None:
        self._metadata = tuple(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers
        )
        timeout = request.header(b"grpc-timeout")
        self._deadline = None
        if timeout is not None:
            self._deadline = request.received_at + _timeout_s(timeout.decode("latin-1"))
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self.code = grpc.StatusCode.UNKNOWN
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

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


def _timeout_s(value: str) -> float:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds."""
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _UNITS:
        raise ValueError(f"grpc-timeout {value!r} is not a gRPC timeout")
    return int(digits) * _UNITS[unit]


def _status(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, Any]] = ()
) -> tuple[int, Headers, bytes]:
    """A "trailers-only" answer: the call's status in its headers, no message."""
    number = code.value[0]
    headers = [_GRPC, (b"grpc-status", str(number).encode())]
    if details:
        headers.append((b"grpc-message", _percent(details)))
    return 200, [*headers, *_metadata(trailing)], b""


def _metadata(pairs: Sequence[tuple[str, Any]]) -> Headers:
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
