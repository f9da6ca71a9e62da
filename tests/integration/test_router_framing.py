"""The router's HTTP/1.1 framing on a raw connection when a client misbehaves: every request
read before a bad one is still answered, in order, then the connection closes; nothing is
written after a reply that closed it; an interim "100 Continue" never lands inside another
reply; and a body over the limit by its declared length is refused before it is sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from support.routing import running_router
from support.stub import StubApp, run_stub
from tailserve.transport.inbound import MAX_HEAD_BYTES

BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}]})
INFER = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n" % len(BODY)


@pytest.fixture
async def router_port() -> AsyncIterator[tuple[int, StubApp]]:
    stub = StubApp()
    with run_stub(stub) as backend:
        async with running_router([backend.url], hedge=False) as router:
            yield router.port, stub


async def _exchange(port: int, data: bytes, *, then: bytes = b"") -> list[bytes]:
    """Send ``data`` (and ``then`` once the first reply's head is in); every reply's head and
    body, in order, until the router closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    replies: list[bytes] = []
    try:
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            except asyncio.IncompleteReadError as eof:
                assert not eof.partial, eof.partial
                return replies
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            replies.append(head + await reader.readexactly(length))
            if then:
                writer.write(then)
                then = b""
    finally:
        writer.close()


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


async def test_a_malformed_request_is_answered_after_those_before_it(
    router_port: tuple[int, StubApp],
) -> None:
    port, _ = router_port
    replies = await _exchange(port, INFER + b"\r\n" + BODY + b"BAD\x01 / HTTP/1.1\r\n\r\n")
    assert [_status(r) for r in replies] == [200, 400], replies
    assert b"malformed HTTP request" in replies[1]
    assert b"connection: close" in replies[1]


async def test_nothing_is_written_after_a_reply_that_closed_the_connection(
    router_port: tuple[int, StubApp],
) -> None:
    port, _ = router_port
    # Forwarded and answered by the router itself alike: one reply, then the connection ends.
    for first in (INFER + b"connection: close\r\n\r\n" + BODY,
                  b"GET /v2/health/live HTTP/1.1\r\nconnection: close\r\n\r\n"):  # fmt: skip
        replies = await _exchange(port, first + b"GET /v2/health/live HTTP/1.1\r\n\r\n")
        assert [_status(r) for r in replies] == [200], replies
        assert b"connection: close" in replies[0]


async def test_an_upgrade_is_ignored_and_the_connection_closed_after_its_reply(
    router_port: tuple[int, StubApp],
) -> None:
    port, _ = router_port
    upgrade = (b"GET /v2/health/live HTTP/1.1\r\nhost: r\r\nupgrade: h2c\r\n"
               b"connection: Upgrade, HTTP2-Settings\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA"
               b"\r\n\r\n")  # fmt: skip
    # One reply over HTTP/1.1 and then the end of the connection (the router's own reply went
    # before the parser met the upgrade, so it may not say "connection: close").
    replies = await _exchange(port, upgrade)
    assert [_status(r) for r in replies] == [200], replies


async def test_a_body_over_the_limit_by_its_declared_length_is_refused_before_it_is_sent(
    router_port: tuple[int, StubApp],
) -> None:
    port, stub = router_port
    head = (b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: 1000000000000\r\n"
            b"expect: 100-continue\r\n\r\n")  # fmt: skip
    replies = await _exchange(port, head)
    assert [_status(r) for r in replies] == [413], replies
    assert b"1000000000000 bytes is over the" in replies[0]
    assert not [a for a in stub.arrivals if a.path.endswith("/infer")]


async def test_100_continue_waits_for_the_reply_ahead_of_it(
    router_port: tuple[int, StubApp],
) -> None:
    port, stub = router_port
    stub.service_s = 0.3  # the first request is still being answered when the second asks
    waiting = INFER.replace(b"\r\ncontent-length", b"\r\nexpect: 100-continue\r\ncontent-length")
    replies = await _exchange(
        port, INFER + b"\r\n" + BODY + waiting + b"connection: close\r\n\r\n", then=BODY
    )
    # The first reply whole, then the interim one, then the second reply.
    assert [_status(r) for r in replies] == [200, 100, 200], replies


async def test_a_head_too_long_or_too_slow_is_refused_and_idle_clients_are_let_go() -> None:
    stub = StubApp()
    with run_stub(stub) as backend:
        async with running_router(
            [backend.url], hedge=False, keep_alive_s=0.5, read_timeout_s=0.5
        ) as router:
            # A header that never ends: 431 before it does.
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            writer.write(b"GET /v2/models/m HTTP/1.1\r\nhost: r\r\nx-big: ")
            for _ in range(8):
                writer.write(b"v" * MAX_HEAD_BYTES)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert _status(head) == 431
            for _ in range(4):  # still sending after the reply: it still gets all of it
                writer.write(b"v" * MAX_HEAD_BYTES)
                await writer.drain()
            assert b"request head over" in await asyncio.wait_for(reader.read(), 5)
            writer.close()
            # A head that trickles in, a byte a tick: 408 once it is late, then closed.
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            slow = b"GET /v2/models/m HTTP/1.1\r\nhost: r\r\nx-slow: " + b"v" * 1000
            reply = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
            sent = 0
            while not reply.done() and sent < len(slow):
                writer.write(slow[sent : sent + 1])
                sent += 1
                await asyncio.wait([reply], timeout=0.02)
            assert reply.done() and sent < len(slow)
            assert _status(reply.result()) == 408
            assert b"not received within 0.5 s" in await asyncio.wait_for(reader.read(), 5)
            writer.close()
            # A kept-alive client that goes quiet after its reply is let go (without the
            # sweep, _exchange would wait for the close in vain and time out).
            replies = await _exchange(router.port, INFER + b"\r\n" + BODY)
            assert [_status(r) for r in replies] == [200]  # then closed: _exchange read EOF


async def test_an_http_1_0_client_is_told_when_it_is_kept_alive(
    router_port: tuple[int, StubApp],
) -> None:
    port, _ = router_port
    request = b"POST /v2/models/m/infer HTTP/1.0\r\ncontent-length: %d\r\n" % len(BODY)
    kept = request + b"connection: keep-alive\r\n\r\n" + BODY
    replies = await _exchange(port, kept + kept + request + b"\r\n" + BODY)
    assert [_status(r) for r in replies] == [200, 200, 200], replies
    heads = [reply.split(b"\r\n\r\n", 1)[0].lower() for reply in replies]
    assert [b"connection: keep-alive" in head for head in heads] == [True, True, False]
    assert b"connection: close" in heads[2]  # and then closed (_exchange read to the end)


async def test_many_pipelined_requests_in_large_reads_are_all_answered(
    router_port: tuple[int, StubApp],
) -> None:
    port, _ = router_port
    count = 10_000
    live = b"GET /v2/health/live HTTP/1.1\r\nhost: r\r\n\r\n"
    replies = await _exchange(
        port, live * (count - 1) + live.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    )
    assert len(replies) == count and all(_status(reply) == 200 for reply in replies)


async def test_a_long_target_is_414_and_a_client_held_back_is_not_late() -> None:
    stub = StubApp()
    with run_stub(stub) as backend:
        async with running_router([backend.url], hedge=False) as router:
            replies = await _exchange(
                router.port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nhost: r\r\n\r\n"
            )
            assert [_status(r) for r in replies] == [414]
            # A body the router holds back (its 100 Continue owed while the request ahead is
            # answered) is not late however long that takes; its time runs from when it is
            # let in. (The sweep is called by hand, with a clock an hour ahead.)
            stub.service_s = 0.5
            waiting = INFER.replace(
                b"\r\ncontent-length", b"\r\nexpect: 100-continue\r\ncontent-length"
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            writer.write(INFER + b"\r\n" + BODY + waiting + b"\r\n")
            (connection,) = await _reading(router)
            connection.sweep(router.loop.time() + 3600, 75.0, 10.0)
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert _status(first) == 200
            await reader.readexactly(
                int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            )
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert _status(interim) == 100
            connection.sweep(router.loop.time() + 5, 75.0, 10.0)  # 5 s after: in time
            writer.write(BODY)
            second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert _status(second) == 200
            connection.sweep(router.loop.time() + 3600, 75.0, 10.0)  # idle an hour: let go
            await reader.readexactly(
                int(second.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            )
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()


async def _reading(router: Any) -> list[Any]:
    """The router's connections, once one is reading a request."""
    for _ in range(500):
        reading = [c for c in router._connections if c.in_message]
        if reading:
            return reading
        await asyncio.sleep(0.01)
    raise AssertionError("no connection began reading a request")


async def test_a_closed_client_connection_lets_go_of_its_parser() -> None:
    # The parser holds the protocol's bound methods: kept, every closed connection would be
    # a cycle for a full collection to find. (Its request's exchange is another, left alone.)
    with run_stub(StubApp()) as backend:
        async with running_router([backend.url], hedge=False) as router:
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            writer.write(INFER + b"\r\n" + BODY)
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            (connection,) = router._connections
            assert connection._parser is not None
            writer.close()
            await writer.wait_closed()
            for _ in range(500):
                if connection.closed:
                    break
                await asyncio.sleep(0.01)
            assert connection.closed
            assert connection._parser is None
