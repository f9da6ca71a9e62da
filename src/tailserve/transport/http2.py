"""An HTTP/2 server over plain TCP (h2c with prior knowledge, as gRPC's clients and HAProxy's
``proto h2`` speak it): the protocol's state machine (`http2_wire`) on a bare asyncio
protocol.

A stream is handed to the application in one of two ways, as it asks (`Http2Application`):
whole, once its request has ended (`answer`: a task with the body read, as for a unary gRPC
call), or at once, its body read as it comes (`converse`: a task that reads and sends while
the stream is open, as for a gRPC stream). Either way the task sends the answer through the
`Http2Stream`: headers, data (held to the peer's flow-control window), then trailers.

What a server owes its peers: flow control both ways (what a conversing task has not read is
not acknowledged, so a client that sends faster than it is answered is held back); a body over
``max_body_bytes`` is not kept (the application is told, and answers the error), nor are the
requests that would take a connection's unanswered bodies past ``max_held_bytes`` (so that a
peer's thousand open streams cannot hold a thousand bodies); a peer that resets a stream
cancels its task; one that breaks the protocol gets a GOAWAY and the
connection closes, the others served on. A drain sends each connection a GOAWAY that names
its last stream: the streams opened before it are answered, later ones are refused (the
client retries them elsewhere), and each connection closes once its streams are done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol, cast

from tailserve.transport.http2_wire import (
    CANCEL,
    INTERNAL_ERROR,
    REFUSED_STREAM,
    Http2Wire,
    WireError,
)
from tailserve.transport.waits import until_set

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]  # (as `http2_wire.Headers`)

# Streams a connection may have open at once (a client opens more once one ends).
MAX_CONCURRENT_STREAMS = 1024
# Each stream's receive window, and the connection's: how much a client may send before it
# hears back. The protocol's default (64 KiB) would hold a large request back a round trip a
# 64 KiB; these let a call of a few MiB in at once.
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024


class Http2Application(Protocol):
    def converses(self, stream: Http2Stream) -> bool:
        """Whether the stream is handed over as it opens (`converse`), not once its
        request has ended (`answer`)."""

    def answer(self, stream: Http2Stream) -> Coroutine[Any, Any, None]:
        """Answer a stream whose request has ended (its body in ``stream.body``)."""

    def converse(self, stream: Http2Stream) -> Coroutine[Any, Any, None]:
        """Read and answer a stream while it is open."""


class StreamGone(Exception):
    """The stream can no longer be answered: the peer reset it, or the connection closed."""


class Http2Stream:
    """One request and its answer on a connection."""

    __slots__ = (
        "_chunks",
        "_connection",
        "_unread",
        "_waiter",
        "active_at",
        "body",
        "crowded",
        "ended",
        "gone",
        "headers",
        "held",
        "id",
        "method",
        "path",
        "received_at",
        "size",
        "too_large",
    )

    def __init__(
        self, connection: _Connection, stream_id: int, headers: Headers, received_at: float
    ) -> None:
        self._connection = connection
        self.id = stream_id
        self.received_at = received_at
        self.active_at = received_at  # when the peer last sent some of it
        self.headers: Headers = []
        self.path = ""
        self.method = b""
        for name, value in headers:
            if name == b":path":
                self.path = value.decode("latin-1")
            elif name == b":method":
                self.method = value
            elif not name.startswith(b":"):
                self.headers.append((name, value))
        self.body = b""  # the whole request's, for `answer`
        self.ended = False  # the peer has sent all of its request
        self.gone = False  # reset, or its connection lost
        # (`answer`'s) its body passed the server's limit: what came was dropped
        self.too_large = False
        # (`answer`'s) its body would have taken the connection's unanswered bodies past the
        # server's `max_held_bytes`: what came was dropped
        self.crowded = False
        self.size = 0
        self.held = 0  # what of it the connection holds (counted against `max_held_bytes`)
        self._chunks: deque[bytes] = deque()
        self._unread = 0  # (`converse`'s) the flow-controlled bytes come and not yet read
        self._waiter: asyncio.Future[None] | None = None

    @property
    def held_limit(self) -> int:
        """The bytes of unanswered bodies its connection may hold (`crowded` past it)."""
        return self._connection._server.max_held_bytes

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # --- reading (for `converse`) ------------------------------------------------------------

    async def read(self) -> bytes | None:
        """What has come of the request's body since the last read (acknowledged to the peer:
        it may send as much again); None once the request has ended and all was read."""
        while not self._chunks:
            if self.ended or self.gone:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = b"".join(self._chunks)
        self._chunks.clear()
        flow, self._unread = self._unread, 0
        self._connection.acknowledge(self, flow)
        return data

    def _received(self, data: bytes, flow_length: int) -> None:
        self._chunks.append(data)
        self._unread += flow_length  # (padding included)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- writing -----------------------------------------------------------------------------

    def send_headers(self, status: int, headers: Headers, *, end: bool = False) -> None:
        self._connection.send_headers(self, [(b":status", b"%d" % status), *headers], end)

    async def send_data(self, data: bytes, *, end: bool = False) -> None:
        """Data, as fast as the peer's window and the socket let it go."""
        await self._connection.send_data(self, data, end)

    def send_trailers(self, trailers: Headers) -> None:
        self._connection.send_headers(self, trailers, True)

    async def send(
        self, status: int, headers: Headers, body: bytes, trailers: Headers | None
    ) -> None:
        """A whole answer: headers, the body if any, the trailers if any (the last part ends
        the stream)."""
        connection = self._connection
        head = [(b":status", b"%d" % status), *headers]
        if not body and not trailers:
            connection.send_headers(self, head, True)
            return
        # (one write for the whole answer where the peer's window holds its body)
        connection.send_headers(self, head, False, flush=False)
        if body and not connection.send_now(self, body, not trailers):
            await connection.send_data(self, body, not trailers)
        if trailers:
            connection.send_headers(self, trailers, True)
        else:
            connection.flush()


