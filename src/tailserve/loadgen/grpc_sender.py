"""The gRPC senders: OIP ``ModelInfer`` unary calls, or ``ModelStreamInfer`` streams.

Both send prepared ``ModelInferRequest`` bytes (inputs in ``raw_input_contents``, as the binary
HTTP extension carries them) through grpcio's asyncio API, and time each request out themselves
(``timeout_s`` from its send): the server sees no gRPC deadline unless the workload names one
(``options.deadline_ms``, as X-Deadline-Ms over HTTP).

- Unary: a call a request, over ``connections`` channels (HTTP/2 connections) in turn.
- Streams: ``streams`` bidirectional streams (over the channels in turn), requests dealt to
  them in turn, many in flight on each. A stream writes its requests in order, each with its
  index as its ``id``; answers come back as they finish and are matched by that id. An answer
  with an ``error_message`` is its request's error (``STREAM_ERROR``); the stream goes on. A
  stream that fails ends every request it holds with the stream's status, and is opened again
  for the next request dealt to it. An error answer that names no request (the server could
  not read it) is left to that request's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from tailserve.loadgen.sending import (
    CACHE_CODES,
    GRPC_BASE,
    LOST,
    OK,
    STREAM_ERROR,
    TIMEOUT,
    Completion,
    Link,
    Served,
)
from tailserve.protocols.grpc import schema

_UNARY = f"/{schema.SERVICE}/ModelInfer"
_STREAM = f"/{schema.SERVICE}/ModelStreamInfer"
_ID_TAG = b"\x1a"  # ModelInferRequest.id: field 3, length-delimited
_MAX_INT32 = 2**31 - 1


def status_of(code: grpc.StatusCode) -> int:
    """A gRPC status as an outcome code (`loadgen.sending`)."""
    number: int = code.value[0]
    return OK if number == 0 else GRPC_BASE + number


def served_of(response: Any) -> Served | None:
    """What a ``ModelInferResponse``'s parameters say of how it was served (None: nothing)."""
    parameters = response.parameters
    if not parameters:
        return None

    def number(key: str) -> int:
        if key not in parameters:
            return -1
        value = parameters[key]
        return min(value.int64_param, _MAX_INT32) if value.HasField("int64_param") else -1

    cache = parameters["cache"].string_param if "cache" in parameters else ""
    return Served(number("queue_us"), number("compute_us"), number("batch_size"), _cache(cache))


def _cache(tier: str) -> int:
    return CACHE_CODES.get(tier, 0)


def with_id(data: bytes, index: int) -> bytes:
    """A serialized request with ``id`` set to the index: a field appended to a message's bytes
    sets it (the request's bytes carry no id of their own)."""
    text = str(index).encode()
    return b"".join((data, _ID_TAG, bytes((len(text),)), text))


def _channels(link: Link) -> list[grpc.aio.Channel]:
    options = [
        # Each channel its own HTTP/2 connection (grpcio shares one between equal channels).
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
    ]
    address = f"{link.host}:{link.port}"
    return [
        grpc.aio.insecure_channel(address, options=options) for _ in range(max(1, link.connections))
    ]


