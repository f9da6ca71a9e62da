"""The router as an application of the one HTTP server, on raw connections: pipelined requests
(sent on, and answered by the router itself) answered in order, a malformed one after those
before it, nothing written after a reply that closed the connection; hop-by-hop headers not
forwarded either way; a body or a target over the limit refused before it reaches a backend; a
chunked body read whole and sent on with its length; the router's keep-alive time; a client
that hangs up withdrawing its request from the backend; a drain. The server's own framing (408,
431, upgrades, reading paused) is tested once, in test_worker_server.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from support.routing import running_router
from support.servers import async_wait_for, free_port
from support.stub import Arrival, StubApp, run_stub
from tailserve.router.config import RouterConfig
from tailserve.router.dispatch import Dispatcher
from tailserve.router.messages import Outcome

MIB = 1 << 20
BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}]})
INFER = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n" % len(BODY)
LIVE = b"GET /v2/health/live HTTP/1.1\r\nhost: r\r\n\r\n"


@dataclass
class WaitingApp(StubApp):
    """``GET /wait`` answers nothing: it waits for its client to go, then sets ``gone``."""

    gone: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/wait":
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone.set()
            return
        await super().__call__(scope, receive, send)


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


def _infers(stub: StubApp) -> list[Arrival]:
    """What reached the backend apart from the router's own checks (the model index)."""
    return [a for a in stub.arrivals if a.path.endswith("/infer")]


def _head_lines(reply: bytes) -> list[bytes]:
    return reply.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")[1:]


async def test_pipelined_requests_sent_on_and_answered_here_keep_their_order(
    router_port: tuple[int, StubApp],
) -> None:
    port, stub = router_port
    stub.service_s = 0.1  # each one sent on is answered after the router's own would be
    data = (INFER + b"\r\n" + BODY + LIVE) * 3 + LIVE.replace(
        b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n"
    )
    replies = await _exchange(port, data)
    assert [_status(r) for r in replies] == [200] * 7, replies
    named = [
        any(line.startswith(b"x-tailserve-replica:") for line in _head_lines(r)) for r in replies
    ]
    assert named == [True, False] * 3 + [False]


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
    # Sent on and answered by the router itself alike: one reply, then the connection ends.
    for first in (
        INFER + b"connection: close\r\n\r\n" + BODY,
        b"GET /v2/health/live HTTP/1.1\r\nconnection: close\r\n\r\n",
    ):
        replies = await _exchange(port, first + LIVE)
        assert [_status(r) for r in replies] == [200], replies
        assert b"connection: close" in replies[0]


async def test_hop_by_hop_headers_stay_on_their_side_of_the_router(
    router_port: tuple[int, StubApp],
) -> None:
    port, stub = router_port
    request = (
        b"POST /v2/models/m/infer?x=1 HTTP/1.1\r\nhost: r\r\nconnection: keep-alive\r\n"
        b"keep-alive: timeout=5\r\nte: trailers\r\nx-request-id: abc\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)
    )
    closing = LIVE.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    replies = await _exchange(port, request + closing)
    assert [_status(r) for r in replies] == [200, 200], replies
    (arrival,) = _infers(stub)
    assert arrival.body == BODY and arrival.headers["content-length"] == str(len(BODY))
    assert arrival.headers["x-request-id"] == "abc" and arrival.headers["host"] == "r"
    assert not {"connection", "keep-alive", "te", "transfer-encoding"} & set(arrival.headers)
    # The backend's own framing and identity (uvicorn's date, server, content-length) give
    # way to the router's.
    names = [line.split(b":", 1)[0] for line in _head_lines(replies[0])]
    assert names.count(b"content-length") == 1 and names.count(b"date") == 1
    assert b"server" not in names and b"connection" not in names


async def test_a_body_over_the_limit_by_its_declared_length_is_refused_before_it_is_sent(
    router_port: tuple[int, StubApp],
) -> None:
    port, stub = router_port
    head = (
        b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: 1000000000000\r\n"
        b"expect: 100-continue\r\n\r\n"
    )
    replies = await _exchange(port, head)
    assert [_status(r) for r in replies] == [413], replies
    assert b"1000000000000 bytes is over the" in replies[0]
    assert not _infers(stub)


