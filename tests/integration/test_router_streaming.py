"""Large bodies stream through the router, both ways, with back-pressure: a backend sees a
large request's body before the client has sent all of it, a client gets a large reply's first
bytes while the backend is still writing the rest, a slow reader (either side) holds the
writer back instead of filling the router's memory, and a client that leaves mid-reply
withdraws the request from the backend. Against a real worker, streamed requests and replies
(by length and chunked) give the same answers as buffered ones."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx
import numpy as np
import orjson
import pytest

from support.models import doubler_config, write_model
from support.routing import running_router
from support.servers import WorkerProcess, async_wait_for, free_port, worker_process
from support.stub import RunningStub, StubApp, run_stub
from tailserve.router.config import RouterConfig
from tailserve.router.dispatch import ANY, Dispatcher, Outcome
from tailserve.router.proxy import Router

MIB = 1 << 20
PATTERN = bytes(range(256)) * 4096  # 1 MiB


def _pattern(size: int) -> bytes:
    return (PATTERN * (size // len(PATTERN) + 1))[:size]


@dataclass
class StreamingApp(StubApp):
    """``POST /v2/models/m/infer`` reads the body as it comes (counting it in ``received``)
    and answers its length and digest; with ``hold_reading`` set it reads nothing until
    ``read_gate`` opens. ``GET /download?size=N[&length=1][&pause=1][&wait=disconnect]``
    writes N bytes in 1 MiB pieces (or two halves with ``pause``, the second once ``release``
    is set), counting them in ``sent``."""

    hold_reading: bool = False
    read_gate: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)
    received: int = 0
    sent: int = 0
    seen_headers: dict[str, str] = field(default_factory=dict)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v2/models/m/infer":
            await self._upload(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == "/refuse":  # without reading
            body = b'{"error": "refused from the headers"}'
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
        elif scope["type"] == "http" and scope["path"] == "/download":
            await self._download(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def _upload(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen_headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if self.hold_reading:
            await asyncio.to_thread(self.read_gate.wait, 30)
        digest = hashlib.sha256()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            chunk = message.get("body", b"")
            digest.update(chunk)
            self.received += len(chunk)
            if not message.get("more_body"):
                break
        body = orjson.dumps({"bytes": self.received, "sha256": digest.hexdigest()})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def _download(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        size = int(query["size"])
        data = _pattern(size)
        headers = [(b"content-type", b"application/octet-stream")]
        if query.get("length"):
            headers.append((b"content-length", str(size).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if query.get("pause"):
            pieces = [data[: size // 2], data[size // 2 :]]
        else:
            pieces = [data[i : i + MIB] for i in range(0, size, MIB)]
        for i, piece in enumerate(pieces):
            if i == 1 and query.get("pause"):
                if query.get("wait") == "disconnect":
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    self.disconnected.set()
                    return
                await asyncio.to_thread(self.release.wait, 30)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            self.sent += len(piece)
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def stub() -> Iterator[RunningStub]:
    with run_stub(StreamingApp()) as running:
        yield running


def _app(stub: RunningStub) -> StreamingApp:
    assert isinstance(stub.app, StreamingApp)
    return stub.app


def _router(backends: list[str], **changes: Any) -> contextlib.AbstractAsyncContextManager[Router]:
    options: dict[str, Any] = {"hedge": False, "stream_body_bytes": 64 * 1024, **changes}
    return running_router(backends, **options)


async def _until(predicate: Any, what: str, timeout_s: float = 10.0) -> None:
    async def check() -> bool:
        return bool(predicate())

    await async_wait_for(check, timeout_s=timeout_s, what=what)


async def _head(reader: asyncio.StreamReader) -> dict[bytes, bytes]:
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status, *lines = raw.rstrip(b"\r\n").split(b"\r\n")
    headers = {b":status": status.split(b" ")[1]}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return headers


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await asyncio.wait_for(reader.readexactly(size), 10)
        await reader.readexactly(2)


async def test_a_large_request_body_reaches_the_backend_before_it_has_all_arrived(
    stub: RunningStub,
) -> None:
    app = _app(stub)
    body = _pattern(MIB)
    async with _router([stub.url]) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n"
                     b"x-deadline-ms: 9000\r\n\r\n" % len(body))  # fmt: skip
        writer.write(body[: 256 * 1024])
        # A router that read bodies whole would send nothing on yet.
        await _until(lambda: app.received > 0, what="the body's first bytes at the backend")
        assert app.received <= 256 * 1024
        writer.write(body[256 * 1024 :])
        head = await _head(reader)
        assert head[b":status"] == b"200" and head[b"x-tailserve-replica"] == stub.url.encode()
        reply = orjson.loads(await reader.readexactly(int(head[b"content-length"])))
        assert reply == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        assert app.seen_headers["content-length"] == str(len(body))
        assert 8000 < float(app.seen_headers["x-deadline-ms"]) <= 9000
        # The connection stays in step for the next request.
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nhost: r\r\n\r\n")
        assert (await _head(reader))[b":status"] == b"200"
        writer.close()
        await _until(lambda: router._in_flight == 0, what="nothing left in flight")


async def test_a_reply_before_the_whole_body_closes_the_connection_after_it(
    stub: RunningStub,
) -> None:
    app = _app(stub)
    async with _router([stub.url]) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"POST /refuse HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % (8 * MIB))
        writer.write(_pattern(256 * 1024))
        head = await _head(reader)
        assert head[b":status"] == b"429" and head[b"connection"] == b"close"
        body = await reader.readexactly(int(head[b"content-length"]))
        assert b"refused" in body
        # The rest of the body is not read: the router closes the connection.
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        await _until(lambda: router._in_flight == 0, what="nothing left in flight")
        # The backend connection that carried half a body is not reused: the next request
        # on a new connection is answered whole.
        upload = _pattern(2 * MIB)
        async with httpx.AsyncClient() as client:
            reply = await client.post(f"{router.url}/v2/models/m/infer", content=upload)
        assert reply.json()["sha256"] == hashlib.sha256(upload).hexdigest()
        assert app.received == len(upload)


async def test_a_chunked_body_streams_once_it_grows_past_the_threshold(stub: RunningStub) -> None:
    app = _app(stub)
    pieces = [_pattern(48 * 1024), _pattern(48 * 1024), _pattern(300 * 1024)]
    async with _router([stub.url]) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        for piece in pieces[:2]:  # 96 KiB: past the 64 KiB threshold
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
        await _until(lambda: app.received > 0, what="the body's first bytes at the backend")
        assert app.seen_headers["transfer-encoding"] == "chunked"
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(pieces[2]), pieces[2]))
        head = await _head(reader)
        reply = orjson.loads(await reader.readexactly(int(head[b"content-length"])))
        whole = b"".join(pieces)
        assert reply == {"bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}
        writer.close()


async def test_a_small_chunked_body_is_still_read_whole(stub: RunningStub) -> None:
    app = _app(stub)
    async with _router([stub.url]) as router, httpx.AsyncClient() as client:

        async def parts() -> AsyncIterator[bytes]:
            yield b"a" * 1000
            yield b"b" * 1000

        reply = await client.post(f"{router.url}/v2/models/m/infer", content=parts())
        assert reply.json()["bytes"] == 2000
        # Forwarded with its length, as a whole body is.
        assert app.seen_headers["content-length"] == "2000"


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
async def test_a_large_reply_reaches_the_client_while_the_backend_still_writes(
    stub: RunningStub, length: bool
) -> None:
    app = _app(stub)
    size = 512 * 1024
    async with _router([stub.url]) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        query = b"size=%d&pause=1%s" % (size, b"&length=1" if length else b"")
        writer.write(b"GET /download?" + query + b" HTTP/1.1\r\nhost: r\r\n\r\n")
        head = await _head(reader)
        assert head[b":status"] == b"200" and head[b"x-tailserve-replica"] == stub.url.encode()
        if length:
            assert head[b"content-length"] == str(size).encode()
            # The first half arrives while the backend holds the second.
            first = await asyncio.wait_for(reader.readexactly(size // 2), 10)
            assert not app.release.is_set()
            app.release.set()
            body = first + await asyncio.wait_for(reader.readexactly(size - size // 2), 10)
        else:
            assert head[b"transfer-encoding"] == b"chunked"
            first_size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)), 16)
            first = await asyncio.wait_for(reader.readexactly(first_size), 10)
            await reader.readexactly(2)
            assert not app.release.is_set()
            app.release.set()
            body = first + await _chunked(reader)
        assert body == _pattern(size)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nhost: r\r\n\r\n")
        assert (await _head(reader))[b":status"] == b"200"
        writer.close()
        metrics = (await httpx.AsyncClient().get(f"{router.url}/metrics")).text
        assert 'tailserve_router_requests_total{model="_other",status="200"}' in metrics


async def test_a_slow_reader_holds_a_large_reply_back(stub: RunningStub) -> None:
    app = _app(stub)
    size = 96 * MIB
    async with _router([stub.url], max_body_bytes=256 * MIB) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port, limit=MIB)
        writer.write(b"GET /download?size=%d HTTP/1.1\r\nhost: r\r\n\r\n" % size)
        await _head(reader)
        # The client reads nothing more: the backend must stall well short of the end
        # (socket buffers hold some megabytes; a router reading on regardless holds it all).
        with pytest.raises(AssertionError):
            await _until(lambda: app.sent >= size, what="the whole reply sent", timeout_s=1.5)
        assert app.sent < size // 2
        body = await _chunked(reader)
        assert len(body) == size and body[:MIB] == PATTERN
        writer.close()


async def test_a_slow_backend_holds_a_large_upload_back(stub: RunningStub) -> None:
    app = _app(stub)
    app.hold_reading = True
    body = _pattern(96 * MIB)
    async with _router([stub.url], max_body_bytes=256 * MIB) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n"
                     b"\r\n" % len(body))  # fmt: skip
        writer.write(body)
        # The backend reads nothing: the router must stop reading the client too.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.drain(), 1.5)
        app.read_gate.set()
        await asyncio.wait_for(writer.drain(), 30)
        head = await _head(reader)
        reply = orjson.loads(await reader.readexactly(int(head[b"content-length"])))
        assert reply == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        writer.close()


async def test_a_client_leaving_mid_reply_withdraws_it_from_the_backend(
    stub: RunningStub,
) -> None:
    app = _app(stub)
    async with _router([stub.url]) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"GET /download?size=%d&pause=1&wait=disconnect HTTP/1.1\r\n"
                     b"host: r\r\n\r\n" % MIB)  # fmt: skip
        await _head(reader)
        await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)  # the first chunk's size
        writer.close()
        await _until(app.disconnected.is_set, what="the backend to see the router go")
        await _until(lambda: router._in_flight == 0, what="nothing left in flight")
        assert router.dispatcher.backends[0].in_flight == 0


async def test_an_upload_over_the_limit_is_refused_by_its_declared_length(
    stub: RunningStub,
) -> None:
    async with _router([stub.url], max_body_bytes=MIB) as router, httpx.AsyncClient() as client:
        reply = await client.post(f"{router.url}/v2/models/m/infer", content=b"x" * (2 * MIB))
        assert reply.status_code == 413 and f"{MIB}-byte limit" in reply.json()["error"]
        # A chunked one that goes over mid-way is dropped, and the router keeps serving.

        async def parts() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"y" * MIB

        with pytest.raises(httpx.HTTPError):
            await client.post(f"{router.url}/v2/models/m/infer", content=parts())
        assert (await client.get(f"{router.url}/v2/health/ready")).status_code == 200
        await _until(lambda: router._in_flight == 0, what="nothing left in flight")


# --- a real worker ----------------------------------------------------------------------------

WIDTH = 8192


@pytest.fixture(scope="module")
def wide_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    tmp = tmp_path_factory.mktemp("router-streaming")
    tensor = {"datatype": "FP32", "shape": [WIDTH]}
    config = doubler_config(
        max_batch_size=4,
        inputs=[{"name": "x", **tensor}],
        outputs=[{"name": "y", **tensor}],
        warmup={"batch_sizes": [1]},
    )
    write_model(tmp / "repo", "m", config)
    with worker_process(tmp / "repo", tmp) as worker:
        yield worker


def _wide_body(seed: int) -> tuple[bytes, np.ndarray]:
    x = np.random.default_rng(seed).random((1, WIDTH), dtype=np.float32)
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, WIDTH],
                                     "data": x.ravel().tolist()}]})  # fmt: skip
    return body, x


async def test_streamed_requests_and_replies_match_buffered_ones_on_a_worker(
    wide_worker: WorkerProcess,
) -> None:
    body, x = _wide_body(0)
    assert len(body) > 64 * 1024
    async with (
        _router([wide_worker.url]) as streaming,
        _router([wide_worker.url], stream_body_bytes=64 * MIB) as buffered,
        httpx.AsyncClient(timeout=30) as client,
    ):
        url = "/v2/models/m/infer"
        whole = await client.post(buffered.url + url, content=body)
        by_length = await client.post(streaming.url + url, content=body)

        async def parts() -> AsyncIterator[bytes]:
            for i in range(0, len(body), 50_000):
                yield body[i : i + 50_000]

        chunked = await client.post(streaming.url + url, content=parts())
        for reply in (whole, by_length, chunked):
            assert reply.status_code == 200, reply.text
            y = np.asarray(reply.json()["outputs"][0]["data"], dtype=np.float32)
            np.testing.assert_array_equal(y, (x * 2 + 1).ravel())  # the doubler: 2x + version
        assert "content-length" in whole.headers
        # The worker's reply (over 64 KiB) came through the streaming router as it was read.
        assert len(by_length.content) > 64 * 1024
        assert by_length.headers["x-tailserve-replica"] == wide_worker.url
        # A bad streamed request gets the worker's own 400, and the router keeps serving.
        bad = await client.post(streaming.url + url, content=b"{" + b" " * 100_000)
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]
        again = await client.post(streaming.url + url, content=body)
        assert again.status_code == 200


async def test_a_streamed_request_whose_connect_failed_is_retried_with_its_body(
    stub: RunningStub,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    dispatcher = Dispatcher(RouterConfig(balance="round-robin", hedge=False))
    dispatcher.set_members([dead, stub.url], healthy=True)
    body = _pattern(3 * MIB)
    head = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
    done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    exchange = dispatcher.dispatch(
        model=ANY, frame=lambda _: head, on_done=done.set_result, stream=True
    )
    # Written before any connection is up: it waits in the first attempt's ticket, and
    # past the high-water mark the writer is told to hold off.
    exchange.write(body[:MIB])
    exchange.write(body[MIB:])
    assert exchange.congested
    drained = asyncio.Event()
    exchange.on_drain(drained.set)
    await asyncio.wait_for(drained.wait(), 10)
    exchange.end()
    outcome = await asyncio.wait_for(done, 10)
    assert outcome.status == 200 and outcome.backend == stub.url
    assert [b.id for b in exchange.tried] == [dead, stub.url]
    assert orjson.loads(outcome.body)["sha256"] == hashlib.sha256(body).hexdigest()
    await dispatcher.close()


async def test_a_retry_skips_a_replica_that_left_since_the_request_began(
    stub: RunningStub,
) -> None:
    # The request's pool holds three replicas; its first goes to a dead one, and before the
    # retry the second leaves the membership: the retry goes to the third, not a 502.
    dead = f"http://127.0.0.1:{free_port()}"
    leaving = f"http://127.0.0.1:{free_port()}"
    dispatcher = Dispatcher(RouterConfig(balance="round-robin", hedge=False))
    dispatcher.set_members([dead, leaving, stub.url], healthy=True)
    head = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}"
    done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    exchange = dispatcher.dispatch(model="m", frame=lambda _: head, on_done=done.set_result,
                                   idempotent=True)  # fmt: skip
    assert [b.id for b in exchange.tried] == [dead]
    dispatcher.set_members([dead, stub.url], healthy=True)
    outcome = await asyncio.wait_for(done, 10)
    assert outcome.status == 200 and outcome.backend == stub.url
    assert [b.id for b in exchange.tried] == [dead, stub.url]
    await dispatcher.close()