class _Outstanding:
    """Requests out, each with its timeout: the answer or the timeout, whichever comes first,
    reports the request (once)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        link: Link,
        done: Completion,
        on_expire: Callable[[int], None] | None = None,
    ) -> None:
        self._loop = loop
        self._timeout_s = link.timeout_s
        self._done = done
        self._on_expire = on_expire
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def add(self, index: int) -> None:
        self._timers[index] = self._loop.call_later(self._timeout_s, self._expire, index)

    def finish(self, index: int, status: int, served: Served | None) -> None:
        timer = self._timers.pop(index, None)
        if timer is not None:
            timer.cancel()
            self._done(index, status, served)

    def _expire(self, index: int) -> None:
        if self._timers.pop(index, None) is not None:
            self._done(index, TIMEOUT, None)
            if self._on_expire is not None:
                self._on_expire(index)

    def clear(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


class UnarySender:
    def __init__(self, link: Link, loop: asyncio.AbstractEventLoop, done: Completion) -> None:
        self._loop = loop
        self._channels = _channels(link)
        # No serializers: the requests are bytes already, and the replies are read here.
        self._methods = [channel.unary_unary(_UNARY) for channel in self._channels]
        self._next = 0
        self._metadata = link.metadata or None
        self._deadline_s = link.deadline_s
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._out = _Outstanding(loop, link, done, on_expire=self._cancel)

    def send(self, index: int, data: bytes) -> None:
        method = self._methods[self._next]
        self._next = (self._next + 1) % len(self._methods)
        self._out.add(index)
        self._tasks[index] = self._loop.create_task(self._call(index, method, data))

    async def _call(self, index: int, method: Any, data: bytes) -> None:
        try:
            reply = await method(data, timeout=self._deadline_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            self._out.finish(index, status_of(exc.code()), None)
        else:
            self._out.finish(index, OK, served_of(schema.ModelInferResponse.FromString(reply)))
        finally:
            self._tasks.pop(index, None)

    def _cancel(self, index: int) -> None:
        task = self._tasks.pop(index, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        self._out.clear()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel in self._channels))


class StreamSender:
    def __init__(self, link: Link, loop: asyncio.AbstractEventLoop, done: Completion) -> None:
        self._channels = _channels(link)
        self._out = _Outstanding(loop, link, done)
        methods = [channel.stream_stream(_STREAM) for channel in self._channels]
        self._streams = [
            _Stream(methods[k % len(methods)], self._out, link.metadata, loop)
            for k in range(max(1, link.streams))
        ]
        self._next = 0

    def send(self, index: int, data: bytes) -> None:
        stream = self._streams[self._next]
        self._next = (self._next + 1) % len(self._streams)
        self._out.add(index)
        stream.send(index, with_id(data, index))

    async def close(self) -> None:
        self._out.clear()
        await asyncio.gather(*(stream.close() for stream in self._streams))
        await asyncio.gather(*(channel.close() for channel in self._channels))


class _Stream:
    """One bidirectional stream: a writer task sends the requests dealt to it in order, a
    reader task matches the answers to them."""

    def __init__(
        self,
        method: Any,
        out: _Outstanding,
        metadata: tuple[tuple[str, str], ...],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._method = method
        self._out = out
        self._metadata = metadata or None
        self._loop = loop
        self._pending: deque[bytes] = deque()
        self._wake = asyncio.Event()
        # Requests written or waiting to be, not yet answered (some may have timed out).
        self._held: set[int] = set()
        self._call: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    def send(self, index: int, data: bytes) -> None:
        self._held.add(index)
        self._pending.append(data)
        if self._call is None:
            self._call = self._method(metadata=self._metadata)
            self._tasks = [
                self._loop.create_task(self._write(self._call)),
                self._loop.create_task(self._read(self._call)),
            ]
        self._wake.set()

    async def _write(self, call: Any) -> None:
        pending = self._pending
        try:
            while True:
                if not pending:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                # Written one at a time: HTTP/2's flow control (the server stops reading when
                # it holds too many) holds the rest here, their latency counting.
                await call.write(pending.popleft())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            call.cancel()  # (the reader reports the stream's end)

    async def _read(self, call: Any) -> None:
        status = LOST  # the server ended the stream with requests unanswered
        try:
            while (raw := await call.read()) is not grpc.aio.EOF:
                self._answer(raw)
        except grpc.aio.AioRpcError as exc:
            status = status_of(exc.code())
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # closed
        self._ended(call, status)

    def _answer(self, raw: bytes) -> None:
        answer = schema.ModelStreamInferResponse.FromString(raw)
        response = answer.infer_response
        try:
            index = int(response.id)
        except ValueError:
            return
        self._held.discard(index)
        if answer.error_message:
            self._out.finish(index, STREAM_ERROR, None)
        else:
            self._out.finish(index, OK, served_of(response))

    def _ended(self, call: Any, status: int) -> None:
        """The stream failed: every request it holds ends with its status."""
        if self._call is call:
            self._call = None
            self._tasks[0].cancel()
            self._tasks = []
        held, self._held = self._held, set()
        self._pending.clear()
        for index in held:
            self._out.finish(index, status, None)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        if self._call is not None:
            self._call.cancel()
            self._call = None
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
