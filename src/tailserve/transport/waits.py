"""A bounded wait on the loop's events, as the servers' drains use it."""

from __future__ import annotations

import asyncio


async def until_set(event: asyncio.Event, forced: asyncio.Event | None, timeout_s: float) -> None:
    """Until ``event`` (or ``forced``) is set, for at most ``timeout_s``."""
    waits = [asyncio.ensure_future(event.wait())]
    if forced is not None:
        waits.append(asyncio.ensure_future(forced.wait()))
    await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
