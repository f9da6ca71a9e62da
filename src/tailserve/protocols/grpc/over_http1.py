"""gRPC's unary calls over HTTP/1.1, as the front door forwards them to a worker's HTTP port.

HAProxy speaks HTTP/2 to gRPC clients and HTTP/1.1 to the worker. A call arrives as a POST of
``/inference.GRPCInferenceService/<Method>`` (``content-type: application/grpc``), its one
message framed as gRPC frames it; the answer goes back chunked, then ``grpc-status`` as a
trailer, which HAProxy turns into HTTP/2's trailers (`calls`: the call answered from its
bytes). A unary call so costs the worker what an HTTP request with a binary body does. Streams
(``ModelStreamInfer``: HTTP/1.1 does not carry a stream both ways) go to the worker's gRPC port
(`over_http2`).
"""

from __future__ import annotations

from tailserve.protocols.grpc.calls import SERVICE, UnaryCalls
from tailserve.protocols.grpc.common import Servicer
from tailserve.transport.request import HttpRequest

Headers = list[tuple[bytes, bytes]]


class GrpcOverHttp1:
    """Answers a unary gRPC call that came as an HTTP/1.1 request."""

    prefix = SERVICE

    def __init__(self, servicer: Servicer) -> None:
        self._calls = UnaryCalls(servicer)

    async def answer(
        self, request: HttpRequest
    ) -> tuple[int, Headers, bytes] | tuple[int, Headers, bytes, Headers]:
        status, headers, body, trailers = await self._calls.answer(
            request.path, request.headers, request.raw_body, request.received_at
        )
        if trailers is None:
            return status, headers, body
        return status, headers, body, trailers
