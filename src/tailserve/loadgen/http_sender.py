"""The HTTP/1.1 sender: prepared requests over a pool of keep-alive connections.

The pool is callback-driven (`tailserve.transport.http1`): no task per request. A request waits
for a connection only when all ``connections`` are busy; its timeout counts from the send.
"""

from __future__ import annotations

import asyncio

from tailserve.errors import ConnectFailed, UpstreamError, UpstreamTimeout
from tailserve.loadgen.sending import CACHE_CODES, CONNECT, LOST, TIMEOUT, Completion, Link, Served
from tailserve.transport.http1 import Pool, Response

# Response headers in which a tailserve server says how it served a request.
_SERVED = (b"x-queue-us", b"x-compute-us", b"x-batch-size", b"x-cache")
_CACHE = {tier.encode(): code for tier, code in CACHE_CODES.items()}


class HttpSender:
    def __init__(self, link: Link, loop: asyncio.AbstractEventLoop, done: Completion) -> None:
        self._pool = Pool(link.host, link.port, max_connections=link.connections, loop=loop)
        self._timeout_s = link.timeout_s
        self._done = done

    def send(self, index: int, data: bytes) -> None:
        done = self._done

        def callback(result: Response | UpstreamError) -> None:
            if isinstance(result, Response):
                done(index, result.status, served(result))
            elif isinstance(result, UpstreamTimeout):
                done(index, TIMEOUT, None)
            else:
                done(index, CONNECT if isinstance(result, ConnectFailed) else LOST, None)

        self._pool.submit(data, callback, self._timeout_s)

    async def close(self) -> None:
        await self._pool.close()


def served(response: Response) -> Served | None:
    """What the response's headers say of how it was served (None: nothing)."""
    values: dict[bytes, bytes] = {}
    for name, value in response.headers:
        name = name.lower()
        if name in _SERVED:
            values[name] = value
    if not values:
        return None
    return Served(
        queue_us=_number(values.get(b"x-queue-us")),
        compute_us=_number(values.get(b"x-compute-us")),
        batch_size=_number(values.get(b"x-batch-size")),
        cache=_CACHE.get(values.get(b"x-cache", b"").lower(), 0),
    )


def _number(value: bytes | None) -> int:
    if value is None or not value.isdigit():
        return -1
    return min(int(value), 2**31 - 1)
