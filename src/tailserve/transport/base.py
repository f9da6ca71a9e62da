"""The client transport's contract: what the router's dispatcher asks of a pool of connections
to one backend. `http1.Pool` is the real one; `memory.MemoryNetwork` hands out an in-process
twin, so the dispatcher's policies (hedging, retries, ejection) are tested without sockets and
the same suite runs over loopback HTTP too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tailserve.errors import UpstreamError

if TYPE_CHECKING:
    from tailserve.transport.http1 import Response

Callback = Callable[["Response | UpstreamError"], None]


@dataclass(frozen=True, slots=True)
class PoolState:
    """A pool at one moment: its connections (in use or idle), the requests waiting for one,
    and how many it has opened over its life (a count that climbs with traffic means the
    connections are not being reused)."""

    open: int
    idle: int
    waiting: int
    opened: int


class Ticket(Protocol):
    def cancel(self) -> None:
        """Withdraw the request: no callback follows, and the server sees the client go."""


class ClientPool(Protocol):
    origin: str

    def submit(self, data: bytes, callback: Callback, timeout_s: float | None = None) -> Ticket:
        """Send ``data`` (a whole framed request); ``callback`` gets the response or the
        `UpstreamError`, never from inside this call, unless the ticket is cancelled first."""
        ...

    async def request(self, data: bytes, timeout_s: float | None = None) -> Response: ...

    def state(self) -> PoolState: ...

    async def close(self) -> None: ...


class Connect(Protocol):
    """Makes the pool to ``host:port`` (`http1.Pool` itself is one)."""

    def __call__(
        self, host: str, port: int, *, max_connections: int, loop: asyncio.AbstractEventLoop
    ) -> ClientPool: ...
