"""The client transport's in-process twin (transport/base.py's contract): requests go to an
`Application` (what the worker's HTTP server serves) in the same event loop, with no socket in
between.

`MemoryNetwork` stands for the loopback network: `listen(app)` gives an application an address,
`connect(host, port, ...)` makes a `MemoryPool` to it with `http1.Pool`'s surface and
semantics, so the router's dispatcher runs on it unchanged (transport/base.py):

- a request's timeout counts from submission, waiting for a connection included
  (`UpstreamTimeout`); at most ``max_connections`` requests are out at once, the rest wait in
  order;
- cancelling a ticket, or a timeout, is the client going away: the application's task is
  cancelled with ``request.disconnected`` set, as the server does when a connection closes;
- the callback never runs inside `submit` (only a closed pool answers at once);
- an application that raises answers 500.

Faults are injected per address: `kill` (a crashed server: what is in flight fails with
`ConnectionLost`, new requests with `ConnectFailed`), `revive`, and `delay_s` (a slower
network: each request reaches the application that much later). The application sets its own
service time (a test's gate, an event it waits on), so nothing here sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol

import httptools

from tailserve.errors import ConnectFailed, ConnectionLost, UpstreamError, UpstreamTimeout
from tailserve.transport.base import Callback, PoolState
from tailserve.transport.http1 import Response
from tailserve.transport.request import HttpRequest

Reply = tuple[int, list[tuple[bytes, bytes]], bytes]
Trailed = tuple[int, list[tuple[bytes, bytes]], bytes, list[tuple[bytes, bytes]]]
_JSON = [(b"content-type", b"application/json")]


class Application(Protocol):
    """As `transport.server.Application`: the same object serves both."""

    def answer_now(self, request: HttpRequest) -> Reply | None: ...

    def answer(self, request: HttpRequest) -> Coroutine[Any, Any, Reply | Trailed]: ...


class _Site:
    __slots__ = ("app", "delay_s", "live", "tasks")

    def __init__(self, app: Application) -> None:
        self.app = app
        self.live = True
        self.delay_s = 0.0
        self.tasks: set[asyncio.Task[None]] = set()


class MemoryNetwork:
    def __init__(self, host: str = "memory") -> None:
        self.host = host
        self._ports = itertools.count(1)
        self._sites: dict[str, _Site] = {}

    def listen(self, app: Application) -> str:
        """Serve ``app`` at a new address; answers its URL (``http://memory:N``)."""
        port = next(self._ports)
        self._sites[f"{self.host}:{port}"] = _Site(app)
        return f"http://{self.host}:{port}"

    def connect(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 64,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> MemoryPool:
        return MemoryPool(self, f"{host}:{port}", max_connections, loop)

    def kill(self, url: str) -> None:
        """The server at ``url`` crashes: its work in flight stops, its clients see their
        connections drop, and nothing connects until `revive`."""
        site = self._site(url)
        site.live = False
        for task in list(site.tasks):
            task.cancel()

    def revive(self, url: str) -> None:
        self._site(url).live = True

    def delay(self, url: str, delay_s: float) -> None:
        """Each request reaches the application at ``url`` ``delay_s`` later."""
        self._site(url).delay_s = delay_s

    def serving(self, origin: str) -> _Site | None:
        """What listens at ``host:port`` now (None: nothing, or killed)."""
        found = self._sites.get(origin)
        return found if found is not None and found.live else None

    def _site(self, url: str) -> _Site:
        return self._sites[url.split("://", 1)[-1]]


class MemoryTicket:
    __slots__ = ("callback", "cancelled", "data", "deadline", "request", "task", "timer")

    def __init__(self, data: bytes, callback: Callback, deadline: float | None) -> None:
        self.data = data
        self.callback = callback
        self.deadline = deadline
        self.cancelled = False
        self.request: HttpRequest | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._hang_up()

    def _hang_up(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None and not self.task.done():
            if self.request is not None:
                self.request.disconnected = True
            self.task.cancel()


class MemoryPool:
    """A pool to one address of a `MemoryNetwork` (see the module's docstring)."""

    def __init__(
        self,
        network: MemoryNetwork,
        origin: str,
        max_connections: int,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.network = network
        self.origin = origin
        self.max_connections = max_connections
        self.loop = loop or asyncio.get_running_loop()
        self._running: set[MemoryTicket] = set()
        self._idle = 0
        self._opened = 0
        self._waiting: deque[MemoryTicket] = deque()
        self._closed = False

    def state(self) -> PoolState:
        busy = len(self._running)
        return PoolState(busy + self._idle, self._idle, len(self._waiting), self._opened)

    def submit(
        self, data: bytes, callback: Callback, timeout_s: float | None = None
    ) -> MemoryTicket:
        deadline = None if timeout_s is None else self.loop.time() + timeout_s
        ticket = MemoryTicket(data, callback, deadline)
        if self._closed:
            callback(ConnectionLost(f"the pool to {self.origin} is closed"))
            return ticket
        if deadline is not None:
            ticket.timer = self.loop.call_at(deadline, self._timed_out, ticket)
        self._waiting.append(ticket)
        self.loop.call_soon(self._pump)
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
        self._closed = True
        while self._waiting:
            ticket = self._waiting.popleft()
            if not ticket.cancelled:
                ticket.cancel()
                ticket.callback(ConnectionLost(f"the pool to {self.origin} closed"))
        self._idle = 0

    # --- internals ------------------------------------------------------------------------

    def _pump(self) -> None:
        while self._waiting and len(self._running) < self.max_connections and not self._closed:
            ticket = self._waiting.popleft()
            if ticket.cancelled:
                continue
            site = self.network.serving(self.origin)
            if site is None:
                self._end(ticket, ConnectFailed(f"cannot connect to {self.origin}: refused"))
                continue
            if self._idle:
                self._idle -= 1
            else:
                self._opened += 1
            self._running.add(ticket)
            task = ticket.task = self.loop.create_task(self._exchange(site, ticket))
            site.tasks.add(task)
            task.add_done_callback(site.tasks.discard)
            # (Also when cancelled before its first step, when `_exchange` never runs.)
            task.add_done_callback(functools.partial(self._abandon, ticket))

    async def _exchange(self, site: _Site, ticket: MemoryTicket) -> None:
        result: Response | UpstreamError
        kept = False
        try:
            if site.delay_s > 0:
                await asyncio.sleep(site.delay_s)
            reply = await self._answer(site.app, ticket)
        except asyncio.CancelledError:
            if ticket.cancelled:  # the client went: no callback
                raise
            result = ConnectionLost(f"connection to {self.origin} closed")
        else:
            status, headers, body = reply[:3]
            # (No wire: a reply's trailers come after its headers.)
            trailers = reply[3] if len(reply) == 4 else []
            headers = [*headers, (b"content-length", str(len(body)).encode()), *trailers]
            result = Response(status, headers, body)
            kept = ticket.request is not None and ticket.request.keep_alive
        self._release(ticket, kept=kept)
        self._end(ticket, result)

    async def _answer(self, app: Application, ticket: MemoryTicket) -> Reply | Trailed:
        try:
            request = ticket.request = _parse(ticket.data)
        except httptools.HttpParserError:
            return 400, _JSON, b'{"error": "malformed request"}'
        reply = app.answer_now(request)
        if reply is not None:
            return reply
        try:
            return await app.answer(request)
        except Exception:  # as the server does: a bug in the application
            return 500, _JSON, b'{"error": "internal error"}'

    def _abandon(self, ticket: MemoryTicket, _: object) -> None:
        self._release(ticket, kept=False)

    def _release(self, ticket: MemoryTicket, *, kept: bool) -> None:
        """Its connection is free again (``kept``: for reuse) or gone."""
        if ticket not in self._running:
            return
        self._running.discard(ticket)
        if kept and not self._closed:
            self._idle += 1
        if self._waiting:
            self.loop.call_soon(self._pump)

    def _timed_out(self, ticket: MemoryTicket) -> None:
        ticket.timer = None
        if ticket.cancelled:
            return
        with contextlib.suppress(ValueError):
            self._waiting.remove(ticket)
        waited = ticket.task is None
        ticket.cancel()
        what = "no connection to {} came free in time" if waited else "no response from {} in time"
        ticket.callback(UpstreamTimeout(what.format(self.origin)))

    def _end(self, ticket: MemoryTicket, result: Response | UpstreamError) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
            ticket.timer = None
        if not ticket.cancelled:
            ticket.cancelled = True  # answered: a later cancel has nothing to withdraw
            ticket.callback(result)


class _Head:
    """Collects one request from httptools' callbacks."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)


_NO_LIMIT = 1 << 40  # (the sender framed it: the server's size limit is not the twin's)


def _parse(data: bytes) -> HttpRequest:
    head = _Head()
    parser = httptools.HttpRequestParser(head)
    parser.feed_data(data)
    return HttpRequest(
        parser.get_method().decode("latin-1"),
        head.url,
        head.headers,
        b"".join(head.body),
        received_at=time.monotonic(),
        max_body_bytes=_NO_LIMIT,
        keep_alive=parser.should_keep_alive(),
        version=parser.get_http_version(),
    )
