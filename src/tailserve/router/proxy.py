"""``tailserve route``: the asyncio HTTP proxy in front of the workers.

It speaks HTTP/1.1 to clients (keep-alive, pipelined requests answered in order, chunked
request bodies; an idle connection closes after ``keep_alive_s``, a request whose head is not
whole or whose body stops coming for ``read_timeout_s`` gets a 408, a head over 64 KiB a 431)
on a bare asyncio protocol with httptools' parser, and hands each request to
the `Dispatcher` (replica choice, hedging, retries, ejection, shedding). No framework and no
task per request: parsing, framing and the reply are a few callbacks, so the router adds
little to a request's latency (benchmarks/router.py measures it).

Routes: inference (OIP v2 ``/v2/models/{m}[/versions/{v}]/infer``, binary included, and KServe
v1 ``/v1/models/{m}:predict``) goes to the model's pool and may be hedged and retried; model
metadata, readiness, stats and config go to the model's pool too; ``/v2/repository/models/
{m}/load|unload`` goes to every backend; anything else goes to any one backend (a worker's
own 404 answers a path it does not know). The router answers itself ``/v2/health/live``,
``/v2/health/ready`` (ready while any backend is in service), ``/metrics`` (its own metrics)
and ``/router/backends`` (each backend's state, as JSON).

Bodies up to ``stream_body_bytes`` (1 MiB) are read whole before they are forwarded, so a copy
can be sent again to another replica; replies come back whole the same way. Larger ones stream
(`_start_stream`, `_ReplyStream`): a request whose declared length is over that size (or a
chunked one that grows past it) is routed as its head arrives and its body follows piece by
piece, with reading from the client paused while the backend is behind; a reply over that size
(or chunked) is passed on as it comes, with reading from the backend paused while the client
is behind. A streamed request is not hedged, and retried only when its first connect failed. No
body may be over ``max_body_bytes`` (413). Every reply
names the replica that answered in ``x-tailserve-replica`` (and ``x-tailserve-hedged: 1``
when a hedge won). A client that hangs up withdraws its request from every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
from collections import deque
from typing import Any, cast
from urllib.parse import unquote

import httptools
import orjson

from tailserve.collector import freeze_held
from tailserve.protocols.grpc.startup import serve_or_log
from tailserve.router.config import RouterConfig
from tailserve.router.dispatch import (
    ANY,
    Dispatcher,
    Exchange,
    Framer,
    Outcome,
    body_key,
    cost_class,
)
from tailserve.router.membership import Membership
from tailserve.router.metrics import CONTENT_TYPE, RouterMetrics
from tailserve.transport.http1 import Ticket
from tailserve.transport.inbound import (
    CONTINUE,
    MAX_HEAD_BYTES,
    HeadReading,
    close_after,
    feed,
    head_of,
    too_long,
)

log = logging.getLogger(__name__)

# Not forwarded either way: they describe one connection, not the request (RFC 9110 7.6.1),
# or the router sets them itself.
_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te",
     b"upgrade", b"trailer", b"content-length", b"expect", b"x-deadline-ms")
)  # fmt: skip
_REPLY_HOP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server")
)
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_JSON = [(b"content-type", b"application/json")]


class _Request:
    __slots__ = (
        "body", "chunked", "error", "headers", "http10", "keep_alive", "length", "method",
        "started", "stream", "url",
    )  # fmt: skip

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        started: float,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.started = started
        # Refused before it is routed (status, message): a body over the limit.
        self.error: tuple[int, str] | None = None
        # Its body streams upstream (`_start_stream`): with this length, or chunked.
        self.stream = False
        self.chunked = False
        self.length: int | None = None
        # From an HTTP/1.0 client: told when it is kept alive, and never sent chunks.
        self.http10 = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class _Target:
    """Where a request goes: the model (or `ANY`), and whether it is an inference."""

    __slots__ = ("broadcast", "infer", "model")

    def __init__(self, model: str, infer: bool = False, broadcast: bool = False) -> None:
        self.model = model
        self.infer = infer
        self.broadcast = broadcast


def classify(method: bytes, path: str) -> _Target:
    """Which pool a path's request belongs to."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[0] == "v2" and parts[1] == "models" and parts[2] != "stats":
        model = unquote(parts[2])
        return _Target(model, infer=method == b"POST" and parts[-1] == "infer")
    if len(parts) >= 3 and parts[0] == "v1" and parts[1] == "models":
        name, _, verb = parts[2].partition(":")
        return _Target(unquote(name), infer=method == b"POST" and verb == "predict")
    if (
        len(parts) == 5
        and parts[:3] == ["v2", "repository", "models"]
        and parts[4] in ("load", "unload")
    ):
        return _Target(unquote(parts[3]), broadcast=True)
    return _Target(ANY)


