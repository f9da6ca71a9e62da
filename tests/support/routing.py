"""A router in the test's own event loop, in front of the given backends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tailserve.router.config import RouterConfig
from tailserve.router.proxy import Router


@contextlib.asynccontextmanager
async def running_router(backends: list[str], **changes: Any) -> AsyncIterator[Router]:
    """On a free loopback port, with health checks every 0.1 s (``changes`` override any
    setting); drained when the block ends."""
    options: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "health_interval_s": 0.1}
    options.update(changes)
    router = Router(RouterConfig(backends=tuple(backends), **options))
    await router.start()
    try:
        yield router
    finally:
        await router.drain(timeout_s=5)
