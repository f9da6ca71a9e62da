"""The processes `tailserve up` keeps: a slot per worker (and one for the hedging lane) whose
ports stay while its process is replaced, and the small waits the supervisor makes on them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from tailserve.errors import UpstreamError
from tailserve.fleet.admin_lane import Slot
from tailserve.router.config import backend_url
from tailserve.router.lanes import predicted_ms
from tailserve.transport.http1 import Pool, frame_request

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class Role(StrEnum):
    """What the supervisor wants of a slot."""

    SERVING = "serving"  # in the front door's rotation
    STANDBY = "standby"  # started, loaded and warm, out of rotation (the warm pool)
    OFF = "off"  # no process (one still running drains, then exits)


@dataclass(eq=False, slots=True)
class ManagedWorker:
    """One worker slot: its ports stay while its process is replaced."""

    name: str
    port: int
    grpc_port: int = 0
    # Its command line (set by the supervisor): `tailserve serve`, or `tailserve route` for
    # the hedging lane.
    command: list[str] = field(default_factory=list)
    # What its process adds to the supervisor's environment (its GPU: fleet/gpus.py).
    env: dict[str, str] = field(default_factory=dict)
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    ready: bool = False
    role: Role = Role.SERVING
    # When its process last started and became ready (the event loop's clock): a cold start.
    started_at: float | None = None
    ready_at: float | None = None
    # The process that has been sent SIGTERM: a second one would make it exit without draining.
    _terminated: asyncio.subprocess.Process | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return backend_url(LOOPBACK, self.port)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def terminate(self) -> None:
        """Ask the process to drain and exit (once)."""
        if self.running and self._terminated is not self.process:
            assert self.process is not None
            self._terminated = self.process
            self.process.terminate()

    def kill(self) -> None:
        if self.running:
            assert self.process is not None
            self.process.kill()

    @property
    def state(self) -> str:
        """``warming``, ``standby``, ``serving``, ``draining``, ``restarting`` or ``off``."""
        if self.role is Role.OFF:
            return "draining" if self.running else "off"
        if not self.running and self.process is not None:
            return "restarting"
        if not self.ready:
            return "warming"
        return self.role.value

    @property
    def cold_start_s(self) -> float | None:
        """Process start to ready, the last time it started."""
        if self.started_at is None or self.ready_at is None or self.ready_at < self.started_at:
            return None
        return self.ready_at - self.started_at

    def slot(self) -> Slot:
        return Slot(
            self.name,
            LOOPBACK,
            self.port,
            self.pid,
            self.ready,
            self.restarts,
            self.running,
            self.state,
            self.cold_start_s,
        )


async def until_ready(
    pool: Pool, interval_s: float, process: asyncio.subprocess.Process | None = None
) -> bool:
    """Poll ``GET /v2/health/ready`` until it answers 200 (True), or ``process`` exits (False).
    Closes the pool."""
    request = frame_request("GET", "/v2/health/ready", pool.origin)
    try:
        while process is None or process.returncode is None:
            with contextlib.suppress(UpstreamError):
                if (await pool.request(request, timeout_s=2.0)).status == 200:
                    return True
            await asyncio.sleep(interval_s)
        return False
    finally:
        await pool.close()


async def prediction(pool: Pool, model: str) -> float | None:
    """A model's predicted time for one row, from a worker's stats (None: not known yet)."""
    request = frame_request("GET", f"/v2/models/{model}/stats", pool.origin)
    try:
        reply = await pool.request(request, timeout_s=2.0)
        return predicted_ms(orjson.loads(reply.body)) if reply.status == 200 else None
    except (UpstreamError, orjson.JSONDecodeError):
        return None


async def until_ok(pool: Pool, path: str, interval_s: float) -> None:
    request = frame_request("GET", path, pool.origin)
    while True:
        if (await pool.request(request, timeout_s=2.0)).status == 200:
            return
        await asyncio.sleep(interval_s)


async def set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


def owned_task(coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    task = asyncio.create_task(coroutine, name=name)
    task.add_done_callback(log_failure)
    return task


def log_failure(task: asyncio.Task[None]) -> None:
    # Said at once: the task is awaited only at shutdown, and its worker is gone meanwhile.
    if not task.cancelled() and task.exception() is not None:
        log.error("%s failed", task.get_name(), exc_info=task.exception())


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``host`` now: bound to port 0 all at once, then closed."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
