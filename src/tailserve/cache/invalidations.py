"""Following the workers' invalidation channel: the workers' caches and the client's edge tier.

A worker that invalidates publishes ``{"prefix": ..., "origin": ...}`` on
``INVALIDATION_CHANNEL``. `InvalidationFeed` subscribes, hands each prefix to ``on_prefix``
(but those of ``ignore_origin``: a worker has dropped its own already; a client has no origin
of its own), and reconnects by itself with a growing pause. Each time it (re)subscribes it
calls ``on_subscribed`` first: an event published while there was no subscription is lost, so
what was kept before may be stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import orjson

from tailserve.cache.redis import INVALIDATION_CHANNEL

log = logging.getLogger(__name__)


def parse_event(data: Any) -> tuple[str, Any] | None:
    """The prefix an invalidation message names and its origin; None for a malformed one."""
    try:
        message = orjson.loads(data)
        prefix = message["prefix"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return (prefix, message.get("origin")) if isinstance(prefix, str) else None


def parse_message(data: Any) -> str | None:
    """The prefix an invalidation message names; None for a malformed one."""
    event = parse_event(data)
    return event[0] if event is not None else None


class InvalidationFeed:
    def __init__(
        self,
        client_factory: Callable[[], Any],
        on_prefix: Callable[[str], object],
        on_subscribed: Callable[[], object],
        *,
        pause_s: float = 0.05,
        max_pause_s: float = 2.0,
        ignore_origin: str | None = None,
        name: str = "edge-invalidation",
    ) -> None:
        self._factory = client_factory
        self._on_prefix = on_prefix
        self._on_subscribed = on_subscribed
        self._pause_s = pause_s
        self._max_pause_s = max_pause_s
        self._ignore = ignore_origin
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()
        self.received = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.subscribed.clear()

    async def _run(self) -> None:
        pause = self._pause_s
        while True:
            client = self._factory()
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(INVALIDATION_CHANNEL)
                    self._on_subscribed()
                    self.subscribed.set()
                    pause = self._pause_s
                    while True:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=1.0
                        )
                        if message is not None:
                            self._deliver(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("invalidation channel lost: %s; retrying in %.2fs", exc, pause)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(pause)
            pause = min(pause * 2, self._max_pause_s)

    def _deliver(self, data: Any) -> None:
        event = parse_event(data)
        if event is None:
            log.warning("ignoring a malformed invalidation message: %r", data)
            return
        prefix, origin = event
        if self._ignore is not None and origin == self._ignore:
            return
        self.received += 1
        self._on_prefix(prefix)
