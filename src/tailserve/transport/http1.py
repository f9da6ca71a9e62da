"""A small HTTP/1.1 client: a pool of keep-alive connections to one origin, one request at a
time on each (no pipelining).

It is built on asyncio protocols and httptools' response parser and costs a few microseconds a
request. That matters where the client shares two cores with the server it measures (the load
generator) or sits on the path of every request (the router). Requests are bytes framed once by
`frame_request`, so a body sent many times is encoded once.

The core is callback-driven (`Pool.submit`): the open-loop generator sends thousands of requests
a second and a task per request would cost more than the request itself. `Pool.request` is the
awaitable form. Requests and replies are sent and read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ssl import SSLContext
from typing import cast

import httptools

from tailserve.errors import ConnectFailed, ConnectionLost, UpstreamError, UpstreamTimeout
from tailserve.transport.base import PoolState

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class Response:
    status: int
    headers: Headers
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        """The first header of that (lower-case) name, compared without regard to case."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


Callback = Callable[[Response | UpstreamError], None]


def frame_request(
    method: str,
    path: str,
    host: str,
    body: bytes = b"",
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    """The bytes of one request: request line, headers, Content-Length, body."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        # When it last went idle (the pool's clock): past ``max_idle_s`` it is not reused.
        self.idle_since = 0.0
        # Dropped when the connection is lost: it holds this protocol's bound methods, a cycle
        # that kept every closed connection until a full collection found it (a hedge's
        # loser closes one each time).
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._callback: Callback | None = None
        self._ticket: Ticket | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._headers: Headers = []
        self._body: list[bytes] = []
        self.closed = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports do not subclass asyncio.Transport, so no isinstance check)
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(ConnectionLost(f"bad response from {self._pool.origin}: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._parser = None
        self._pool._forget(self)
        why = f": {exc}" if exc is not None else ""
        self._finish(ConnectionLost(f"connection to {self._pool.origin} closed{why}"))

    # --- httptools callbacks ------------------------------------------------------------

    def _reading(self) -> httptools.HttpResponseParser:
        """The parser, from within its callbacks (it is dropped only once nothing is read)."""
        assert self._parser is not None
        return self._parser

    def on_message_begin(self) -> None:
        self._headers = []
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._reading()
        status = parser.get_status_code()
        if status < 200:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        response = Response(status, self._headers, body)
        if not parser.should_keep_alive():
            self.abort()
        self._finish(response)

    # --- the pool's side ----------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._callback is not None

    def send(self, ticket: Ticket) -> None:
        assert self._transport is not None and self._callback is None
        self._callback = ticket.callback
        self._ticket = ticket
        ticket.connection = self
        if ticket.deadline is not None:
            self._timer = self._pool.loop.call_at(ticket.deadline, self._timed_out)
        self._transport.write(ticket.data)

    def cancel(self, ticket: Ticket) -> None:
        """Drop the request in flight without a callback: the connection is closed, so the
        server sees the client go and can drop the work."""
        if self._ticket is not ticket:
            return
        self._callback = None
        self._ticket = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.abort()

    def abort(self) -> None:
        """Close at once, dropping what is in flight (the server sees the disconnect)."""
        if not self.closed:
            self.closed = True
            self._pool._forget(self)
            if self._transport is not None:
                self._transport.abort()

    def _timed_out(self) -> None:
        self._timer = None
        self._finish(UpstreamTimeout(f"no response from {self._pool.origin} in time"))
        self.abort()

    def _finish(self, result: Response | UpstreamError) -> None:
        callback, self._callback = self._callback, None
        self._ticket = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if callback is None:
            return
        if isinstance(result, Response) and not self.closed:
            self._pool._release(self)
        callback(result)


def _dequeued(ticket: Ticket) -> None:
    """A ticket has left the pool's queue: its wait's deadline timer is not needed."""
    if ticket.expiry is not None:
        ticket.expiry.cancel()
        ticket.expiry = None


class Ticket:
    """One submitted request: `cancel` withdraws it, from the queue or, once sent, by
    closing its connection (no callback follows either way)."""

    __slots__ = ("callback", "cancelled", "connection", "data", "deadline", "expiry")

    def __init__(self, data: bytes, callback: Callback, deadline: float | None) -> None:
        self.data = data
        self.callback = callback
        self.deadline = deadline
        # Its deadline's timer while it waits for a connection, cancelled once it leaves the
        # queue: left to run out, it held the ticket (and the connection that sent it) until
        # the deadline, tens of thousands of them at once in a generator past capacity.
        self.expiry: asyncio.TimerHandle | None = None
        self.connection: _Connection | None = None
        self.cancelled = False

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self.connection is not None:
            self.connection.cancel(self)


class Pool:
    """Up to ``max_connections`` keep-alive connections to ``host:port``.

    A request takes an idle connection, or opens one while under the limit, or waits in order
    for one to come free. Its ``timeout_s`` counts from submission, waiting included.

    A connection idle longer than ``max_idle_s`` is closed rather than reused: a server closes
    idle connections after its keep-alive timeout (uvicorn's: 5 s), and a request written as it
    does is lost with the connection (only an idempotent one could be retried).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 64,
        connect_timeout_s: float = 5.0,
        max_idle_s: float = 4.0,
        loop: asyncio.AbstractEventLoop | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.max_idle_s = max_idle_s
        self._ssl = ssl
        self.host = host
        self.port = port
        self.origin = f"{host}:{port}"
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.loop = loop or asyncio.get_running_loop()
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._waiting: deque[Ticket] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._opened = 0

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def state(self) -> PoolState:
        return PoolState(len(self._open), len(self._idle), len(self._waiting), self._opened)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, data: bytes, callback: Callback, timeout_s: float | None = None) -> Ticket:
        """Send ``data`` (a framed request); ``callback`` gets the response or the error,
        unless the ticket answered is cancelled first."""
        deadline = None if timeout_s is None else self.loop.time() + timeout_s
        ticket = Ticket(data, callback, deadline)
        if self._closed:
            callback(ConnectionLost(f"the pool to {self.origin} is closed"))
            return ticket
        if self._idle and not self._waiting:
            connection = self._take_idle()
            if connection is not None:
                connection.send(ticket)
                return ticket
        self._waiting.append(ticket)
        if deadline is not None:
            # Its deadline holds while it waits, too: a connection may not come free (every
            # one busy on a hung backend) nor connect (a host that does not answer) in time.
            ticket.expiry = self.loop.call_at(deadline, self._expire_waiting, ticket)
        self._pump()
        return ticket

    async def request(self, data: bytes, timeout_s: float | None = None) -> Response:
        future: asyncio.Future[Response | UpstreamError] = self.loop.create_future()

        def done(result: Response | UpstreamError) -> None:
            if not future.done():
                future.set_result(result)

        self.submit(data, done, timeout_s)
        result = await future
        if isinstance(result, UpstreamError):
            raise result
        return result

    async def close(self) -> None:
        """Fail what waits, close every connection, and wait for connects in progress."""
        self._closed = True
        while self._waiting:
            item = self._waiting.popleft()
            _dequeued(item)
            if not item.cancelled:
                item.callback(ConnectionLost(f"the pool to {self.origin} closed"))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()

    # --- internals ------------------------------------------------------------------------

    def _expire_waiting(self, ticket: Ticket) -> None:
        ticket.expiry = None
        try:
            self._waiting.remove(ticket)  # still waiting: not sent, failed or closed since
        except ValueError:
            return
        if not ticket.cancelled:
            ticket.callback(self._no_connection())

    def _pump(self) -> None:
        now = self.loop.time()
        while self._waiting and self._idle:
            item = self._waiting[0]
            if item.cancelled:
                _dequeued(self._waiting.popleft())
                continue
            if item.deadline is not None and now >= item.deadline:
                _dequeued(self._waiting.popleft())
                item.callback(self._no_connection())
                continue
            connection = self._take_idle()
            if connection is None:
                break
            _dequeued(self._waiting.popleft())
            connection.send(item)
        wanted = len(self._waiting) - self._connecting
        room = self.max_connections - len(self._open) - self._connecting
        for _ in range(min(wanted, room)):
            self._connecting += 1
            task = self.loop.create_task(self._connect())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self) -> None:
        try:
            _, connection = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                ),
                self.connect_timeout_s,
            )
        except asyncio.CancelledError:
            self._connecting -= 1
            raise
        except Exception as exc:  # OSError, TimeoutError, and whatever a protocol raises
            self._connecting -= 1
            # The oldest waiting request pays for the failed attempt, so that a server that is
            # down fails requests instead of holding them until their timeout.
            while self._waiting and self._waiting[0].cancelled:
                _dequeued(self._waiting.popleft())
            if self._waiting:
                reason = str(exc) or type(exc).__name__
                first = self._waiting.popleft()
                _dequeued(first)
                first.callback(ConnectFailed(f"cannot connect to {self.origin}: {reason}"))
            self._pump()
            return
        self._connecting -= 1
        if self._closed:
            connection.abort()
            return
        self._open.add(connection)
        self._opened += 1
        connection.idle_since = self.loop.time()
        self._idle.append(connection)
        self._pump()

    def _no_connection(self) -> UpstreamTimeout:
        return UpstreamTimeout(f"no connection to {self.origin} came free in time")

    def _take_idle(self) -> _Connection | None:
        """The most recently used idle connection that is not stale (the stale are closed)."""
        now = self.loop.time()
        while self._idle:
            connection = self._idle.pop()
            if now - connection.idle_since <= self.max_idle_s:
                return connection
            self._open.discard(connection)  # (closing: not counted against the limit)
            connection.abort()
        return None

    def _release(self, connection: _Connection) -> None:
        if self._closed:
            connection.abort()
            return
        connection.idle_since = self.loop.time()
        self._idle.append(connection)
        if self._waiting:
            self._pump()

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)
        if self._waiting and not self._closed:
            self._pump()
