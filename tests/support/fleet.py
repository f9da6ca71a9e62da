"""A stack's supervisor run in the test's own event loop (`assembly.stack.Supervisor`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tailserve.assembly.stack import FleetConfig, Supervisor


@contextlib.asynccontextmanager
async def started(config: FleetConfig) -> AsyncIterator[Supervisor]:
    """The supervisor once its stack is ready (at most 90 s), stopped on the way out."""
    supervisor = Supervisor(config)
    await supervisor.start()
    try:
        await asyncio.wait_for(supervisor.ready.wait(), timeout=90)
        yield supervisor
    finally:
        await supervisor.stop()
