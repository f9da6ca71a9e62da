"""Replicas for the dispatcher's tests, reached over the in-process transport or over real
loopback HTTP (the worker's own server): the same `Replica` application behind either."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

import orjson

from tailserve.transport import http1
from tailserve.transport.base import Connect
from tailserve.transport.in_memory import MemoryNetwork
from tailserve.transport.request import HttpRequest
from tailserve.transport.server import HttpServer

Reply = tuple[int, list[tuple[bytes, bytes]], bytes]
_JSON = [(b"content-type", b"application/json")]


class Replica:
    """A worker as the router sees it: ready, answers ``/infer`` with ``status`` (an echo of
    the body with 200). While `held`, each request waits until `release`, and goes to
    `arrivals` as it comes; every request whose client went away goes to `cancelled`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.held = False
        self._gate = asyncio.Event()
        self.seen: list[HttpRequest] = []
        self.arrivals: asyncio.Queue[HttpRequest] = asyncio.Queue()
        self.cancelled: asyncio.Queue[HttpRequest] = asyncio.Queue()

    def hold(self) -> None:
        self.held = True
        self._gate.clear()
        self.arrivals = asyncio.Queue()

    def release(self) -> None:
        self.held = False
        self._gate.set()

    def answer_now(self, request: HttpRequest) -> Reply | None:
        if request.path.startswith("/v2/health/"):
            return 200, _JSON, b"{}"
        return None

    def answer(self, request: HttpRequest) -> Coroutine[Any, Any, Reply]:
        return self._answer(request)

    async def _answer(self, request: HttpRequest) -> Reply:
        self.seen.append(request)
        try:
            if self.held:
                self.arrivals.put_nowait(request)
                await self._gate.wait()
        except asyncio.CancelledError:
            if request.disconnected:
                self.cancelled.put_nowait(request)
            raise
        if self.status != 200:
            return self.status, _JSON, orjson.dumps({"error": f"{self.name} says {self.status}"})
        return 200, [*_JSON, (b"x-replica", self.name.encode())], request.raw_body


class Replicas(Protocol):
    """Where the replicas run: `connect` is the dispatcher's transport to them."""

    connect: Connect

    async def start(self, replica: Replica) -> str:
        """Serve ``replica``; answers its URL."""
        ...

    def kill(self, url: str) -> None:
        """The replica crashes: connections in flight drop, new ones are refused."""

    async def close(self) -> None: ...


class InMemory:
    def __init__(self) -> None:
        self.network = MemoryNetwork()
        self.connect: Connect = self.network.connect

    async def start(self, replica: Replica) -> str:
        return self.network.listen(replica)

    def kill(self, url: str) -> None:
        self.network.kill(url)

    async def close(self) -> None:
        pass


class Loopback:
    def __init__(self) -> None:
        self.connect: Connect = http1.Pool
        self.servers: dict[str, HttpServer] = {}

    async def start(self, replica: Replica) -> str:
        server = HttpServer(replica, max_body_bytes=1 << 20)
        await server.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        self.servers[url] = server
        return url

    def kill(self, url: str) -> None:
        self.servers[url].close()

    async def close(self) -> None:
        for server in self.servers.values():
            server.close()
