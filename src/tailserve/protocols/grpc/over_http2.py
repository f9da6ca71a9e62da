"""The worker's gRPC port: the Open Inference Protocol's service over the worker's own HTTP/2
server (`transport.http2`), not grpcio's.

A unary call is handed over once its message is whole and answered as `calls.UnaryCalls`
answers one, by the same handlers grpcio would run. ``ModelStreamInfer`` is handed over as it
opens: its messages are read as they come and answered as each is done, by the service's own
stream handler; what it has not read is not acknowledged, so a client sending faster than it
is answered is held back by HTTP/2's flow control. A message over the size limit ends the call
with RESOURCE_EXHAUSTED, as grpcio's server does, and so does a unary call whose message would
take the connection's unanswered messages past the server's hold (`Http2Server.max_held_bytes`);
a compressed one ends with UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.calls import (
    COMPRESSED,
    GRPC_CONTENT,
    SERVICE,
    CallContext,
    UnaryCalls,
    framed,
    not_grpc,
    ok,
    status,
    status_headers,
)
from tailserve.protocols.grpc.common import Servicer, parser, serialize
from tailserve.transport.http2 import Http2Stream, StreamGone

log = logging.getLogger(__name__)

STREAM = SERVICE + "ModelStreamInfer"
_CROWDED = (
    "this connection's calls not yet answered hold more than %d bytes: wait for their "
    "answers, or spread the calls over more connections"
)
Streamer = Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]


class CallEnded(Exception):
    """The call ends with this status, its messages read so far answered."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class GrpcOverHttp2:
    """The `transport.http2.Http2Application` of the service's calls."""

    def __init__(self, servicer: Servicer, *, max_message_bytes: int) -> None:
        self._calls = UnaryCalls(servicer)
        self._stream: Streamer | None = getattr(servicer, "model_stream_infer", None)
        self._parse = parser(schema.ModelInferRequest)
        self.max_message_bytes = max_message_bytes

    def converses(self, stream: Http2Stream) -> bool:
        return self._stream is not None and stream.path == STREAM

    async def answer(self, stream: Http2Stream) -> None:
        if stream.too_large:
            reply = status(grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_large(stream.size))
        elif stream.crowded:
            reply = status(grpc.StatusCode.RESOURCE_EXHAUSTED, _CROWDED % stream.held_limit)
        else:
            reply = await self._calls.answer(
                stream.path, stream.headers, stream.body, stream.received_at
            )
        with contextlib.suppress(StreamGone):
            await stream.send(*reply)

    async def converse(self, stream: Http2Stream) -> None:
        assert self._stream is not None
        refused = not_grpc(stream.headers)
        try:
            if refused is not None:
                await stream.send(*refused)
                return
            try:
                call = CallContext(stream.headers, stream.received_at)
            except ValueError as exc:
                await stream.send(*status(grpc.StatusCode.INTERNAL, str(exc)))
                return
            await self._converse(stream, call, self._stream)
        except StreamGone:
            pass

    async def _converse(self, stream: Http2Stream, call: CallContext, handler: Streamer) -> None:
        began = False
        ended: list[CallEnded] = []
        messages = self._messages(stream, ended, asyncio.current_task())
        try:
            async for message in handler(messages, call):
                if not began:
                    stream.send_headers(200, [GRPC_CONTENT])
                    began = True
                await stream.send_data(framed(serialize(message)))
        except asyncio.CancelledError:
            if not ended:
                raise
            # (the reading ended the call: what it was told, with the answers so far)
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            end = status_headers(ended[0].code, ended[0].details)
        except StreamGone:
            raise
        except Exception as exc:
            log.exception("unexpected error in a gRPC stream")
            end = status_headers(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        else:
            end = ok(call)
        if began:
            stream.send_trailers(end)
        else:
            stream.send_headers(200, [GRPC_CONTENT, *end], end=True)

    async def _messages(
        self, stream: Http2Stream, ended: list[CallEnded], call: asyncio.Task[Any] | None
    ) -> AsyncIterator[Any]:
        """The stream's messages as they come, parsed (one that is no message: the parser's
        `_Malformed`, which the handler answers as that request's error). Bytes that end the
        call (a message too large, compressed or cut short) put why in ``ended`` and cancel
        the call's task, which answers it."""
        try:
            async for message in self._read(stream):
                yield message
        except CallEnded as exc:
            ended.append(exc)
            if call is not None:
                call.cancel()
            await asyncio.Event().wait()  # (until the cancellation reaches this reader)

    async def _read(self, stream: Http2Stream) -> AsyncIterator[Any]:
        pending = b""
        while True:
            data = await stream.read()
            if data is None:
                if pending:
                    raise CallEnded(grpc.StatusCode.INTERNAL, "the stream ended inside a message")
                return
            pending += data
            while len(pending) >= 5:
                length = int.from_bytes(pending[1:5], "big")
                if length > self.max_message_bytes:
                    raise CallEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_large(length))
                if len(pending) < 5 + length:
                    break
                if pending[0]:
                    raise CallEnded(grpc.StatusCode.UNIMPLEMENTED, COMPRESSED)
                message, pending = pending[5 : 5 + length], pending[5 + length :]
                yield self._parse(message)

    def _too_large(self, size: int) -> str:
        return f"the message ({size} bytes) is larger than the limit ({self.max_message_bytes})"
