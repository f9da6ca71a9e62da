"""The worker's HTTP/2 server (`transport.http2`) as a peer meets it over a real socket: an
HTTP/2 client (h2's, the same state machine on the other side) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
from hyperframe.frame import Frame, GoAwayFrame, HeadersFrame, RstStreamFrame

from support.http2_frames import parse
from tailserve.transport.http2 import Http2Server, Http2Stream

LIMIT = 256 * 1024
REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/echo"), (":authority", "test")]


class App:
    """Echoes a whole request's body (``/echo``), answers ``/big`` with ``size`` bytes, holds
    ``/hold`` until released, and converses on ``/talk``: each read's bytes sent back."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled: list[str] = []
        self.held = asyncio.Event()
        self.read_gate = asyncio.Event()
        self.read_gate.set()
        self.size = 0

    def converses(self, stream: Http2Stream) -> bool:
        return stream.path == "/talk"

    async def answer(self, stream: Http2Stream) -> None:
        if stream.too_large:
            await stream.send(413, [], b"too large: %d" % stream.size, None)
            return
        if stream.crowded:
            await stream.send(503, [], b"crowded past %d" % stream.held_limit, None)
            return
        if stream.path == "/big":
            body = bytes(range(256)) * (self.size // 256)
            await stream.send(200, [], body, [(b"x-done", b"1")])
            return
        if stream.path == "/hold":
            self.held.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(stream.path)
                raise
        await stream.send(200, [(b"x-path", stream.path.encode())], stream.body, None)

    async def converse(self, stream: Http2Stream) -> None:
        stream.send_headers(200, [])
        while True:
            await self.read_gate.wait()
            data = await stream.read()
            if data is None:
                break
            await stream.send_data(data)
        stream.send_trailers([(b"x-end", b"1")])


class Client:
    """An HTTP/2 client over a socket, keeping every event it receives."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
        self.reader, self.writer = reader, writer
        self.events: list[Any] = []
        self.closed = False
        self.buffer = b""
        self.away = False  # a GOAWAY came
        self.late: list[Any] = []  # the frames after it

    @classmethod
    async def to(cls, port: int) -> Client:
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        client.h2.initiate_connection()
        client.flush()
        return client

    def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())

    async def send(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        """Data in frames the server's window and frame size allow, waiting for room."""
        while data:
            room = min(
                self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size
            )
            if room <= 0:
                await self.pump()
                continue
            self.h2.send_data(stream_id, data[:room], end_stream=end and len(data) <= room)
            data = data[room:]
            self.flush()

    def request(self, path: str, body: bytes = b"", *, end: bool = True) -> int:
        stream_id: int = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "t")]
        self.h2.send_headers(stream_id, headers, end_stream=end and not body)
        if body:  # (a small one: within the first frame)
            self.h2.send_data(stream_id, body, end_stream=end)
        self.flush()
        return stream_id

    async def pump(self, acknowledge: bool = True) -> None:
        """Read what comes next (one read), acknowledging data as an eager client does.
        Frames after a GOAWAY are kept raw in ``late`` (h2 takes nothing after one)."""
        data = await self.reader.read(65536)
        if not data:
            self.closed = True
            return
        self.buffer += data
        while len(self.buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self.buffer[:9]))
            if len(self.buffer) < 9 + length:
                break
            whole, self.buffer = self.buffer[: 9 + length], self.buffer[9 + length :]
            if self.away:
                frame.parse_body(memoryview(whole[9:]))
                self.late.append(frame)
                continue
            for event in self.h2.receive_data(whole):
                self.events.append(event)
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.away = True
                if acknowledge and isinstance(event, h2.events.DataReceived):
                    length = event.flow_controlled_length
                    self.h2.acknowledge_received_data(length, event.stream_id)
            if not self.away:
                self.flush()

    async def until(self, done: Any, acknowledge: bool = True) -> None:
        async with asyncio.timeout(10):
            while not done():
                if self.closed:
                    raise AssertionError("the connection closed first")
                await self.pump(acknowledge)

    async def echo(self, body: bytes) -> bytes:
        """What ``/echo`` answers to ``body`` (of any size: sent as the window allows)."""
        stream = self.request("/echo", end=False)
        await self.send(stream, body, end=True)
        await self.until(lambda: self.ended(stream))
        return self.body(stream)

    def ended(self, stream_id: int) -> bool:
        return any(
            isinstance(e, h2.events.StreamEnded | h2.events.StreamReset)
            and e.stream_id == stream_id
            for e in self.events
        )

    def of(self, stream_id: int, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and e.stream_id == stream_id]

    def body(self, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.of(stream_id, h2.events.DataReceived))

    def close(self) -> None:
        self.writer.close()


@contextlib.asynccontextmanager
async def serving(**options: Any) -> AsyncIterator[tuple[Http2Server, App]]:
    """A server of an `App` on a free loopback port (the body limit LIMIT), closed after."""
    app = App()
    server = Http2Server(app, max_body_bytes=LIMIT, **options)
    await server.start("127.0.0.1", 0)
    try:
        yield server, app
    finally:
        server.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Http2Server, App]]:
    async with serving() as running:
        yield running