class _ClientConnection(HeadReading, asyncio.Protocol):
    def __init__(self, router: Router) -> None:
        self._router = router
        self._loop = router.loop
        # Dropped when the connection is lost: it holds this protocol's bound methods, a cycle
        # that kept every closed connection until a full collection found it.
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        # The head being read: its size so far, and the bytes fed meanwhile (httptools holds
        # a header whole before it calls back: one that never ends is cut off by these).
        self._in_head = False
        self._head_size = 0
        self._head_fed = 0
        self._heads = 0  # requests begun on this connection
        # When bytes of the request being read last came, and when the router last held the
        # client back (reading paused, a 100 Continue owed); when the connection last went
        # idle (its last reply written).
        self._heard = 0.0
        self._held = 0.0
        self._idle_since = self._loop.time()
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        self._started = 0.0
        self._queue: deque[_Request] = deque()
        self._busy = False
        self._exchange: Exchange | None = None
        self._length: int | None = None  # the body's declared length
        self._streaming = False  # the body now arriving streams upstream
        self._reading_paused = False
        self._reply: _ReplyStream | None = None
        self.write_paused = False
        self.closing = False  # a reply said "connection: close": nothing more is read
        self.closed = False
        # Nothing more is read (a request that could not be read, or a protocol upgrade): the
        # requests already read are answered in turn, then the connection closes.
        self._ended = False
        self.in_message = False
        # A "100 Continue" is owed to the request being read, once those ahead are answered.
        self._continue_owed = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._router._connections.add(self)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self._ended or parser is None:
            return
        self._heard = self._loop.time()
        head = self._heads if self._in_head else -1
        feed(parser, data, self)
        # A read counts against a head only when all of it went to that head (one read may
        # also end the head before it and hold bodies and pipelined requests).
        if head == self._heads and self._in_head and not self._ended:
            self._head_fed += len(data)
            if too_long(self._head_fed):
                self.end(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._parser = None
        self._router._connections.discard(self)
        self._reply = None
        exchange = self._exchange
        if exchange is not None:
            self._exchange = None
            exchange.cancel()
            self._router._finished()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._reply is not None:
            self._reply.resume()

    # --- httptools callbacks ------------------------------------------------------------

    def _reading(self) -> httptools.HttpRequestParser:
        """The parser, from within its callbacks (it is dropped only once nothing is read)."""
        assert self._parser is not None
        return self._parser

    def on_message_begin(self) -> None:
        self.in_message = True
        self._in_head = True
        self._heads += 1
        self._head_size = self._head_fed = 0
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._too_large = False
        self._length = None
        self._started = self._heard = self._loop.time()

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._ended:
            return
        config = self._router.config
        self._length, waits = head_of(self._headers, self._reading().get_http_version())
        if self._length is not None and self._length > config.max_body_bytes:
            # Refused by its declared length, before its body (it may never end): in its turn,
            # and nothing after it is read.
            limit = config.max_body_bytes
            self.end(413, f"request body of {self._length} bytes is over the {limit}-byte limit")
            return
        # A client that waits for leave to send its body (curl does, past 1 KiB) gets it as
        # soon as the requests ahead of it are answered: an interim reply written while
        # another reply is on its way would land inside that one.
        if waits:
            self._continue_owed = True
            self._pay_continue()
        if self._length is not None and self._length > config.stream_body_bytes:
            self._start_stream(chunked=False)

    def on_body(self, body: bytes) -> None:
        if self._ended:
            return
        self._size += len(body)
        config = self._router.config
        if self._streaming:
            if self._size > config.max_body_bytes:  # a chunked body past the limit
                self._abandon()
                return
            exchange = self._exchange
            if exchange is not None:
                exchange.write(body)
                if exchange.congested and not self._reading_paused and self._transport:
                    self._reading_paused = True
                    self._transport.pause_reading()
            return
        if self._size > config.max_body_bytes:
            self._too_large = True
            self._body = []
        elif not self._too_large:
            self._body.append(body)
            if self._length is None and self._size > config.stream_body_bytes:
                self._start_stream(chunked=True)

    def on_message_complete(self) -> None:
        self.in_message = False
        self._continue_owed = False
        if self.closing or self._ended:
            return
        if self._streaming:
            self._streaming = False
            self.resume_body()
            if self._exchange is not None:
                self._exchange.end()
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        parser = self._reading()
        request = _Request(
            parser.get_method(), self._url, self._headers, body, parser.should_keep_alive(),
            self._started,
        )  # fmt: skip
        request.http10 = parser.get_http_version() == "1.0"
        if self._too_large:
            limit = self._router.config.max_body_bytes
            request.body = b""
            request.keep_alive = False  # the rest of the connection's bytes are not trusted
            request.error = (413, f"request body is over the {limit}-byte limit")
        self._queue.append(request)
        if not self._busy:
            self._next()

    # --- streamed bodies ----------------------------------------------------------------

    def _start_stream(self, *, chunked: bool) -> None:
        """Route the request now and let its body follow as it arrives: only when nothing
        is ahead of it on this connection (pipelined requests wait their turn whole)."""
        parser = self._reading()
        method = parser.get_method()
        if self._busy or self._queue or self.closed or method in (b"GET", b"HEAD"):
            return
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        if classify(method, path).broadcast:
            return
        request = _Request(
            method, self._url, self._headers, b"", parser.should_keep_alive(), self._started,
        )  # fmt: skip
        request.stream = True
        request.chunked = chunked
        request.length = self._length
        request.http10 = parser.get_http_version() == "1.0"
        self._streaming = True
        self._busy = True
        held, self._body = self._body, []
        self._router._handle(self, request)
        exchange = self._exchange
        if exchange is not None:
            exchange.on_drain(self.resume_body)
            for piece in held:
                exchange.write(piece)

    def resume_body(self) -> None:
        if self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = False
            self._heard = self._loop.time()  # the client's time runs again from here
            self._transport.resume_reading()

    def _abandon(self) -> None:
        """A streamed request body went over the limit: drop the request and the connection
        (what is already out cannot be taken back; the backend sees its connection close)."""
        limit = self._router.config.max_body_bytes
        log.warning("a streamed request body went over the %d-byte limit: connection dropped",
                    limit)  # fmt: skip
        self._streaming = False
        if self._transport is not None:
            self._transport.abort()

    def open_reply(
        self, request: _Request, label: str, head: Outcome, length: int | None,
        ticket: Ticket,
    ) -> _ReplyStream:  # fmt: skip
        """A large reply's head has come: send it on, and its body as it arrives (to an
        HTTP/1.0 client, a body of unknown length ends when the connection closes)."""
        unframed = length is None and request.http10
        keep_alive = self._keep_alive(request) and not unframed
        reply = self._reply = _ReplyStream(
            self, request, label, head.status, ticket, chunked=length is None and not unframed,
            keep_alive=keep_alive,
        )  # fmt: skip
        if not self.closed:
            assert self._transport is not None
            start = self._head(head.status, head.headers, length, keep_alive, head,
                               http10=request.http10)  # fmt: skip
            self._transport.write(start)
        return reply

    def reply_ended(self, reply: _ReplyStream, *, broken: bool) -> None:
        if self._reply is not reply:
            return  # the client left first: connection_lost settled the request
        self._reply = None
        self._idle_since = self._loop.time()
        request = reply.request
        self._settle(request, reply.status, reply.label)
        if self.closed or self._transport is None:
            return
        if broken:  # the client must not take a truncated body for a whole one
            self.closing = True
            self._transport.abort()
        elif not reply.keep_alive:
            self.closing = True
            self._transport.close()
        else:
            self._next()

    # --- requests, one at a time --------------------------------------------------------

    def _next(self) -> None:
        while self._queue and not self.closed and not self.closing and not self._busy:
            request = self._queue.popleft()
            if request.error is not None:
                self._reply_error(request, *request.error)
                continue
            self._busy = True
            self._router._handle(self, request)
        self._pay_continue()

    def _settle(self, request: _Request, status: int, model: str) -> None:
        self._exchange = None
        self._busy = False
        router = self._router
        router._finished()
        router.metrics.requests.inc(model, str(status))
        router.metrics.latency.child(model).observe(router.loop.time() - request.started)

    def done(self, request: _Request, outcome: Outcome, model: str) -> None:
        self._settle(request, outcome.status, model)
        if self.closed:
            return
        keep_alive = self._keep_alive(request)
        self._write(
            outcome.status, outcome.headers, outcome.body, keep_alive, outcome,
            head=request.method == b"HEAD", http10=request.http10,
        )  # fmt: skip
        if keep_alive:
            self._next()

    def _keep_alive(self, request: _Request) -> bool:
        """Whether the connection stays open after this request's reply: not when the client
        or a drain says so, not while its body still streams in (the rest of it is not
        read), and not after the last request read before the connection ended."""
        return (
            request.keep_alive
            and not self._router.draining
            and not self._streaming
            and not (self._ended and not self._queue)
        )

    def _reply_error(self, request: _Request, status: int, message: str) -> None:
        body = orjson.dumps({"error": message})
        self._write(status, _JSON, body, self._keep_alive(request), None, http10=request.http10)

    def end(self, status: int | None, message: str = "") -> None:
        """Read nothing more on this connection. The requests already read are answered in
        turn; then ``status`` (when given) answers the one that could not be read, and the
        connection closes. A request whose body was streaming upstream cannot be finished:
        the connection is dropped."""
        if self._ended or self.closed or self.closing or self._transport is None:
            return
        self._ended = True
        self._continue_owed = False
        self._transport.pause_reading()
        if self._streaming:
            self._streaming = False
            self._transport.abort()
            return
        if status is not None:
            request = _Request(b"", b"", [], b"", False, self._router.loop.time())
            request.error = (status, message)
            self._queue.append(request)
        if self._busy:
            return
        if self._queue:
            self._next()
        else:
            self.closing = True
            self._transport.close()

    def _pay_continue(self) -> None:
        if (
            self._continue_owed
            and not self._busy
            and not self._queue
            and not self.closed
            and not self.closing
            and self._transport is not None
        ):
            self._continue_owed = False
            self._heard = self._loop.time()
            self._transport.write(CONTINUE)

    def _write(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        outcome: Outcome | None,
        *,
        head: bool = False,
        http10: bool = False,
    ) -> None:
        """The reply; to a HEAD request, its head alone (with the length GET would send)."""
        assert self._transport is not None
        start = self._head(status, headers, len(body), keep_alive, outcome, http10=http10)
        self._transport.write(start + (b"" if head else body))
        self._idle_since = self._loop.time()
        if not keep_alive:
            self.closing = True
            close_after(self._transport, ended=self._ended)

    @staticmethod
    def _head(
        status: int,
        headers: list[tuple[bytes, bytes]],
        length: int | None,
        keep_alive: bool,
        outcome: Outcome | None,
        *,
        http10: bool = False,
    ) -> bytes:
        """A reply's status line and headers; chunked when the length is not known (but not
        to an HTTP/1.0 client: its body then ends with the connection)."""
        lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Unknown"))]
        for name, value in headers:
            if name.lower() not in _REPLY_HOP:
                lines.append(name + b": " + value)
        if length is None:
            if not http10:
                lines.append(b"transfer-encoding: chunked")
        else:
            lines.append(b"content-length: %d" % length)
        if outcome is not None and outcome.backend is not None:
            lines.append(b"x-tailserve-replica: " + outcome.backend.encode())
            if outcome.hedged:
                lines.append(b"x-tailserve-hedged: 1")
        if not keep_alive:
            lines.append(b"connection: close")
        elif http10:  # kept open only when said so, for a 1.0 client
            lines.append(b"connection: keep-alive")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def close_if_idle(self) -> None:
        if not self._busy and self._transport is not None:
            self._transport.close()

    def sweep(self, now: float, keep_alive_s: float, read_timeout_s: float) -> None:
        """Close the connection if it has been idle for ``keep_alive_s``; refuse the request
        being read (408, then close) if it stopped coming."""
        if self.closed or self.closing or self._transport is None:
            return
        if not self.in_message:
            if not self._busy and not self._queue and now - self._idle_since > keep_alive_s:
                self.closing = True
                self._transport.close()
            return
        if self._ended:
            return
        reason = self._late(now, read_timeout_s)
        if reason is not None:
            self.end(408, reason)


class _ReplyStream:
    """A large reply on its way from a backend to the client (an `http1.Sink`)."""

    __slots__ = ("chunked", "connection", "keep_alive", "label", "paused", "request", "status",
                 "ticket")  # fmt: skip

    def __init__(
        self,
        connection: _ClientConnection,
        request: _Request,
        label: str,
        status: int,
        ticket: Ticket,
        *,
        chunked: bool,
        keep_alive: bool,
    ) -> None:
        self.connection = connection
        self.request = request
        self.label = label
        self.status = status
        self.ticket = ticket
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.paused = False

    def data(self, chunk: bytes) -> None:
        connection = self.connection
        transport = connection._transport
        if connection.closed or transport is None or not chunk:
            return
        if self.chunked:
            chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
        transport.write(chunk)
        if connection.write_paused and not self.paused:
            self.paused = True
            self.ticket.pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.ticket.resume_reading()

    def end(self) -> None:
        transport = self.connection._transport
        if self.chunked and transport is not None and not self.connection.closed:
            transport.write(b"0\r\n\r\n")
        self.connection.reply_ended(self, broken=False)

    def abort(self) -> None:
        self.connection.reply_ended(self, broken=True)


class Router:
    """The proxy: a `Dispatcher` behind an HTTP/1.1 server."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._dispatcher: Dispatcher | None = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: set[_ClientConnection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self.port = config.port
        # The gRPC front (`grpc_gateway`), while it serves; its port once bound.
        self._grpc: Any = None
        self.grpc_port: int | None = None

    @property
    def dispatcher(self) -> Dispatcher:
        assert self._dispatcher is not None, "the router has not started"
        return self._dispatcher

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.dispatcher.loop

    @property
    def metrics(self) -> RouterMetrics:
        return self.dispatcher.metrics

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Read the membership, check every backend once, then listen."""
        dispatcher = self._dispatcher = Dispatcher(self.config)
        membership = Membership(self.config, dispatcher.set_members)
        await membership.refresh()
        await dispatcher.check_all()
        loop = dispatcher.loop
        self._tasks = [
            loop.create_task(dispatcher.run_health()),
            loop.create_task(membership.run()),
        ]
        self._server = await loop.create_server(
            lambda: _ClientConnection(self),
            self.config.host,
            self.config.port,
            reuse_address=True,
            backlog=2048,
        )
        sockets = self._server.sockets
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self._sweep()
        log.info(
            "router on %s: %d backends, policy %s, hedging %s",
            self.url, len(dispatcher.upstreams), self.config.balance,
            "on" if self.config.hedge else "off",
        )  # fmt: skip
        await self._start_grpc()
        # What the router holds for its life (modules, the dispatcher, the gRPC stack) leaves
        # the collector's generations: a full collection over it stalled every request in
        # flight for 16-22 ms, a few times a run, which was the p99.9 of a healthy pool.
        freeze_held()

    def _sweep(self) -> None:
        """Once a second: idle connections past their time, requests that stopped coming."""
        now, config = self.loop.time(), self.config
        for connection in list(self._connections):
            connection.sweep(now, config.keep_alive_s, config.read_timeout_s)
        self._sweeper = self.loop.call_later(1.0, self._sweep)

    async def _start_grpc(self) -> None:
        """The Open Inference Protocol's gRPC service on ``grpc_port`` (0: none), sent on to
        the workers over HTTP. A router that cannot serve it (grpcio not installed, the port
        taken) says so and serves HTTP."""

        def build() -> Any:
            from tailserve.router.grpc_gateway import Gateway

            return Gateway(self).handlers()

        port = self.config.grpc_port
        self._grpc = await serve_or_log(build, self.config.host, port,
                                        max_message_bytes=self.config.max_body_bytes,
                                        what="router")  # fmt: skip
        if self._grpc is None:
            return
        self.grpc_port = port
        log.info("router: gRPC on %s:%d, sent on to the workers over HTTP", self.config.host, port)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop accepting, let the requests in flight finish (up to the timeout), close."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close_if_idle()
        timeout = self.config.drain_timeout_s if timeout_s is None else timeout_s
        # gRPC calls in flight finish too (up to the same timeout); new ones are refused.
        grpc_stop = None
        if self._grpc is not None:
            grpc_stop = self.loop.create_task(self._grpc.stop(timeout))
            self._grpc = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        if grpc_stop is not None:
            await grpc_stop
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._connections):
            if connection._transport is not None:
                connection._transport.close()
        if self._dispatcher is not None:
            await self._dispatcher.close()

    async def serve(self) -> None:
        """Run until SIGTERM or SIGINT, then drain."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("router draining")
        await self.drain()

    # --- requests -------------------------------------------------------------------------

    def _finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def _handle(self, connection: _ClientConnection, request: _Request) -> None:
        self._in_flight += 1
        self._idle.clear()
        url = request.url
        path = url.split(b"?", 1)[0].decode("latin-1")
        local = self._local(request, path)
        if local is not None:
            connection.done(request, local, "_router")
            return
        target = classify(request.method, path)
        dispatcher = self.dispatcher
        model = target.model
        label = model if model != ANY and self.knows(model) else "_other"
        if target.broadcast:
            task = self.loop.create_task(self._broadcast(request, path))
            task.add_done_callback(lambda t: connection.done(request, t.result(), label))
            return
        deadline_s = _deadline(request)
        frame = _framer(request)
        key = None
        if target.infer and dispatcher.wants_key(model):
            given = request.header(b"x-affinity-key")
            if given:
                key = given.decode("latin-1")
            elif not request.stream:
                key = body_key(request.body, _binary_header_length(request))
        on_stream = None
        if request.method != b"HEAD":

            def on_stream(head: Outcome, length: int | None, ticket: Ticket) -> _ReplyStream:
                return connection.open_reply(request, label, head, length, ticket)

        exchange = dispatcher.dispatch(
            model=model,
            frame=frame,
            on_done=lambda outcome: connection.done(request, outcome, label),
            key=key,
            cost="l" if request.stream else cost_class(len(request.body)),
            deadline_s=deadline_s,
            idempotent=request.method in (b"GET", b"HEAD"),
            hedge=target.infer,
            stream=request.stream,
            chunked=request.chunked,
            on_stream=on_stream,
        )
        # A request shed at once is already answered (and settled): nothing is left to
        # cancel, and the connection may already be on its next pipelined request, whose
        # exchange this must not overwrite.
        if not exchange.done:
            connection._exchange = exchange

    def knows(self, model: str) -> bool:
        # (Only models some backend lists become metric labels: a client cannot grow the
        # label set by inventing model names.)
        return model in self.dispatcher.known_models()

    def _local(self, request: _Request, path: str) -> Outcome | None:
        if request.method not in (b"GET", b"HEAD"):
            return None
        if path == "/v2/health/live":
            return Outcome(200, [], b"")
        if path == "/v2/health/ready":
            if self.ready():
                return Outcome(200, [], b"")
            return Outcome(503, _JSON, orjson.dumps({"error": "no backend is in service"}))
        if path == "/metrics":
            return Outcome(200, [(b"content-type", CONTENT_TYPE.encode())], self.metrics.render())
        if path == "/router/backends":
            return Outcome(200, _JSON, orjson.dumps(self.state()))
        return None

    def ready(self) -> bool:
        """Some backend is in service, and the router is not draining."""
        now = self.loop.time()
        return not self.draining and any(b.in_service(now) for b in self.dispatcher.backends)

    def state(self) -> dict[str, object]:
        """Each backend's routing state and the budgets' counters (``/router/backends``)."""
        d = self.dispatcher
        now = self.loop.time()
        return {
            "backends": [
                {
                    "id": u.backend.id,
                    "in_flight": u.backend.in_flight,
                    "ewma_ms": None
                    if u.backend.latency_s is None
                    else round(u.backend.latency_s * 1e3, 3),
                    "healthy": u.backend.healthy,
                    "ejected": u.backend.is_ejected(now),
                    "ejections": u.backend.ejections,
                    # The share of its recent requests that a hedge elsewhere beat.
                    "overtaken": round(u.backend.overtaken, 4),
                    # What outlier ejection judges it on: its recent first copies, and those
                    # a hedge beat.
                    "first_copies": u.backend.first_copies,
                    "first_losses": u.backend.first_losses,
                    "models": None if u.models is None else sorted(u.models),
                }
                for u in d.upstreams.values()
            ],
            "hedges": {
                "requests": d.hedge_budget.requests,
                "sent": d.hedge_budget.spent,
                # Refused: found the budget empty when due (each then waits for a token);
                # late: sent once one came; waiting: queued for one now.
                "refused": d.hedge_budget.refused,
                "late": d.late_hedges,
                "suspect": d.suspect_hedges,
                "waiting": d.hedges_waiting,
                # The delay after which each model and cost class hedges now (None: too few
                # replies known yet).
                "delays_ms": {
                    f"{model}/{cost}": None if delay is None else round(delay * 1e3, 3)
                    for (model, cost), policy in d.hedge_policies().items()
                    for delay in (policy.delay_s(now),)
                },
            },
            "retries": {"sent": d.retry_budget.spent, "refused": d.retry_budget.refused},
        }

    async def _broadcast(self, request: _Request, path: str) -> Outcome:
        """Repository load/unload: every backend does it; the worst answer is the reply."""
        d = self.dispatcher
        data = _framer(request)(None)
        upstreams = list(d.upstreams.values())
        replies = await asyncio.gather(
            *(u.pool.request(data, self.config.request_timeout_s) for u in upstreams),
            return_exceptions=True,
        )
        worst = Outcome(200, _JSON, b"{}")
        errors = {}
        for upstream, reply in zip(upstreams, replies, strict=True):
            if isinstance(reply, BaseException):
                errors[upstream.backend.id] = str(reply)
                worst = Outcome(502, _JSON, b"")
            elif reply.status != 200:
                errors[upstream.backend.id] = reply.body.decode(errors="replace")
                if reply.status > worst.status:
                    worst = Outcome(reply.status, _JSON, b"")
        if not upstreams:
            return Outcome(503, _JSON, orjson.dumps({"error": "no backends"}))
        if errors:
            worst.body = orjson.dumps(
                {"error": f"{path} failed on some backends", "backends": errors}
            )
        return worst


def _deadline(request: _Request) -> float | None:
    raw = request.header(b"x-deadline-ms")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value / 1e3 if value > 0 else None


def _framer(request: _Request) -> Framer:
    """The request's bytes for a backend, given what is left of its deadline (or None); of a
    streamed request, its head alone (with its declared length, or chunked)."""
    # HEAD goes upstream as GET (our response parser expects a body where a length is
    # given); the reply to the client drops the body again.
    method = b"GET" if request.method == b"HEAD" else request.method
    lines = [method + b" " + request.url + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in request.headers if name not in _HOP]
    body = request.body
    if request.stream and request.chunked:
        lines.append(b"transfer-encoding: chunked")
    elif request.stream:
        lines.append(b"content-length: %d" % (request.length or 0))
    elif body or request.method in (b"POST", b"PUT", b"PATCH"):
        lines.append(b"content-length: %d" % len(body))
    head = b"\r\n".join(lines)
    raw_deadline = request.header(b"x-deadline-ms")

    def frame(remaining_s: float | None) -> bytes:
        if remaining_s is None:
            if raw_deadline is not None:  # not a number: the worker names the problem
                return head + b"\r\nx-deadline-ms: " + raw_deadline + b"\r\n\r\n" + body
            return head + b"\r\n\r\n" + body
        remaining_ms = max(remaining_s * 1e3, 0.001)
        return head + b"\r\nx-deadline-ms: %.3f\r\n\r\n" % remaining_ms + body

    return frame


def _binary_header_length(request: _Request) -> int | None:
    """The JSON header's length of a body in the binary tensor extension (None: all JSON)."""
    value = request.header(b"inference-header-content-length")
    return int(value) if value is not None and value.isdigit() else None
