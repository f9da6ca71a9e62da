"""The worker's HTTP/1.1 server (transport/server.py) on a loopback port, driven over raw
connections with a small application: pipelined requests answered in order, keep-alive and its
idle timeout, HTTP/1.0, HEAD, 100-continue, bodies over the limit, malformed requests, a client
that hangs up (its work cancelled) and a drain."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from tailserve.transport.request import HttpRequest
from tailserve.transport.server import MAX_HEAD_BYTES, MAX_QUEUED_BYTES, HttpServer, Reply

LIMIT = 1000
BIG = b"b" * (20 * 1024 * 1024)


class App:
    """``/now`` answers without a task, ``/refuse`` refuses without one, ``/echo`` echoes
    the body, ``/wait`` waits for `release`, ``/boom`` raises."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.seen: list[HttpRequest] = []
        self.cancelled: list[HttpRequest] = []
        # Called as ``/hook`` is answered, before its task is made.
        self.hook: Callable[[], None] = lambda: None

    def answer_now(self, request: HttpRequest) -> Reply | None:
        self.seen.append(request)
        if request.path == "/now":
            return 200, [(b"x-how", b"now")], b"now"
        if request.path == "/refuse":
            return 429, [(b"retry-after", b"1")], b"busy"
        if request.path == "/hook":
            self.hook()
        return None

    def answer(self, request: HttpRequest) -> Coroutine[Any, Any, Reply]:
        return self._answer(request)

    async def _answer(self, request: HttpRequest) -> Reply:
        if request.path == "/wait":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(request)
                raise
            return 200, [], BIG if request.raw_body == b"big" else b"waited"
        if request.path == "/boom":
            raise RuntimeError("a bug")
        return 200, [(b"content-type", b"text/plain")], b"echo:" + request.raw_body


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, App]]:
    app = App()
    server = HttpServer(app, max_body_bytes=LIMIT, keep_alive_s=0.5)
    await server.start("127.0.0.1", 0)
    try:
        yield server, app
    finally:
        server.close()