async def test_a_request_is_answered_with_headers_body_and_trailers(
    served: tuple[Http2Server, App],
) -> None:
    server, app = served
    client = await Client.to(server.port)
    echo = client.request("/echo", b"hello")
    app.size = 300_000  # past the client's 64 KiB window: sent as it acknowledges
    big = client.request("/big")
    await client.until(lambda: client.ended(echo) and client.ended(big))
    (head,) = client.of(echo, h2.events.ResponseReceived)
    assert (b":status", b"200") in head.headers and (b"x-path", b"/echo") in head.headers
    assert client.body(echo) == b"hello"
    assert client.body(big) == bytes(range(256)) * (300_000 // 256)
    (trailers,) = client.of(big, h2.events.TrailersReceived)
    assert (b"x-done", b"1") in trailers.headers
    client.close()


async def test_a_body_over_the_limit_is_not_kept_and_the_application_answers(
    served: tuple[Http2Server, App],
) -> None:
    server, _ = served
    client = await Client.to(server.port)
    stream = client.request("/echo", end=False)
    # (the server acknowledges what it drops: the client can send it all)
    sent = LIMIT + 100_000
    await client.send(stream, b"x" * sent, end=True)
    await client.until(lambda: client.ended(stream))
    (head,) = client.of(stream, h2.events.ResponseReceived)
    assert (b":status", b"413") in head.headers
    assert client.body(stream) == b"too large: %d" % sent
    client.close()


async def test_a_connection_holds_a_bounded_sum_of_unanswered_bodies() -> None:
    async with serving(max_held_bytes=250_000) as (server, _):
        client = await Client.to(server.port)
        kept = []
        for fill in b"ab":
            kept.append(client.request("/echo", end=False))
            await client.send(kept[-1], bytes([fill]) * 100_000)
        # (frames on one connection come in order: the two above are held when this comes)
        crowded = client.request("/echo", end=False)
        await client.send(crowded, b"c" * 100_000, end=True)
        await client.until(lambda: client.ended(crowded))
        (head,) = client.of(crowded, h2.events.ResponseReceived)
        assert (b":status", b"503") in head.headers
        assert client.body(crowded) == b"crowded past 250000"
        for stream in kept:
            await client.send(stream, b"!", end=True)
        await client.until(lambda: all(client.ended(stream) for stream in kept))
        assert [client.body(stream) for stream in kept] == [
            b"a" * 100_000 + b"!",
            b"b" * 100_000 + b"!",
        ]
        # What an answered stream held, and a reset one, is no longer counted.
        assert await client.echo(b"d" * 200_000) == b"d" * 200_000
        dropped = client.request("/echo", end=False)
        await client.send(dropped, b"e" * 200_000)
        client.h2.reset_stream(dropped, h2.errors.ErrorCodes.CANCEL)
        client.flush()
        assert await client.echo(b"f" * 200_000) == b"f" * 200_000
        client.close()


async def test_what_a_conversing_task_has_not_read_holds_the_client_back(
    served: tuple[Http2Server, App],
) -> None:
    server, app = served
    client = await Client.to(server.port)
    app.read_gate.clear()  # the task reads nothing yet
    stream = client.request("/talk", b"", end=False)
    await client.until(lambda: bool(client.of(stream, h2.events.ResponseReceived)))
    window = client.h2.local_flow_control_window(stream)
    await client.send(stream, b"y" * window)
    # The server has it all, and has not acknowledged it: the client may send nothing more.
    for _ in range(3):
        await asyncio.sleep(0)
    assert client.h2.local_flow_control_window(stream) == 0
    app.read_gate.set()
    await client.until(lambda: len(client.body(stream)) == window)
    await client.until(lambda: client.h2.local_flow_control_window(stream) > 0)
    client.h2.send_data(stream, b"z", end_stream=True)
    client.flush()
    await client.until(lambda: client.ended(stream))
    assert client.body(stream) == b"y" * window + b"z"
    (trailers,) = client.of(stream, h2.events.TrailersReceived)
    assert (b"x-end", b"1") in trailers.headers
    client.close()


async def test_a_reset_stream_cancels_its_task(served: tuple[Http2Server, App]) -> None:
    server, app = served
    client = await Client.to(server.port)
    stream = client.request("/hold")
    await app.held.wait()
    assert server.streams == 1
    client.h2.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
    client.flush()
    async with asyncio.timeout(10):
        await server.wait_idle()
    assert app.cancelled == ["/hold"]
    assert await client.echo(b"still here") == b"still here"
    client.close()


async def test_a_peer_that_breaks_the_protocol_is_told_and_the_others_are_served(
    served: tuple[Http2Server, App],
) -> None:
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # no HTTP/2 preface
    async with asyncio.timeout(10):
        data = await reader.read()  # until the server closes
    (away,) = [frame for frame in parse(data) if isinstance(frame, GoAwayFrame)]
    assert away.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    writer.close()
    client = await Client.to(server.port)
    assert await client.echo(b"fine") == b"fine"
    client.close()


async def test_a_peer_resetting_each_stream_as_it_opens_it_is_cut_off(
    served: tuple[Http2Server, App],
) -> None:
    server, app = served
    client = await Client.to(server.port)
    await client.pump()  # (the server's SETTINGS)
    for _ in range(150):  # (past the wire's RESET_AT_ONCE, in one write)
        stream = client.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/hold"),
            (":authority", "t"),
        ]
        client.h2.send_headers(stream, headers, end_stream=True)
        client.h2.reset_stream(stream)
    client.flush()
    await client.until(lambda: client.away)
    (ended,) = [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert ended.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert not app.held.is_set()  # (no request it reset was begun)
    other = await Client.to(server.port)
    assert await other.echo(b"fine") == b"fine"
    other.close()
    client.close()


async def test_a_drain_answers_the_streams_begun_and_refuses_later_ones(
    served: tuple[Http2Server, App],
) -> None:
    server, app = served
    port = server.port
    client = await Client.to(port)
    held = client.request("/hold")
    await app.held.wait()
    draining = asyncio.create_task(server.drain(10.0))
    await client.until(lambda: client.away)
    (away,) = [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert away.last_stream_id == held and away.error_code == 0
    # Opened as if the GOAWAY had not arrived yet: refused, so the client may retry it.
    late = held + 2
    client.writer.write(
        HeadersFrame(late, client.h2.encoder.encode(REQUEST), flags=["END_HEADERS"]).serialize()
    )
    app.release.set()
    await client.until(lambda: client.closed)
    kinds = {(type(frame), frame.stream_id) for frame in client.late}
    assert (RstStreamFrame, late) in kinds
    (refused,) = [f for f in client.late if isinstance(f, RstStreamFrame)]
    assert refused.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
    (answer,) = [f for f in client.late if isinstance(f, HeadersFrame)]
    assert answer.stream_id == held and "END_STREAM" in answer.flags
    assert (b":status", b"200") in client.h2.decoder.decode(answer.data, raw=True)
    async with asyncio.timeout(10):
        await draining
    assert server.streams == 0
    with pytest.raises(OSError):  # (no longer listening)
        await Client.to(port)


async def test_a_request_that_stops_coming_is_reset_and_the_connection_serves_on() -> None:
    async with serving(read_timeout_s=0.2) as (server, _):
        client = await Client.to(server.port)
        stalled = client.request("/echo", b"half of it", end=False)
        await client.until(lambda: client.ended(stalled))
        (reset,) = client.of(stalled, h2.events.StreamReset)
        assert reset.error_code == h2.errors.ErrorCodes.CANCEL
        assert await client.echo(b"whole") == b"whole"
        client.close()


async def test_a_server_without_connections_sleeps() -> None:
    async with serving(read_timeout_s=0.2) as (server, _):
        assert server._sweeper is None  # (no timer while nobody is connected)
        client = await Client.to(server.port)
        assert await client.echo(b"awake") == b"awake"
        assert server._sweeper is not None
        client.close()
        await asyncio.wait_for(server._gone.wait(), 5)
        if server._sweeper is not None:  # (the sweep after the last one, run now)
            server._sweeper.cancel()
        server._sweep()
        assert server._sweeper is None


async def test_a_peer_that_does_not_read_is_read_no_further_and_loses_nothing(
    served: tuple[Http2Server, App],
) -> None:
    """PING after PING, the answers left unread: once what the server has to send is past its
    transport's high-water mark it stops reading the connection, so the peer cannot grow its
    memory; as the peer reads, it reads on, and every PING is answered in turn."""
    server, _ = served
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (the answers back up soon)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    client = Client(*await asyncio.open_connection(sock=sock))
    client.h2.initiate_connection()
    client.flush()
    await client.pump()  # (the server's SETTINGS: it has the connection)
    (connection,) = server._connections
    transport = connection._transport
    assert transport is not None
    paused = asyncio.Event()
    pause_writing = connection.pause_writing

    def pausing() -> None:
        pause_writing()
        paused.set()

    connection.pause_writing = pausing  # type: ignore[method-assign]
    count = 8 * 2**20 // 17  # 8 MiB of PINGs: past any socket buffer between the two
    client.writer.write(b"".join(_ping(n, ack=False) for n in range(count)))
    await asyncio.wait_for(paused.wait(), 15)
    assert not transport.is_reading()
    assert transport.get_write_buffer_size() < 2**20

    expected = b"".join(_ping(n, ack=True) for n in range(count))
    received = bytearray()
    async with asyncio.timeout(60):
        while not received.endswith(expected[-17:]):
            data = await client.reader.read(2**20)
            assert data, "the server closed the connection"
            received += data
    assert received[received.index(expected[:17]) :] == expected
    client.close()


def _ping(number: int, *, ack: bool) -> bytes:
    """A PING frame (its acknowledgement with ``ack``) of payload ``number``."""
    return b"\x00\x00\x08\x06" + (b"\x01" if ack else b"\x00") + bytes(4) + number.to_bytes(8)
