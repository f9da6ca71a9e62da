"""Writes to the shared tier gathered behind the requests, and the tasks the tier runs on its
own: what `RedisTier` and its in-process twin (`InProcessTier`) share.

A write is never waited for: those made over ``write_window_s`` go out together (one pipeline:
each round trip costs the client ~150 µs of CPU, and a write is needed only by the next
reader, so a few ms late costs nothing). While the breaker is not closed a write is skipped.
A failed send is counted with its keys and told to the breaker (`_failed`). Skips are counted
by (operation, reason) and told to ``on_skip`` (the metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from tailserve.cache.breaker import Breaker, BreakerState

# (key, value, time to live in ms)
Write = tuple[str, bytes, int]


class WriteBehind:
    """The write side of a shared tier; a tier says how a batch is sent (`_set_many`) and what
    a failure does (`_failed`)."""

    def __init__(
        self,
        breaker: Breaker,
        *,
        write_window_s: float,
        on_skip: Callable[[str, str, int], None] | None,
    ) -> None:
        self.breaker = breaker
        self.write_window_s = write_window_s
        self._on_skip = on_skip
        self._writes: list[Write] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        # What was done without: (operation, reason) -> keys.
        self.skips: Counter[tuple[str, str]] = Counter()

    @property
    def skipped(self) -> int:
        """Lookups answered as misses without the tier's answer (whatever the reason)."""
        return sum(n for (operation, _), n in self.skips.items() if operation == "lookup")

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store in the background, never waiting (see the module's docstring)."""
        if self.breaker.state is not BreakerState.CLOSED:  # probes are for lookups
            self._skip("write", "breaker")
            return
        if not self._writes:
            asyncio.get_running_loop().call_later(self.write_window_s, self._flush_writes)
        self._writes.append((key, value, max(1, int(ttl_s * 1000))))

    async def put_now(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """Store and wait (precompute jobs); raises on failure."""
        await self._set_many([(k, v, max(1, int(t * 1000))) for k, v, t in items])

    def forget_writes(self, prefix: str) -> int:
        """Drop the writes still waiting to go out under ``prefix`` (an invalidation: they
        would put back what it has just removed). Answers how many."""
        kept = [write for write in self._writes if not write[0].startswith(prefix)]
        dropped = len(self._writes) - len(kept)
        self._writes[:] = kept  # (the flush timer takes whatever the list holds then)
        return dropped

    async def flush(self) -> None:
        """Send the writes waiting for their window now, and wait for all the tier runs in
        the background (writes, leases given back): before a drain closes it, say."""
        self._flush_writes()
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _set_many(self, batch: Sequence[Write]) -> None:
        raise NotImplementedError

    def _failed(self, what: str, exc: BaseException) -> None:
        raise NotImplementedError

    def _flush_writes(self) -> None:
        batch, self._writes = self._writes, []
        if batch:
            self._own(self._send_writes(batch))

    async def _send_writes(self, batch: list[Write]) -> None:
        try:
            await self._set_many(batch)
        except Exception as exc:
            self._failed("SET", exc)
            self._skip("write", "error", len(batch))

    def _skip(self, operation: str, reason: str, count: int = 1) -> None:
        if count:
            self.skips[operation, reason] += count
            if self._on_skip is not None:
                self._on_skip(operation, reason, count)

    def _own(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
