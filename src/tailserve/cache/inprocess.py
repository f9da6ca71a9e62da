"""The shared tier's in-memory twin: `InProcessStore` plays the Redis server, `InProcessTier`
a worker's `RedisTier` on it (the contract both keep: tier.py).

The store holds values with a TTL in milliseconds, bounded by bytes (least recently used out
first, as Redis's ``allkeys-lru``), ``SET NX`` leases under ``key:lease``, and channels. Its
faults are Redis's: `pause` (SIGSTOP: every call waits until `resume`), `kill` (every call
fails; `restart` brings it back empty, as a Redis that keeps nothing on disk), and
`fail(command, ...)` (those commands fail, the rest work). Workers of one test share a store
through a tier each, as they share a Redis.

The tier degrades as the real one does: a lookup waits at most ``budget_s``; what is slow or
fails is a miss, counted in ``skips``, and repeated failures open the breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.write_behind import Write, WriteBehind

log = logging.getLogger(__name__)


class InProcessStore:
    def __init__(
        self, *, max_bytes: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        # key -> (value, when it expires by the clock), least recently used first.
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._down = False
        self._failing: frozenset[str] = frozenset()
        self._channels: dict[str, list[asyncio.Queue[bytes]]] = {}

    # --- faults -----------------------------------------------------------------------------

    def pause(self) -> None:
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    def kill(self) -> None:
        self._down = True

    def restart(self) -> None:
        self._down = False
        self._data.clear()
        self.bytes = 0

    def fail(self, *commands: str) -> None:
        """Make these commands (``GET``, ``SET``, ``SCAN``, ``PUBLISH``...) fail; none: heal."""
        self._failing = frozenset(c.upper() for c in commands)

    async def _call(self, command: str) -> None:
        await self._resumed.wait()
        if self._down:
            raise ConnectionError("connection refused")
        if command in self._failing:
            raise ConnectionError(f"{command} failed")

    # --- commands ---------------------------------------------------------------------------

    async def ping(self) -> None:
        await self._call("PING")

    async def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        await self._call("GET")
        return [self._get(key) for key in keys]

    async def set_many(self, items: Sequence[tuple[str, bytes, int]]) -> None:
        """``SET key value PX ms`` of each."""
        await self._call("SET")
        if any(ttl_ms <= 0 for _, _, ttl_ms in items):
            raise ValueError("invalid expire time in 'set' command")
        for key, value, ttl_ms in items:
            self._set(key, value, ttl_ms)

    async def set_nx(self, key: str, value: bytes, ttl_ms: int) -> bool:
        await self._call("SET")
        if self._get(key) is not None:
            return False
        self._set(key, value, ttl_ms)
        return True

    async def delete_if(self, key: str, value: bytes) -> bool:
        """Delete ``key`` if it holds ``value`` (a lease still its holder's)."""
        await self._call("EVAL")
        if self._get(key) != value:
            return False
        self._drop(key)
        return True

    async def drop_prefix(self, prefix: str) -> int:
        await self._call("SCAN")
        doomed = [key for key in self._data if key.startswith(prefix)]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    async def publish(self, channel: str, message: bytes) -> int:
        """Answers how many subscribers it reached."""
        await self._call("PUBLISH")
        queues = self._channels.get(channel, [])
        for queue in queues:
            queue.put_nowait(message)
        return len(queues)

    def subscribe(self, channel: str) -> asyncio.Queue[bytes]:
        """The messages published on ``channel`` from now on."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._channels.setdefault(channel, []).append(queue)
        return queue

    # --- looking inside (an operator's console; no fault applies) ---------------------------

    def peek(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        return entry[0] if entry is not None and entry[1] > self._clock() else None

    def pttl(self, key: str) -> int | None:
        """Milliseconds ``key`` has left (None: absent)."""
        entry = self._data.get(key)
        left = None if entry is None else entry[1] - self._clock()
        return None if left is None or left <= 0 else max(1, round(left * 1000))

    def __len__(self) -> int:
        return len(self._data)

    # --- internals --------------------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            self._drop(key)
            return None
        self._data.move_to_end(key)
        return entry[0]

    def _set(self, key: str, value: bytes, ttl_ms: int) -> None:
        self._drop(key)
        self._data[key] = (value, self._clock() + ttl_ms / 1000)
        self.bytes += len(key) + len(value)
        while self.max_bytes is not None and self.bytes > self.max_bytes and self._data:
            self._drop(next(iter(self._data)))
            self.evictions += 1

    def _drop(self, key: str) -> None:
        entry = self._data.pop(key, None)
        if entry is not None:
            self.bytes -= len(key) + len(entry[0])


class InProcessTier(WriteBehind):
    def __init__(
        self,
        store: InProcessStore,
        *,
        budget_s: float = 0.005,
        breaker: Breaker | None = None,
        on_breaker: Callable[[BreakerState], None] | None = None,
        on_skip: Callable[[str, str, int], None] | None = None,
        write_window_s: float = 0.005,
    ) -> None:
        super().__init__(
            breaker or Breaker(clock=time.monotonic, on_change=on_breaker),
            write_window_s=write_window_s,
            on_skip=on_skip,
        )
        self.store = store
        self.budget_s = budget_s

    async def connect(self) -> bool:
        try:
            async with asyncio.timeout(1.0):
                await self.store.ping()
        except Exception as exc:
            log.warning("the store does not answer yet (%s)", exc)
            return False
        return True

    async def get(self, key: str) -> bytes | None:
        if not self.breaker.allow():
            self._skip("lookup", "breaker")
            return None
        try:
            async with asyncio.timeout(self.budget_s):
                (value,) = await self.store.mget([key])
        except TimeoutError:
            self._skip("lookup", "budget")
            self.breaker.failure()
            return None
        except Exception as exc:
            self._failed("GET", exc)
            self._skip("lookup", "error")
            return None
        self.breaker.success()
        return value

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    async def _set_many(self, batch: Sequence[Write]) -> None:
        await self.store.set_many(batch)

    async def lease(self, key: str, owner: str, ttl_s: float) -> bool | None:
        if not self.breaker.allow():
            return None
        try:
            async with asyncio.timeout(self.budget_s):
                taken = await self.store.set_nx(
                    key + ":lease", owner.encode(), max(1, int(ttl_s * 1000))
                )
        except Exception as exc:
            self._failed("SET NX", exc)
            return None
        self.breaker.success()
        return taken

    def release_lease(self, key: str, owner: str) -> None:
        async def release() -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(max(self.budget_s, 0.05)):
                    await self.store.delete_if(key + ":lease", owner.encode())

        self._own(release())

    async def drop_prefix(self, prefix: str) -> int:
        return await self.store.drop_prefix(prefix)

    async def publish(self, channel: str, message: bytes) -> None:
        await self.store.publish(channel, message)

    async def close(self) -> None:
        await self._cancel_tasks()

    def _failed(self, what: str, exc: BaseException) -> None:
        if self.breaker.state is BreakerState.CLOSED:
            log.warning("store %s failed: %s: %s", what, type(exc).__name__, exc)
        self.breaker.failure()