async def _replies(port: int, data: bytes, *, count: int = 10) -> list[tuple[bytes, bytes]]:
    """Send ``data``; each reply's head and body in order, until ``count`` or the server
    closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    replies: list[tuple[bytes, bytes]] = []
    try:
        while len(replies) < count:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            except asyncio.IncompleteReadError as eof:
                assert not eof.partial, eof.partial
                break
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            interim = head.startswith(b"HTTP/1.1 100")
            body = await reader.readexactly(length) if length and not interim else b""
            replies.append((head, body))
    finally:
        writer.close()
    return replies


def _status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


async def test_pipelined_requests_are_answered_in_order(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    data = (
        b"POST /echo HTTP/1.1\r\nhost: w\r\ncontent-length: 1\r\n\r\na"
        b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n"
        b"POST /echo HTTP/1.1\r\nhost: w\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nbc\r\n1\r\nd\r\n0\r\n\r\n"
        b"GET /now HTTP/1.1\r\nhost: w\r\nconnection: close\r\n\r\n"
    )
    replies = await _replies(server.port, data)
    assert [body for _, body in replies] == [b"echo:a", b"now", b"echo:bcd", b"now"]
    assert all(_status(head) == 200 for head, _ in replies)
    assert b"connection: close" in replies[-1][0]
    assert b"date: " in replies[0][0]


async def test_answers_count_what_was_served_with_or_without_a_task_apart_from_refusals(
    served: tuple[HttpServer, App],
) -> None:
    # The loop's backlog divides its CPU by the requests answered, a refusal at once counted
    # apart (at a fraction of one): a reply served at once (a kept reply) is answered.
    server, _ = served
    data = (
        b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n"
        b"GET /refuse HTTP/1.1\r\nhost: w\r\n\r\n"
        b"POST /echo HTTP/1.1\r\nhost: w\r\ncontent-length: 1\r\nconnection: close\r\n\r\na"
    )
    replies = await _replies(server.port, data)
    assert [_status(head) for head, _ in replies] == [200, 429, 200]
    # The task's count lands in its done callback, a turn of the loop after its reply; the
    # server is idle once it has run.
    await asyncio.wait_for(server.wait_idle(), 5)
    state = server.state()
    assert (state.in_flight, state.answered, state.refused) == (0, 2, 1)


async def test_a_head_request_gets_the_length_and_no_body(served: tuple[HttpServer, App]) -> None:
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"HEAD /now HTTP/1.1\r\nhost: w\r\n\r\nGET /now HTTP/1.1\r\nhost: w\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"content-length: 3" in head
    # The next bytes are the second reply, not a body for the first.
    second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert second.startswith(b"HTTP/1.1 200")
    assert await reader.readexactly(3) == b"now"
    writer.close()


async def test_http_1_0_closes_after_the_reply_unless_kept_alive(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    replies = await _replies(server.port, b"GET /now HTTP/1.0\r\n\r\nGET /now HTTP/1.0\r\n\r\n")
    assert len(replies) == 1
    assert b"connection: close" in replies[0][0]
    kept = await _replies(
        server.port, b"GET /now HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", count=1
    )
    assert b"connection: keep-alive" in kept[0][0]  # said, or a 1.0 client waits for the close


async def test_an_idle_connection_is_closed_after_the_keep_alive_time(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n")
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await reader.readexactly(3)
    # The sweep runs once a second: closed within keep_alive_s (0.5 s) plus one sweep.
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_100_continue_is_sent_before_the_body_is_read(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nhost: w\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hi")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 200
    assert await reader.readexactly(7) == b"echo:hi"
    writer.close()


async def test_a_body_over_the_limit_is_refused_by_its_declared_length_before_it_is_sent(
    served: tuple[HttpServer, App],
) -> None:
    server, app = served
    data = (
        b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n"
        b"POST /echo HTTP/1.1\r\nhost: w\r\nexpect: 100-continue\r\n"
        b"content-length: %d\r\n\r\n" % (LIMIT + 1)
    )
    replies = await _replies(server.port, data)
    assert [_status(head) for head, _ in replies] == [200, 413]  # no 100 Continue
    assert b"over the 1000-byte limit" in replies[1][1]
    assert [r.path for r in app.seen] == ["/now"]


async def test_a_chunked_body_that_grows_past_the_limit_is_refused(
    served: tuple[HttpServer, App],
) -> None:
    server, app = served
    chunk = b"x" * 600
    data = (  # never ended: the 413 cannot wait for its end
        b"POST /echo HTTP/1.1\r\nhost: w\r\ntransfer-encoding: chunked\r\n\r\n"
        b"%x\r\n%s\r\n%x\r\n%s\r\n" % (len(chunk), chunk, len(chunk), chunk)
    )
    replies = await _replies(server.port, data)
    assert [_status(head) for head, _ in replies] == [413]
    assert b"connection: close" in replies[0][0]
    assert app.seen == []


async def test_a_malformed_request_is_400_after_those_before_it(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    data = b"GET /now HTTP/1.1\r\nhost: w\r\n\r\nNOT HTTP AT ALL\r\n\r\n"
    replies = await _replies(server.port, data)
    assert [_status(head) for head, _ in replies] == [200, 400]
    assert b"malformed HTTP request" in replies[1][1]


async def test_an_error_the_application_left_unanswered_is_a_500(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    data = b"GET /boom HTTP/1.1\r\nhost: w\r\n\r\nGET /now HTTP/1.1\r\nhost: w\r\n\r\n"
    replies = await _replies(server.port, data, count=2)
    assert [_status(head) for head, _ in replies] == [500, 200]


async def test_a_client_that_hangs_up_has_its_work_cancelled(
    served: tuple[HttpServer, App],
) -> None:
    server, app = served
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /wait HTTP/1.1\r\nhost: w\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    writer.close()
    for _ in range(500):
        if app.cancelled:
            break
        await asyncio.sleep(0.01)
    assert len(app.cancelled) == 1
    assert app.cancelled[0].disconnected


async def test_a_closed_connection_is_freed_at_once_not_by_a_full_collection(
    served: tuple[HttpServer, App],
) -> None:
    # Its parser held the protocol's bound methods: every closed connection was a cycle that
    # only a full collection freed (a benchmark's 1,024 connections: 40 ms of it).
    server, _ = served
    gc.collect()
    gc.disable()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"now"), 5)
        connections = [weakref.ref(c) for c in server.connections]
        assert len(connections) == 1
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(server.wait_no_connections(), 5)
        assert connections[0]() is None
    finally:
        gc.enable()


async def test_a_drain_finishes_the_request_in_flight_and_closes_idle_connections(
    served: tuple[HttpServer, App],
) -> None:
    server, app = served
    port = server.port
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    idle_writer.write(b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n")
    await asyncio.wait_for(idle_reader.readuntil(b"\r\n\r\n"), 5)
    await idle_reader.readexactly(3)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /wait HTTP/1.1\r\nhost: w\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)

    drained = asyncio.ensure_future(server.drain(10.0))
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # the idle one is closed
    assert not drained.done()  # the one in flight holds the drain
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)  # no longer accepting
    app.release.set()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 200 and b"connection: close" in head
    assert await reader.readexactly(6) == b"waited"
    await asyncio.wait_for(drained, 5)
    idle_writer.close()
    writer.close()


async def test_a_header_too_long_is_refused_before_it_ends(served: tuple[HttpServer, App]) -> None:
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /now HTTP/1.1\r\nhost: w\r\nx-big: ")
    for _ in range(8):  # never ended (the read it began in may hold 256 KiB of it)
        writer.write(b"v" * MAX_HEAD_BYTES)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 431
    writer.close()


async def test_a_refused_client_still_sending_gets_the_whole_reply(
    served: tuple[HttpServer, App],
) -> None:
    # The head goes over the limit and the client keeps sending: the server answers 431 and
    # ends the connection with the client's bytes unread. Closed at once, the kernel would
    # reset it and the client would lose the reply; it gets all of it, then the end.
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /now HTTP/1.1\r\nhost: w\r\nx-big: " + b"v" * (4 * MAX_HEAD_BYTES))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 431
    for _ in range(4):  # still sending after the reply
        writer.write(b"v" * MAX_HEAD_BYTES)
        await writer.drain()
    assert b"request head over" in await asyncio.wait_for(reader.read(), 5)
    writer.close()


async def test_an_absolute_target_and_an_upgrade(served: tuple[HttpServer, App]) -> None:
    server, _ = served
    replies = await _replies(
        server.port,
        b"GET http://w:1/now?x=1 HTTP/1.1\r\nhost: w\r\n\r\n"
        b"GET /now HTTP/1.1\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n",
    )
    assert [body for _, body in replies] == [b"now", b"now"]
    assert b"connection: close" in replies[1][0]  # not upgraded, and closed after it


async def test_pipelined_bodies_pause_reading_by_their_bytes(
    served: tuple[HttpServer, App],
) -> None:
    app = App()
    server = HttpServer(app, max_body_bytes=512 * 1024)
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /wait HTTP/1.1\r\nhost: w\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    body = b"x" * (500 * 1024)
    post = b"POST /echo HTTP/1.1\r\nhost: w\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    for _ in range(40):  # 20 MB: far more than the socket buffers hold
        writer.write(post)
    (connection,) = server.connections
    for _ in range(50):
        await asyncio.sleep(0.02)
        assert connection.state().queued_bytes <= MAX_QUEUED_BYTES + len(body)
    assert connection.state().reading_paused
    app.release.set()
    for _ in range(41):
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.wait_for(
            reader.readuntil(b"waited") if _ == 0 else reader.readexactly(5 + len(body)), 10
        )
    writer.close()
    server.close()


async def test_a_task_cancelled_before_it_ran_does_not_hold_a_drain(
    served: tuple[HttpServer, App],
) -> None:
    server, app = served

    hung_up = asyncio.Event()

    def hang_up() -> None:  # the client's reset arrives before the task's first step
        (connection,) = server.connections
        connection.abort()
        hung_up.set()

    app.hook = hang_up
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /hook HTTP/1.1\r\nhost: w\r\n\r\n")
    await asyncio.wait_for(hung_up.wait(), 5)
    await asyncio.wait_for(server.wait_no_connections(), 5)
    assert server.state().connections == 0
    await asyncio.wait_for(server.drain(10.0), 2)
    writer.close()


async def test_a_drain_lets_a_large_reply_be_written_out(served: tuple[HttpServer, App]) -> None:
    server, app = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /wait HTTP/1.1\r\nhost: w\r\ncontent-length: 3\r\n\r\nbig")
    await asyncio.wait_for(app.started.wait(), 5)
    drained = asyncio.ensure_future(server.drain(10.0))
    app.release.set()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"content-length: %d" % len(BIG) in head
    assert await asyncio.wait_for(reader.readexactly(len(BIG)), 10) == BIG
    await asyncio.wait_for(drained, 5)
    writer.close()


async def test_a_head_that_trickles_in_gets_a_408_and_others_are_served(
    served: tuple[HttpServer, App],
) -> None:
    app = App()
    server = HttpServer(app, max_body_bytes=LIMIT, read_timeout_s=0.5)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        head = b"GET /now HTTP/1.1\r\nhost: w\r\nx-slow: " + b"v" * 1000
        reply = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        sent = 0
        while not reply.done() and sent < len(head):  # a byte a tick, never finished
            writer.write(head[sent : sent + 1])
            sent += 1
            await asyncio.wait([reply], timeout=0.02)
        assert reply.done() and sent < len(head)
        assert _status(reply.result()) == 408 and b"connection: close" in reply.result()
        assert b"not received within 0.5 s" in await asyncio.wait_for(reader.read(), 5)
        # Another client is served as ever.
        assert [body for _, body in await _replies(server.port, b"GET /now HTTP/1.0\r\n\r\n")] == [
            b"now"
        ]
        writer.close()
    finally:
        server.close()


async def test_a_body_that_stops_is_refused_unless_the_server_holds_it_back(
    served: tuple[HttpServer, App],
) -> None:
    server, app = served
    # A body that stops coming: 408 once the sweep finds it silent for the timeout.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /echo HTTP/1.1\r\nhost: w\r\ncontent-length: 10\r\n\r\nabc")
    stalled = await _connection_reading(server)
    stalled.expire_read(time.monotonic() + 5, 10.0)
    assert not stalled.state().ended  # not silent for 10 s yet
    stalled.expire_read(time.monotonic() + 11, 10.0)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 408
    assert b"body stalled" in await asyncio.wait_for(reader.read(), 5)
    writer.close()
    # A body the server holds back (its 100 Continue owed while the request ahead of it is
    # answered) is not late, however long that takes; its time starts once it is let in.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"GET /wait HTTP/1.1\r\nhost: w\r\n\r\n"
        b"POST /echo HTTP/1.1\r\nhost: w\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
    )
    await asyncio.wait_for(app.started.wait(), 5)
    held = await _connection_reading(server)
    held.expire_read(time.monotonic() + 60, 10.0)
    assert not held.state().ended
    app.release.set()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 200 and await reader.readexactly(6) == b"waited"
    assert (
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    # 5 s after it was let in (a minute after it began): still in time.
    held.expire_read(time.monotonic() + 5, 10.0)
    assert not held.state().ended
    writer.write(b"ok")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert _status(head) == 200 and await reader.readexactly(7) == b"echo:ok"
    writer.close()


async def _connection_reading(server: HttpServer) -> Any:
    """The server's one connection that is reading a request, once it is."""
    for _ in range(500):
        reading = [c for c in server.connections if c.state().in_message]
        if reading:
            return reading[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no connection began reading a request")


async def test_many_pipelined_requests_in_large_reads_are_all_answered(
    served: tuple[HttpServer, App],
) -> None:
    # Reads that begin inside one head and hold thousands of requests: none of that counts
    # against the one head's limit.
    server, _ = served
    count = 10_000
    replies = await _replies(
        server.port, b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n" * count, count=count
    )
    assert len(replies) == count and all(body == b"now" for _, body in replies)


async def test_a_server_without_connections_sleeps_and_wakes_with_a_fresh_date(
    served: tuple[HttpServer, App],
) -> None:
    server, _ = served
    assert server._sweeper is None  # (no timer while nobody is connected)
    server.date = b"date: a stale one\r\n"  # as if it had slept a long while
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /now HTTP/1.1\r\nhost: w\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"date: " in head and b"stale" not in head
    assert server._sweeper is not None
    # The keep-alive sweep closes the idle connection; the sweep after finds none and stops.
    assert await asyncio.wait_for(reader.read(), 5) == b"now"
    writer.close()
    await asyncio.wait_for(server.wait_no_connections(), 5)
    if server._sweeper is not None:  # (the sweep after the last one, run now)
        server._sweeper.cancel()
    server._sweep()
    assert server._sweeper is None
