"""The HTTP/1.1 client pool against real servers on loopback."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from support.servers import async_wait_for, free_port
from support.stub import StubApp, run_stub
from tailserve.errors import ConnectFailed, UpstreamTimeout
from tailserve.transport.base import PoolState
from tailserve.transport.http1 import Pool, Response, Ticket, frame_request


def infer(port: int) -> bytes:
    return frame_request(
        "POST",
        "/v2/models/m/infer",
        f"127.0.0.1:{port}",
        b"{}",
        [("content-type", "application/json")],
    )


async def test_keep_alive_connections_are_reused_up_to_the_limit() -> None:
    with run_stub(StubApp(service_s=0.002)) as stub:
        pool = Pool("127.0.0.1", stub.port, max_connections=4)
        try:
            responses = await asyncio.gather(*(pool.request(infer(stub.port)) for _ in range(40)))
            assert all(r.status == 200 and b'"outputs"' in r.body for r in responses)
            assert pool.open_connections == 4
            assert responses[0].header(b"content-type") == b"application/json"
            # Sequential requests reuse what is open rather than opening more.
            for _ in range(10):
                await pool.request(infer(stub.port))
            assert pool.open_connections == 4
        finally:
            await pool.close()
    assert len(stub.app.arrivals) == 50


async def test_a_slow_reply_times_out_and_the_pool_recovers() -> None:
    with run_stub(StubApp(stall_after=1, stall_s=0.5)) as stub:
        pool = Pool("127.0.0.1", stub.port, max_connections=2)
        try:
            with pytest.raises(UpstreamTimeout):
                await pool.request(infer(stub.port), timeout_s=0.1)
            assert pool.open_connections == 0  # a timed-out connection is not reused
            # A new connection; the stub answers it when its stall ends (within the timeout).
            response = await pool.request(infer(stub.port), timeout_s=2.0)
            assert response.status == 200
        finally:
            await pool.close()


async def test_no_server_fails_each_request_with_a_connect_error() -> None:
    pool = Pool("127.0.0.1", free_port(), max_connections=2)
    results: list[Response | Exception] = []
    try:
        for _ in range(3):
            try:
                results.append(await pool.request(infer(1), timeout_s=2.0))
            except ConnectFailed as exc:
                results.append(exc)
    finally:
        await pool.close()
    assert all(isinstance(r, ConnectFailed) for r in results)
    assert "cannot connect to 127.0.0.1" in str(results[0])


async def test_a_request_waiting_for_a_connection_times_out_on_time() -> None:
    # The pool's one connection is held by a reply that stalls for 3 s: the next request
    # waits for it, and its 0.2 s must hold while it waits (it used to wait the 3 s out).
    with run_stub(StubApp(stall_after=1, stall_s=3.0)) as stub:
        pool = Pool("127.0.0.1", stub.port, max_connections=1)
        try:
            held = asyncio.ensure_future(pool.request(infer(stub.port), timeout_s=10.0))

            async def arrived() -> bool:
                return len(stub.app.arrivals) == 1

            await async_wait_for(arrived, what="the first request to hold the connection")
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(UpstreamTimeout, match="came free in time"):
                await pool.request(infer(stub.port), timeout_s=0.2)
            assert loop.time() - started < 2.0  # well before the held reply (the slack: stalls)
            assert pool.waiting == 0 and not held.done()
            held.cancel()
        finally:
            await pool.close()


async def test_a_connection_idle_past_the_limit_is_not_reused() -> None:
    # The server may close it at its keep-alive timeout just as a request goes out on it: a
    # connection idle longer than max_idle_s is closed and a fresh one opened instead.
    with run_stub(StubApp()) as stub:
        pool = Pool("127.0.0.1", stub.port, max_connections=2, max_idle_s=0.05)
        try:
            assert (await pool.request(infer(stub.port))).status == 200
            assert (await pool.request(infer(stub.port))).status == 200
            assert pool.state() == PoolState(open=1, idle=1, waiting=0, opened=1)  # reused
            await asyncio.sleep(0.1)  # idle past the limit (the time itself is under test)
            assert (await pool.request(infer(stub.port))).status == 200
            # The stale one closed, a fresh one opened.
            assert pool.state() == PoolState(open=1, idle=1, waiting=0, opened=2)
        finally:
            await pool.close()


async def test_a_ticket_that_waited_lets_go_of_its_deadline_timer_once_sent() -> None:
    # Left to run out, the timer held the ticket and its connection until the deadline:
    # tens of thousands at once in a generator past capacity, walked by every collection.
    with run_stub(StubApp(service_s=0.01)) as stub:
        pool = Pool("127.0.0.1", stub.port, max_connections=1)
        try:
            results: list[Response | Exception] = []
            tickets: list[Ticket] = [
                pool.submit(infer(stub.port), results.append, 30.0) for _ in range(3)
            ]
            assert all(t.expiry is not None for t in tickets)  # all wait: none is connected

            async def answered() -> bool:
                return len(results) == 3

            await async_wait_for(answered, what="three replies")
            assert all(isinstance(r, Response) and r.status == 200 for r in results)
            assert all(t.expiry is None for t in tickets)
        finally:
            await pool.close()


async def test_a_closed_connection_is_freed_at_once_not_by_a_full_collection() -> None:
    # Its parser held the protocol's bound methods: a cycle that kept every closed connection
    # (a hedge's loser closes one each time) until a full collection.
    with run_stub(StubApp()) as stub:
        pool = Pool("127.0.0.1", stub.port, max_connections=1)
        gc.collect()
        gc.disable()
        try:
            replies: list[Response | Exception] = []
            ticket = pool.submit(infer(stub.port), replies.append)

            async def answered() -> bool:
                return bool(replies)

            await async_wait_for(answered, what="the reply")
            connection = weakref.ref(ticket.connection)
            del ticket
            assert connection() is not None and pool.state().open == 1
            await pool.close()

            async def freed() -> bool:  # (with the collector off: by its reference count)
                return connection() is None

            await async_wait_for(freed, timeout_s=5, what="the closed connection freed")
        finally:
            gc.enable()