class Http2Server:
    def __init__(
        self,
        app: Http2Application,
        *,
        max_body_bytes: int,
        read_timeout_s: float = 30.0,
        max_held_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # The bodies of requests to be answered whole that a connection may hold at once (read
        # and not yet answered), by default four of the largest: a request past it is not kept
        # (`Http2Stream.crowded`), and the application answers it an error.
        self.max_held_bytes = max_held_bytes or 4 * max_body_bytes
        # A request handed over whole whose body stops coming for this long is reset (CANCEL)
        # and dropped: a peer cannot hold memory by never finishing one.
        self.read_timeout_s = read_timeout_s
        self._sweeper: asyncio.TimerHandle | None = None
        self.draining = False
        self._servers: list[asyncio.Server] = []
        self._connections: set[_Connection] = set()
        self._gone = asyncio.Event()  # no connection left
        self._gone.set()
        self._busy = 0
        self._idle = asyncio.Event()  # no stream being answered
        self._idle.set()

    @property
    def port(self) -> int:
        return int(self._servers[0].sockets[0].getsockname()[1])

    @property
    def streams(self) -> int:
        """Streams being answered now, on every connection."""
        return self._busy

    async def wait_idle(self) -> None:
        """Until no stream is being answered."""
        await self._idle.wait()

    async def start(self, host: str, port: int, *, backlog: int = 2048) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=backlog
        )
        self._servers.append(server)

    def _sweep(self) -> None:
        """Every so often (a tenth of the read timeout, at most a second) while a connection
        is open (a server with none sleeps): the requests that stopped coming."""
        quiet_since = time.monotonic() - self.read_timeout_s
        for connection in list(self._connections):
            connection.expire(quiet_since)
        self._sweeper = None
        if self._connections:
            self._sweep_later()

    def _sweep_later(self) -> None:
        every = min(1.0, self.read_timeout_s / 10)
        self._sweeper = asyncio.get_running_loop().call_later(every, self._sweep)

    async def drain(self, timeout_s: float, forced: asyncio.Event | None = None) -> None:
        """Accept no more; tell each connection which of its streams are the last it answers
        (a GOAWAY); let those finish, up to the timeout or until ``forced`` is set; then
        close what is left, cancelling its streams."""
        self.draining = True
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.go_away()
        if self._connections:
            await until_set(self._gone, forced, timeout_s)
        self.close()

    def close(self) -> None:
        for server in self._servers:
            server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._connections):
            connection.abort()

    def _began(self) -> None:
        self._busy += 1
        self._idle.clear()

    def _ended(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    def _added(self, connection: _Connection) -> None:
        self._connections.add(connection)
        self._gone.clear()
        if self._sweeper is None:
            self._sweep_later()

    def _lost(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        if not self._connections:
            self._gone.set()


class _Connection(asyncio.Protocol):
    """One connection: the socket's side of an `Http2Wire`, and the owner of its events."""

    def __init__(self, server: Http2Server) -> None:
        self._server = server
        self._wire = Http2Wire(
            self,
            max_concurrent_streams=MAX_CONCURRENT_STREAMS,
            stream_window=STREAM_WINDOW,
            connection_window=CONNECTION_WINDOW,
        )
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, Http2Stream] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # Streams waiting for the peer's window to send on (a WINDOW_UPDATE wakes them).
        self._window: asyncio.Future[None] | None = None
        self._paused: asyncio.Future[None] | None = None  # the socket's buffer is full
        self._away = False  # a GOAWAY sent: streams past the last one named are refused
        self._last_stream = 0
        self._closing = False
        self._held = 0  # the bytes of bodies read and not yet answered (`Http2Stream.held`)

    # --- the socket --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is none by type)
        self._server._added(self)
        self._wire.initiate()
        self.flush()
        if self._server.draining:
            self.go_away()

    def data_received(self, data: bytes) -> None:
        try:
            self._wire.receive(data)
        except WireError as error:
            log.info("HTTP/2 peer broke the protocol: %s; closing its connection", error)
            self.flush()  # (the GOAWAY naming the error)
            for stream_id in list(self._streams):
                self._drop(stream_id)
            if self._transport is not None:
                self._transport.close()  # (after what is written)
            return
        self.flush()
        self._close_if_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for stream_id in list(self._streams):
            self._drop(stream_id)
        _wake(self._window)
        _wake(self._paused)
        self._server._lost(self)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = asyncio.get_running_loop().create_future()
        # A peer that does not read what it is sent (a PING after another, answers it leaves
        # unread) is read no further until it has: what it makes this side write stays
        # within the transport's high-water mark and one read's answers.
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        _wake(self._paused)
        self._paused = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def flush(self) -> None:
        data = self._wire.data_to_send()
        if data and self._transport is not None:
            self._transport.write(data)

    # --- what the peer does (`WireEvents`) ---------------------------------------------------

    def opened(self, stream_id: int, headers: Headers) -> None:
        if self._away and stream_id > self._last_stream:
            # After the GOAWAY: not begun, so the client may send it elsewhere.
            self._wire.reset_stream(stream_id, REFUSED_STREAM)
            return
        stream = Http2Stream(self, stream_id, headers, time.monotonic())
        self._streams[stream_id] = stream
        if self._server.app.converses(stream):
            self._start(stream, self._server.app.converse(stream))

    def data(self, stream_id: int, data: bytes, flow_length: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:  # (one this side has reset, or answered early)
            self._wire.acknowledge(stream_id, flow_length)
            return
        if stream_id in self.tasks:
            # A conversing task's: acknowledged as it reads (it bounds what it keeps).
            stream._received(data, flow_length)
            return
        self._wire.acknowledge(stream_id, flow_length)
        stream.active_at = time.monotonic()
        stream.size += len(data)
        if stream.too_large or stream.crowded:
            return
        if stream.size > self._server.max_body_bytes:
            stream.too_large = True
        elif self._held + len(data) > self._server.max_held_bytes:
            stream.crowded = True
        else:
            stream._chunks.append(data)
            stream.held += len(data)
            self._held += len(data)
            return
        stream._chunks.clear()
        self._release(stream)

    def ended(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        stream.ended = True
        if stream_id in self.tasks:
            stream._wake()
            return
        stream.body = b"".join(stream._chunks)
        stream._chunks.clear()
        self._start(stream, self._server.app.answer(stream))

    def reset(self, stream_id: int) -> None:
        self._drop(stream_id)

    def window_opened(self) -> None:
        _wake(self._window)

    def peer_left(self) -> None:
        # It opens no more streams: those open are answered, then the connection closes.
        self._closing = True

    # --- streams -----------------------------------------------------------------------------

    def _release(self, stream: Http2Stream) -> None:
        """What the connection held of a stream's body, no longer held."""
        self._held -= stream.held
        stream.held = 0

    def _start(self, stream: Http2Stream, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks[stream.id] = task
        task.add_done_callback(functools.partial(self._finished, stream))
        self._server._began()

    def _finished(self, stream: Http2Stream, task: asyncio.Task[None]) -> None:
        self.tasks.pop(stream.id, None)
        self._release(stream)
        self._server._ended()
        if self._streams.pop(stream.id, None) is not None and not stream.gone:
            # The task ended without ending the stream (it failed): the peer is told.
            self._wire.reset_stream(stream.id, INTERNAL_ERROR)
        self.flush()
        self._close_if_done()

    def _drop(self, stream_id: int) -> None:
        """The stream can no longer be answered: its task cancelled, what it held let go."""
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        stream.gone = True
        stream._wake()
        task = self.tasks.get(stream_id)
        if task is not None:
            task.cancel()
        else:  # (its task, if any, releases its body as it ends)
            stream._chunks.clear()
            self._release(stream)

    def expire(self, quiet_since: float) -> None:
        """Reset the requests to be handed over whole that have sent nothing since then."""
        late = [
            stream
            for stream in self._streams.values()
            if stream.active_at < quiet_since and stream.id not in self.tasks
        ]
        for stream in late:
            log.info("HTTP/2 stream %d: the request stopped coming; reset", stream.id)
            self._drop(stream.id)
            self._wire.reset_stream(stream.id, CANCEL)
        if late:
            self.flush()
            self._close_if_done()

    def acknowledge(self, stream: Http2Stream, length: int) -> None:
        if length and not stream.gone and self._transport is not None:
            self._wire.acknowledge(stream.id, length)
            self.flush()

    def send_headers(
        self, stream: Http2Stream, headers: Headers, end: bool, *, flush: bool = True
    ) -> None:
        if stream.gone or self._transport is None:
            raise StreamGone(f"stream {stream.id} was closed")
        self._wire.send_headers(stream.id, headers, end)
        if end:
            self._streams.pop(stream.id, None)
        if flush:
            self.flush()

    def send_now(self, stream: Http2Stream, data: bytes, end: bool) -> bool:
        """Data queued at once, unwritten, where it fits in one frame of the peer's window
        and the socket takes more (False: nothing was done; `send_data` waits for room)."""
        if stream.gone or self._transport is None or self._paused is not None:
            return False
        wire = self._wire
        if len(data) > min(wire.window(stream.id), wire.max_outbound_frame_size):
            return False
        wire.send_data(stream.id, data, end)
        if end:
            self._streams.pop(stream.id, None)
        return True

    async def send_data(self, stream: Http2Stream, data: bytes, end: bool) -> None:
        view = memoryview(data)
        wire = self._wire
        while True:
            if stream.gone or self._transport is None:
                raise StreamGone(f"stream {stream.id} was closed")
            if self._paused is not None:
                self.flush()
                await asyncio.shield(self._paused)
                continue
            room = min(wire.window(stream.id), wire.max_outbound_frame_size)
            if room <= 0 and len(view):
                if self._window is None or self._window.done():
                    self._window = asyncio.get_running_loop().create_future()
                self.flush()
                await asyncio.shield(self._window)
                continue
            chunk, view = view[:room], view[room:]
            last = end and not len(view)
            wire.send_data(stream.id, chunk.tobytes(), last)
            if last:
                self._streams.pop(stream.id, None)
            self.flush()
            if not len(view):
                return

    # --- closing -----------------------------------------------------------------------------

    def go_away(self) -> None:
        """Name the last stream this connection answers (the ones opened so far); close now
        if none is open."""
        if self._transport is None or self._away:
            return
        self._away = True
        self._last_stream = self._wire.highest_inbound_stream_id
        self._wire.go_away(self._last_stream)
        self.flush()
        self._closing = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self._closing and not self._streams and not self.tasks and self._transport:
            self._transport.close()


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
