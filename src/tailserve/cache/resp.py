"""A lean Redis connection for the cache's hot path: MGET and pipelined SET ... PX.

redis-py costs ~135 µs of CPU per command round trip (connection checkout, command packing in
Python, response callbacks); a batched churn row costs ~20 µs to compute, so on a miss the
L2 lookup cost more than the model. This is one asyncio protocol on one connection: commands
are packed by hiredis (in C), written at once and pipelined, and replies, parsed by hiredis,
resolve futures in order. A few microseconds a command.

It does only what the result cache's hot path needs, on a single Redis (a cluster keeps
redis-py, which routes by slot). Any fault (a refused connect, a lost connection, an error
reply) fails the commands in flight with `RespError`; the next command connects again. The
breaker in `RedisTier` decides when to stop asking.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import hiredis


class RespError(Exception):
    pass


def _pack(command: tuple[Any, ...]) -> bytes:
    # (hiredis's stubs type the tuple as of one element)
    packed: bytes = hiredis.pack_command(cast(Any, command))
    return packed


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RespError(f"bad reply from redis: {exc}"))
                if self.transport is not None:
                    self.transport.abort()
                return
            if reply is False:
                return
            if not self._waiting:
                continue  # a reply to a command whose waiter was failed already
            future = self._waiting.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(RespError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(RespError(f"connection to redis lost: {exc or 'closed'}"))

    def send(self, payload: bytes, count: int) -> list[asyncio.Future[Any]]:
        """Write ``count`` packed commands; their replies' futures, in order."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(count)]
        self._waiting.extend(futures)
        self.transport.write(payload)
        return futures

    def _fail(self, error: RespError) -> None:
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)


class LeanRedis:
    """Lazily connected; ``redis://[:password@]host[:port][/db]`` (or ``unix://`` is not
    supported: use redis-py there)."""

    def __init__(
        self, url: str, *, connect_timeout_s: float = 0.25, command_timeout_s: float = 1.0
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", ""):
            raise ValueError(f"the lean client speaks redis:// only, not {parts.scheme}://")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.password = unquote(parts.password) if parts.password else None
        self.username = unquote(parts.username) if parts.username else None
        path = parts.path.strip("/")
        self.db = int(path) if path else 0
        self.connect_timeout_s = connect_timeout_s
        # A reply later than this fails its command (a paused Redis); the connection stays,
        # and the late reply is matched to its abandoned command and dropped.
        self.command_timeout_s = command_timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    async def _connection(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and not protocol.lost:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await loop.create_connection(_Protocol, self.host, self.port)
                setup: list[tuple[Any, ...]] = []
                if self.password is not None:
                    setup.append(
                        ("AUTH", self.username, self.password)
                        if self.username
                        else ("AUTH", self.password)
                    )
                if self.db:
                    setup.append(("SELECT", str(self.db)))
                if setup:
                    payload = b"".join(_pack(c) for c in setup)
                    await asyncio.gather(*protocol.send(payload, len(setup)))
        except (OSError, TimeoutError) as exc:
            raise RespError(f"cannot connect to redis at {self.host}:{self.port}: {exc}") from exc
        self._protocol = protocol
        return protocol

    async def open(self) -> None:
        """Connect now (at start-up), so the first lookup does not pay for it; raises
        `RespError` when Redis does not answer."""
        await self._connection()

    async def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        protocol = await self._connection()
        (future,) = protocol.send(_pack(("MGET", *keys)), 1)
        async with asyncio.timeout(self.command_timeout_s):
            values: list[bytes | None] = await future
        return values

    async def set_many(self, items: Sequence[tuple[str, bytes, int]]) -> None:
        """``SET key value PX ttl_ms`` for each, pipelined; raises on the first failure."""
        protocol = await self._connection()
        payload = b"".join(
            _pack(("SET", key, value, "PX", str(ttl_ms))) for key, value, ttl_ms in items
        )
        async with asyncio.timeout(self.command_timeout_s):
            await asyncio.gather(*protocol.send(payload, len(items)))

    async def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
