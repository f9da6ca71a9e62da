"""The worker's HTTP/1.1 server: a bare asyncio protocol on httptools' parser.

It replaced uvicorn in the worker. Per request uvicorn built an ASGI scope, a message per body
piece and two per reply, and a task; that was most of the gap between a cache hit and a fixed
reply (docs/worker.md, "The HTTP server"). Here a request is read whole into an `HttpRequest`
and handed to the application in one call, which may answer at once (`Application.answer_now`:
a route that does not exist, a request refused under load) or return a coroutine, run as a
task; its ``(status, headers, body)`` is written as one buffer. A reply with trailers,
``(status, headers, body, trailers)`` (gRPC's status, `protocols.grpc.over_http1`), goes out
chunked: the body as one chunk, then the trailers.

HTTP/1.1 as clients use it: keep-alive (an idle connection closes after ``keep_alive_s``; a
request whose head is not whole, or whose body stops coming, for ``read_timeout_s`` gets a 408),
pipelined requests answered in order, chunked request bodies, ``Expect: 100-continue``,
HTTP/1.0, HEAD. A body over the limit is refused with 413, by its declared length before it
is read; a malformed request gets a 400 and the connection closes; a protocol upgrade is not
made (the request is answered over HTTP/1.1, then the connection closes). A client that hangs
up cancels its request's task (`HttpRequest.disconnected` tells that cancellation apart), so
work still queued for a batch is dropped. Each request's arrival (the parser's first byte of
it) is its deadline's start.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import logging
import socket
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast

import httptools
import orjson

from tailserve.transport.inbound import (
    CONTINUE,
    MAX_HEAD_BYTES,
    HeadReading,
    close_after,
    feed,
    head_of,
    too_long,
)
from tailserve.transport.request import HttpRequest
from tailserve.transport.waits import until_set

log = logging.getLogger(__name__)
access = logging.getLogger("tailserve.access")

Headers = list[tuple[bytes, bytes]]
Reply = tuple[int, Headers, bytes]
# A reply with trailers after its body (sent chunked).
Trailed = tuple[int, Headers, bytes, Headers]

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
# Set by the server from these, not by the application.
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection", b"date"))
# Requests, and bytes of their bodies, read ahead of the one being answered (pipelined)
# before reading pauses.
MAX_PIPELINED = 32
MAX_QUEUED_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerState:
    """The server at one moment, as an operator (or a test) sees it."""

    connections: int
    in_flight: int  # requests being answered by a task
    answered: int
    refused: int
    draining: bool


@dataclass(frozen=True, slots=True)
class ConnectionState:
    """One connection at one moment."""

    in_message: bool  # a request is being read
    queued: int  # requests read and waiting their turn
    queued_bytes: int  # ... and the bytes of their bodies
    reading_paused: bool  # held back: too much is queued
    ended: bool  # reading nothing more (the requests read are answered, then it closes)


class Application(Protocol):
    def answer_now(self, request: HttpRequest) -> Reply | None:
        """The reply, if it needs no waiting (else None: `answer` is called)."""

    def answer(self, request: HttpRequest) -> Coroutine[Any, Any, Reply | Trailed]: ...


class HttpServer:
    def __init__(
        self,
        app: Application,
        *,
        max_body_bytes: int,
        keep_alive_s: float = 5.0,
        read_timeout_s: float = 30.0,
        head_timeout_s: float | None = None,
        access_log: bool = False,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.read_timeout_s = read_timeout_s
        # None: a head has read_timeout_s as well.
        self.head_timeout_s = head_timeout_s
        self.access_log = access_log
        self.draining = False
        self.date = b""
        self._servers: list[asyncio.Server] = []
        self._connections: set[_Connection] = set()
        self._busy = 0
        # Requests answered so far: by a task, or at once with a success (a reply kept in the
        # reply memo); not the refusals and errors answered at once (the loop's backlog:
        # observability.loop_lag).
        self.answered = 0
        # Requests refused at once (an error answered without a task: an overload's 429s).
        self.refused = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._gone = asyncio.Event()  # no connection left
        self._gone.set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def in_flight(self) -> int:
        """Requests being answered by a task now."""
        return self._busy

    @property
    def port(self) -> int:
        return int(self._servers[0].sockets[0].getsockname()[1])

    @property
    def connections(self) -> tuple[_Connection, ...]:
        """The connections open now."""
        return tuple(self._connections)

    def state(self) -> ServerState:
        return ServerState(
            len(self._connections), self._busy, self.answered, self.refused, self.draining
        )

    async def wait_idle(self) -> None:
        """Until no request is being answered (and what each answered is counted)."""
        await self._idle.wait()

    async def wait_no_connections(self) -> None:
        """Until every connection has closed."""
        await self._gone.wait()

    async def start(
        self,
        host: str,
        port: int,
        *,
        sockets: list[socket.socket] | None = None,
        backlog: int = 2048,
    ) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if sockets:
            for sock in sockets:
                server = await loop.create_server(
                    lambda: _Connection(self), sock=sock, backlog=backlog
                )
                self._servers.append(server)
        else:
            server = await loop.create_server(
                lambda: _Connection(self), host, port, reuse_address=True, backlog=backlog
            )
            self._servers.append(server)
        self._date()

    def _date(self) -> None:
        self.date = b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"

    def _sweep(self) -> None:
        """Once a second while a connection is open (a server with none sleeps): the Date
        header's value, idle connections past their time, and requests that stopped coming."""
        assert self._loop is not None
        self._date()
        now = time.monotonic()
        for connection in list(self._connections):
            connection.close_if_idle(now - self.keep_alive_s)
            connection.expire_read(now, self.read_timeout_s, self.head_timeout_s)
        self._sweeper = self._loop.call_later(1.0, self._sweep) if self._connections else None

    def _added(self, connection: _Connection) -> None:
        self._connections.add(connection)
        self._gone.clear()
        if self._sweeper is None and self._loop is not None:
            self._date()  # (it may have slept)
            self._sweeper = self._loop.call_later(1.0, self._sweep)

    async def drain(self, timeout_s: float, forced: asyncio.Event | None = None) -> None:
        """Stop accepting and close idle connections; let the requests in flight finish (up
        to the timeout, or until ``forced`` is set), each connection closing after its reply;
        then close what is left, cancelling its work."""
        self.draining = True
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.close_if_idle(None)
        # The work in flight, then the connections: each closes once its last reply is
        # written out (aborting one earlier would cut a large reply short).
        for done in (self._idle, self._gone):
            if self._connections or not done.is_set():
                await until_set(done, forced, until - loop.time())
            for connection in list(self._connections):
                connection.close_if_idle(None)
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

    def _ended(self, task: asyncio.Task[None]) -> None:
        # A done callback: it runs even for a task cancelled before its first step.
        self._busy -= 1
        self.answered += 1
        if self._busy == 0:
            self._idle.set()

    def _lost(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        if not self._connections:
            self._gone.set()


class _Connection(HeadReading, asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self._server = server
        # Dropped when the connection is lost: it holds this protocol's bound methods, a cycle
        # that kept every closed connection (~15 objects) until a full collection found it.
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._peer = ""
        # The request being read.
        self._url = b""
        self._headers: Headers = []
        self._head_size = 0
        self._body: list[bytes] = []
        self._size = 0
        self._started = 0.0
        self.in_message = False
        # Between a request's first byte and its last header; the bytes fed meanwhile
        # (httptools holds a header whole before it calls back: a long one is cut here).
        self._in_head = False
        self._head_fed = 0
        self._heads = 0  # requests begun on this connection
        # When bytes of the request being read last came, and when the server last held the
        # client back (reading paused, a 100 Continue owed): its clock starts again from there.
        self._heard = 0.0
        self._held = 0.0
        # A "100 Continue" is owed to the request being read, once those ahead are answered.
        self._continue_owed = False
        # Read and waiting their turn; the one being answered and its task.
        self._queue: deque[HttpRequest] = deque()
        self._queued_bytes = 0
        self._current: HttpRequest | None = None
        self._task: asyncio.Task[None] | None = None
        self._idle_since = time.monotonic()
        self._reading_paused = False
        self._write_paused = False
        # Nothing more is read (a request that could not be read, or an upgrade): the requests
        # already read are answered in turn, then the connection closes.
        self._ended = False
        self._closing = False
        self._closed = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server._added(self)
        if self._server.access_log:
            peer = transport.get_extra_info("peername")
            self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self._ended or self._closing or parser is None:
            return
        self._heard = time.monotonic()
        head = self._heads if self._in_head else -1
        feed(parser, data, self)
        # A read counts against a head only when all of it went to that head (one read may
        # also end the head before it and hold bodies and pipelined requests).
        if head == self._heads and self._in_head and not self._ended:
            self._head_fed += len(data)
            if too_long(self._head_fed):
                self.end(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._parser = None
        self._server._lost(self)
        self._queue.clear()
        self._queued_bytes = 0
        task, request = self._task, self._current
        if task is not None and request is not None and not task.done():
            # The client no longer wants the answer: its work (a place in a batch's queue)
            # is dropped.
            request.disconnected = True
            task.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._next()

    # --- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._started = self._heard = time.monotonic()
        self.in_message = True
        self._in_head = True
        self._heads += 1
        self._head_fed = 0
        self._url = b""
        self._headers = []
        self._head_size = 0
        self._body = []
        self._size = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._ended:
            return
        assert self._parser is not None  # (it is the caller)
        length, waits = head_of(self._headers, self._parser.get_http_version())
        limit = self._server.max_body_bytes
        if length is not None and length > limit:
            # Refused by its declared length before its body (which may never end): in its
            # turn, and nothing after it is read.
            self.end(413, f"request body of {length} bytes is over the {limit}-byte limit")
            return
        # A client that waits for leave to send its body gets it as soon as the requests
        # ahead of it are answered: an interim reply written while another is on its way
        # would land inside that one.
        if waits:
            self._continue_owed = True
            self._pay_continue()

    def on_body(self, body: bytes) -> None:
        if self._ended:
            return
        self._size += len(body)
        limit = self._server.max_body_bytes
        if self._size > limit:  # a chunked body (a declared length was refused above)
            self._body = []
            self.end(413, f"request body is over the {limit}-byte limit")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.in_message = False
        self._continue_owed = False
        if self._ended or self._closing:
            return
        parser = self._parser
        assert parser is not None  # (it is the caller)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        request = HttpRequest(
            parser.get_method().decode("latin-1"),
            self._url,
            self._headers,
            body,
            received_at=self._started,
            max_body_bytes=self._server.max_body_bytes,
            # An upgrade is not made: the request is answered, then the connection closes.
            keep_alive=parser.should_keep_alive() and not parser.should_upgrade(),
            version=parser.get_http_version(),
        )
        self._queue.append(request)
        self._queued_bytes += len(body)
        if (
            len(self._queue) > MAX_PIPELINED or self._queued_bytes > MAX_QUEUED_BYTES
        ) and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()
        self._next()

    # --- requests, one at a time --------------------------------------------------------

    def _next(self) -> None:
        while (
            self._queue
            and self._task is None
            and not self._write_paused
            and not self._closing
            and not self._closed
        ):
            request = self._queue.popleft()
            self._queued_bytes -= len(request.raw_body)
            if request.error is not None:
                status, message = request.error
                self._server.refused += 1
                self._write(request, status, _JSON, orjson.dumps({"error": message}))
                continue
            app = self._server.app
            reply = app.answer_now(request)
            if reply is not None:
                if reply[0] < 400:
                    self._server.answered += 1
                else:
                    self._server.refused += 1
                self._write(request, *reply)
                continue
            self._server._began()
            self._current = request
            task = self._task = asyncio.get_running_loop().create_task(self._answer(request))
            task.add_done_callback(self._server._ended)
        if (
            self._reading_paused
            and len(self._queue) <= MAX_PIPELINED // 2
            and self._queued_bytes <= MAX_QUEUED_BYTES // 2
        ):
            self._reading_paused = False
            self._heard = time.monotonic()  # the client's time runs again from here
            if self._transport is not None and not self._ended:
                self._transport.resume_reading()
        self._pay_continue()

    async def _answer(self, request: HttpRequest) -> None:
        """Run the application's answer and write it from the same task: a done callback
        would wait a turn of the event loop, behind every other connection's reads."""
        try:
            reply: Reply | Trailed = await self._server.app.answer(request)
        except asyncio.CancelledError:
            if not request.disconnected:
                self.abort()  # cancelled with the client still there: a forced close
            raise
        except Exception as exc:
            # The application answers its own errors; this is a bug in it.
            log.error("unanswered error on %s %s", request.method, request.path, exc_info=exc)
            reply = (500, _JSON, b'{"error": "internal error"}')
        self._task = self._current = None
        if not self._closed:
            self._write(request, *reply)
            self._next()

    def _keep_alive(self, request: HttpRequest) -> bool:
        """Whether the connection stays open after this request's reply: not when the client
        or a drain says so, nor after the last request read before the connection ended."""
        return (
            request.keep_alive
            and not self._server.draining
            and not (self._ended and not self._queue)
        )

    def _write(
        self,
        request: HttpRequest,
        status: int,
        headers: Headers,
        body: bytes,
        trailers: Headers | None = None,
    ) -> None:
        """The reply; to a HEAD request its head alone (with the length GET would send).
        With ``trailers``, chunked: the body as one chunk, then the trailers."""
        transport = self._transport
        if transport is None or self._closed:
            return
        keep_alive = self._keep_alive(request)
        line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
        parts = [line, self._server.date]
        for name, value in headers:
            if name not in _FRAMING:
                parts += (name, b": ", value, b"\r\n")
        if trailers is None:
            parts.append(b"content-length: %d\r\n" % len(body))
        else:
            parts.append(b"transfer-encoding: chunked\r\n")
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        elif request.version == "1.0":  # kept open only when said so, for a 1.0 client
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        if trailers is not None:
            if body:
                parts += (b"%x\r\n" % len(body), body, b"\r\n")
            parts.append(b"0\r\n")
            for name, value in trailers:
                parts += (name, b": ", value, b"\r\n")
            parts.append(b"\r\n")
        elif request.method != "HEAD":
            parts.append(body)
        transport.write(b"".join(parts))
        self._idle_since = time.monotonic()
        if self._server.access_log:
            access.info(
                '%s - "%s %s HTTP/%s" %d',
                self._peer,
                request.method,
                request.path,
                request.version,
                status,
            )
        if not keep_alive:
            self._closing = True
            close_after(transport, ended=self._ended)

    def end(self, status: int | None, message: str = "") -> None:
        """Read nothing more on this connection. The requests already read are answered in
        turn; then ``status`` (when given) answers the one that could not be read, and the
        connection closes."""
        if self._ended or self._closed or self._closing or self._transport is None:
            return
        self._ended = True
        self._continue_owed = False
        self._transport.pause_reading()
        if status is not None:
            request = HttpRequest(
                "", b"", [], b"", received_at=time.monotonic(), max_body_bytes=0, keep_alive=False
            )
            request.error = (status, message)
            self._queue.append(request)
        if self._task is None and not self._queue:
            self._closing = True
            self._transport.close()
        else:
            self._next()

    def _pay_continue(self) -> None:
        if (
            self._continue_owed
            and self._task is None
            and not self._queue
            and not self._closed
            and not self._closing
            and self._transport is not None
        ):
            self._continue_owed = False
            self._heard = time.monotonic()
            self._transport.write(CONTINUE)

    def close_if_idle(self, idle_before: float | None) -> None:
        """Close the connection if nothing is being read or answered on it (and, given a
        time, it has been idle since before it)."""
        if (
            self._task is None
            and not self._queue
            and not self.in_message
            and not self._closing
            and self._transport is not None
            and (idle_before is None or self._idle_since < idle_before)
        ):
            self._closing = True
            self._transport.close()

    def state(self) -> ConnectionState:
        return ConnectionState(
            self.in_message,
            len(self._queue),
            self._queued_bytes,
            self._reading_paused,
            self._ended,
        )

    def expire_read(
        self, now: float, timeout_s: float, head_timeout_s: float | None = None
    ) -> None:
        """Refuse the request being read (408, then close) if it stopped coming."""
        if not self.in_message or self._ended or self._closing or self._closed:
            return
        reason = self._late(now, timeout_s, head_timeout_s)
        if reason is not None:
            self.end(408, reason)

    def abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._closing = True
            self._transport.abort()


_JSON: Headers = [(b"content-type", b"application/json")]
