"""A stack's supervisor run in the test's own event loop (`assembly.stack.Supervisor`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tailserve.assembly.stack import FleetConfig, Supervisor
from tailserve.fleet.load import parse_stat
from tailserve.frontdoor.haproxy import HAProxy


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


async def held(door: HAProxy, backend: str, server: str) -> int:
    """Requests ``server`` of ``backend`` holds in flight and queued, with the backend's own
    queue (0 while the master's socket is re-created by a reload)."""
    try:
        stat = parse_stat(await door.command("@1 show stat"))
    except OSError:
        return 0
    row, queue = stat.get((backend, server), {}), stat.get((backend, "BACKEND"), {})
    return sum(int(n or 0) for n in (row.get("scur"), row.get("qcur"), queue.get("qcur")))
