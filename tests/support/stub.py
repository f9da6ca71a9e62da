"""A stub inference server on loopback for testing the load generator.

It answers ``POST .../infer`` with a fixed body and ``GET .../config`` with a one-input model
configuration, records when each request arrived, and can misbehave on purpose:

- ``stall_after=N, stall_s=S``: the N-th request opens a window of S seconds in which every
  request (that one included) is held until the window closes: a server pause.
- ``service_s=S``: requests are served one at a time, S seconds each: a known capacity of 1/S.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn

from support.servers import wait_for
from tailserve.process.loops import run

CONFIG = {
    "name": "m",
    "max_batch_size": 8,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "range": [0.0, 1.0]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
}
OUTPUT = {"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}
REPLY = orjson.dumps({"model_name": "m", "outputs": [OUTPUT]})


@dataclass
class Arrival:
    at: float  # time.monotonic()
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class StubApp:
    stall_after: int | None = None
    stall_s: float = 0.0
    service_s: float = 0.0
    # The status of every answer (500: a failing server).
    status: int = 200
    arrivals: list[Arrival] = field(default_factory=list)
    _stall_until: float = 0.0
    _lock: asyncio.Lock | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        now = time.monotonic()
        path = scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if path.endswith("/config"):
            await _reply(send, orjson.dumps(CONFIG))
            return
        if path.startswith("/v2/health/"):  # ready whatever it answers to requests
            await _reply(send, b"{}")
            return
        self.arrivals.append(Arrival(now, path, b"".join(chunks), headers))
        if self.stall_after is not None and len(self.arrivals) == self.stall_after:
            self._stall_until = now + self.stall_s
        if now < self._stall_until:
            await asyncio.sleep(self._stall_until - now)
        if self.service_s:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                await asyncio.sleep(self.service_s)
        await _reply(send, REPLY, self.status)


async def _reply(send: Any, body: bytes, status: int = 200) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass
class RunningStub:
    app: StubApp
    url: str
    port: int


@contextlib.contextmanager
def run_stub(app: StubApp) -> Iterator[RunningStub]:
    """The stub on a free loopback port, in a thread with its own event loop."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        http="httptools",
        loop="none",
        log_config=None,
        access_log=False,
        log_level="warning",
        backlog=2048,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="stub server to start")
        yield RunningStub(app, f"http://127.0.0.1:{port}", port)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