async def test_a_target_over_the_limit_is_414_and_reaches_no_backend(
    router_port: tuple[int, StubApp],
) -> None:
    port, stub = router_port
    replies = await _exchange(port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nhost: r\r\n\r\n")
    assert [_status(r) for r in replies] == [414], replies
    assert b"request target over" in replies[0]
    assert not [a for a in stub.arrivals if a.path.startswith("/aaa")]


async def test_bodies_are_read_whole_and_none_over_the_limit_reaches_a_backend() -> None:
    stub = StubApp()
    with run_stub(stub) as backend:
        async with (
            running_router([backend.url], hedge=False, max_body_bytes=MIB) as router,
            httpx.AsyncClient() as client,
        ):
            url = f"{router.url}/v2/models/m/infer"

            async def parts(piece: bytes, count: int) -> AsyncIterator[bytes]:
                for _ in range(count):
                    yield piece

            # A chunked body goes on whole, with its length.
            reply = await client.post(url, content=parts(b"a" * 1000, 2))
            assert reply.status_code == 200
            (arrival,) = _infers(stub)
            assert arrival.body == b"a" * 2000 and arrival.headers["content-length"] == "2000"
            reply = await client.post(url, content=b"x" * (2 * MIB))
            assert reply.status_code == 413 and f"{MIB}-byte limit" in reply.json()["error"]
            # One that grows past the limit is refused too (the client may see the reply or
            # only the connection closing while it still sends).
            try:
                reply = await client.post(url, content=parts(b"y" * MIB, 3))
                assert reply.status_code == 413
            except httpx.HTTPError:
                pass
            assert len(_infers(stub)) == 1
            assert (await client.get(f"{router.url}/v2/health/ready")).status_code == 200


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


async def test_an_idle_client_is_let_go_after_the_routers_keep_alive_time() -> None:
    with run_stub(StubApp()) as backend:
        async with running_router([backend.url], hedge=False, keep_alive_s=0.5) as router:
            # Without the sweep, _exchange would wait for the close in vain and time out.
            replies = await _exchange(router.port, INFER + b"\r\n" + BODY)
            assert [_status(r) for r in replies] == [200]


async def test_a_client_that_hangs_up_withdraws_its_request_from_the_backend() -> None:
    app = WaitingApp()
    with run_stub(app) as backend:
        async with running_router([backend.url], hedge=False) as router:
            _, writer = await asyncio.open_connection("127.0.0.1", router.port)
            writer.write(b"GET /wait HTTP/1.1\r\nhost: r\r\n\r\n")
            (upstream,) = router.dispatcher.backends

            async def in_flight(count: int) -> bool:
                return upstream.in_flight == count

            await async_wait_for(lambda: in_flight(1), what="the request at the backend")
            writer.close()
            await asyncio.to_thread(app.gone.wait, 10)
            assert app.gone.is_set()
            await async_wait_for(lambda: in_flight(0), what="nothing left in flight")
            metrics = router.metrics.render().decode()
            assert 'tailserve_router_requests_total{model="_other",status="499"}' in metrics


async def test_a_drain_lets_the_request_in_flight_finish_then_stops_listening() -> None:
    with run_stub(StubApp(service_s=0.3)) as backend:
        async with (
            running_router([backend.url], hedge=False) as router,
            httpx.AsyncClient() as client,
        ):
            url = router.url
            reply = asyncio.ensure_future(client.post(f"{url}/v2/models/m/infer", content=BODY))
            (upstream,) = router.dispatcher.backends

            async def in_flight() -> bool:
                return upstream.in_flight == 1

            await async_wait_for(in_flight, what="the request at the backend")
            await router.drain(timeout_s=10)
            assert not router.ready()
            answered = await reply
            assert answered.status_code == 200 and answered.headers["connection"] == "close"
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{url}/v2/health/live")


async def test_a_retry_skips_a_replica_that_left_since_the_request_began() -> None:
    # The request's pool holds three replicas; its first goes to a dead one, and before the
    # retry the second leaves the membership: the retry goes to the third, not a 502.
    with run_stub(StubApp()) as stub:
        dead = f"http://127.0.0.1:{free_port()}"
        leaving = f"http://127.0.0.1:{free_port()}"
        dispatcher = Dispatcher(RouterConfig(balance="round-robin", hedge=False))
        dispatcher.set_members([dead, leaving, stub.url], healthy=True)
        head = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}"
        done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        exchange = dispatcher.dispatch(
            model="m", frame=lambda _: head, on_done=done.set_result, idempotent=True
        )
        assert [b.id for b in exchange.tried] == [dead]
        dispatcher.set_members([dead, stub.url], healthy=True)
        outcome = await asyncio.wait_for(done, 10)
        assert outcome.status == 200 and outcome.backend == stub.url
        assert [b.id for b in exchange.tried] == [dead, stub.url]
        await dispatcher.close()
