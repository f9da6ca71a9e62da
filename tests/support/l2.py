"""The shared tier's store as a test sees it, real or twin: a redis-server (over redis-py or the
lean connection) or the in-process store. A test makes tiers on it, looks inside it as an
operator would (GET, PTTL, EXISTS) and breaks it as production does (pause, kill, restart)."""

from __future__ import annotations

from typing import Any, Protocol

from support.servers import OwnRedisServer, kill_redis, pause_redis, restart_redis, resume_redis
from tailserve.cache.inprocess import InProcessStore, InProcessTier
from tailserve.cache.redis import RedisTier, connect
from tailserve.cache.resp import LeanRedis
from tailserve.cache.tier import CacheTier

KINDS = ("redis-py", "lean", "memory")


class Store(Protocol):
    kind: str

    def tier(self, *, socket_timeout_s: float = 1.0, **options: Any) -> CacheTier:
        """A worker's tier on this store (``socket_timeout_s``: what Redis's client would
        wait, well past the budget; the twin has none)."""
        ...

    async def get(self, key: str) -> bytes | None: ...

    async def pttl(self, key: str) -> int | None: ...

    async def exists(self, *keys: str) -> int: ...

    async def seed(self, items: dict[str, bytes], ttl_ms: int = 60_000) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def kill(self) -> None: ...

    def restart(self) -> None: ...

    async def close(self) -> None: ...


class RedisStore:
    """A redis-server; ``own`` when the test may pause, kill or restart it."""

    def __init__(self, kind: str, url: str, own: OwnRedisServer | None = None) -> None:
        from redis.asyncio import Redis

        self.kind = kind
        self.url = url
        self.own = own
        self.admin = Redis.from_url(url)

    def tier(self, *, socket_timeout_s: float = 1.0, **options: Any) -> RedisTier:
        fast = None
        if self.kind == "lean":
            fast = LeanRedis(self.url, command_timeout_s=socket_timeout_s)
        client = connect(self.url, socket_timeout=socket_timeout_s)
        return RedisTier(client, fast=fast, **options)

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self.admin.get(key)
        return value

    async def pttl(self, key: str) -> int | None:
        left = int(await self.admin.pttl(key))
        return left if left >= 0 else None

    async def exists(self, *keys: str) -> int:
        return int(await self.admin.exists(*keys))

    async def seed(self, items: dict[str, bytes], ttl_ms: int = 60_000) -> None:
        async with self.admin.pipeline(transaction=False) as pipe:
            for key, value in items.items():
                pipe.set(key, value, px=ttl_ms)
            await pipe.execute()

    def _server(self) -> OwnRedisServer:
        assert self.own is not None, "a test that breaks Redis needs a server of its own"
        return self.own

    def pause(self) -> None:
        pause_redis(self._server())

    def resume(self) -> None:
        resume_redis(self._server())

    def kill(self) -> None:
        kill_redis(self._server())

    def restart(self) -> None:
        restart_redis(self._server())

    async def close(self) -> None:
        await self.admin.aclose()


class MemoryStore:
    """The in-process twin (cache/inprocess.py)."""

    kind = "memory"

    def __init__(self, **options: Any) -> None:
        self.store = InProcessStore(**options)

    def tier(self, *, socket_timeout_s: float = 1.0, **options: Any) -> InProcessTier:
        return InProcessTier(self.store, **options)

    async def get(self, key: str) -> bytes | None:
        return self.store.peek(key)

    async def pttl(self, key: str) -> int | None:
        return self.store.pttl(key)

    async def exists(self, *keys: str) -> int:
        return sum(self.store.peek(key) is not None for key in keys)

    async def seed(self, items: dict[str, bytes], ttl_ms: int = 60_000) -> None:
        await self.store.set_many([(k, v, ttl_ms) for k, v in items.items()])

    def pause(self) -> None:
        self.store.pause()

    def resume(self) -> None:
        self.store.resume()

    def kill(self) -> None:
        self.store.kill()

    def restart(self) -> None:
        self.store.restart()

    async def close(self) -> None:
        self.store.resume()
