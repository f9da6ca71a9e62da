"""The supervisor of `tailserve up`: worker processes on loopback ports, the router in front.

Start: choose a free loopback port per worker, start the router with the workers' URLs as its
backends, then start each worker (`tailserve serve`, HTTP only: gRPC clients call the
router's gRPC port, which sends their calls on over HTTP). Nothing waits for
models to load: the router checks each worker's readiness itself and sends only to ready ones.
The supervisor watches readiness too, only to log it and to say once that the fleet is ready.

A worker that exits is started again on the same port (its URL is the router's backend), after
a delay that doubles while it keeps dying (`RestartPolicy`).

SIGTERM, SIGINT or SIGHUP: the router drains first (no new requests, those in flight finish),
then every worker gets SIGTERM and drains itself; a worker still running after the drain
timeout is killed, and so is every worker at a second signal. Workers run in sessions of their
own, so a Ctrl-C in the terminal reaches only the supervisor, which keeps that order; the price
is that a supervisor killed with SIGKILL leaves them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from tailserve.errors import ConfigError, UpstreamError
from tailserve.fleet.restarts import Backoff, RestartPolicy
from tailserve.router.config import RouterConfig, backend_url, parse_backend
from tailserve.router.proxy import Router
from tailserve.transport.http1 import Pool, frame_request

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# SIGHUP too: the workers are in sessions of their own, so a closed terminal would otherwise
# kill the supervisor alone and leave them running.
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Beyond the drain timeout, the time a drained worker has to close its models and exit.
EXIT_GRACE_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    repository: str
    host: str = "0.0.0.0"
    port: int = 8080
    # The router's gRPC port (the Open Inference Protocol's gRPC service; 0: none, as
    # here; `tailserve up` listens on 8081).
    grpc_port: int = 0
    workers: int = 1
    # The router's policy (balancing, hedging, ejection, limits); its address, backends,
    # admin token and drain timeout come from the fields here.
    router: RouterConfig = field(default_factory=RouterConfig)
    # Both the workers' admin routes and the router (which reads each worker's model index).
    admin_token: str | None = None
    drain_timeout_s: float = 30.0
    # More `tailserve serve` flags, the same for every worker (--redis-url URL, --log-level L).
    worker_args: tuple[str, ...] = ()
    ready_interval_s: float = 0.25
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, not {self.workers}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must be at least 0, not {self.drain_timeout_s}")


@dataclass(eq=False, slots=True)
class ManagedWorker:
    """One worker slot: its ports stay while its process is replaced."""

    name: str
    port: int
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    ready: bool = False
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


class Supervisor:
    """The router and N workers in one event loop: `start`, then `stop` (or `run`, which waits
    for a signal in between)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.workers: list[ManagedWorker] = []
        # Set once, when every worker has been ready and the router too (the first start).
        self.ready = asyncio.Event()
        self._workers_ready = asyncio.Event()
        self._signalled = asyncio.Event()
        self._router: Router | None = None
        self._keepers: list[asyncio.Task[None]] = []  # one a worker
        self._announcer: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def router_port(self) -> int:
        if self._router is None:
            raise RuntimeError("the supervisor has not started")
        return self._router.port

    @property
    def router_url(self) -> str:
        """Where a client on this machine reaches the router."""
        wildcard = {"0.0.0.0": LOOPBACK, "": LOOPBACK, "::": "::1"}
        return backend_url(wildcard.get(self.config.host, self.config.host), self.router_port)

    async def run(self) -> None:
        """Start, serve until SIGTERM, SIGINT or SIGHUP, then drain and stop."""
        loop = asyncio.get_running_loop()
        for sig in SHUTDOWN_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal)
        try:
            await self.start()
            await self._signalled.wait()
            log.info("signalled: draining the router, then the workers")
        finally:
            await self.stop()
            for sig in SHUTDOWN_SIGNALS:
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        # A second one, as with a worker, cuts the drain short: requests in flight fail at once.
        if self._signalled.is_set():
            log.warning("signalled again: killing the workers")
            for worker in self.workers:
                worker.kill()
        self._signalled.set()

    async def start(self) -> None:
        """Start the router, then the workers; return without waiting for them to be ready."""
        ports = free_ports(self.config.workers)
        self.workers = [ManagedWorker(f"worker-{i}", port) for i, port in enumerate(ports)]
        # The router first: a taken public port fails before any worker has started.
        router = Router(self._router_config())
        try:
            await router.start()
        except OSError as exc:
            await router.drain(0)  # its health checks have started
            where = f"{self.config.host}:{self.config.port}"
            raise ConfigError(f"the router cannot listen on {where}: {exc.strerror}") from None
        self._router = router
        self._keepers = [_task(self._keep(w), f"keep {w.name}") for w in self.workers]
        self._announcer = _task(self._announce(), "announce")

    async def stop(self) -> None:
        """Drain the router, then the workers; kill a worker still running after the timeout."""
        if self._stopping.is_set():
            return
        self._stopping.set()  # from here on no worker is restarted
        if self._announcer is not None:
            self._announcer.cancel()
            await asyncio.gather(self._announcer, return_exceptions=True)
        try:
            if self._router is not None:
                await self._router.drain(self.config.drain_timeout_s)
        finally:
            await self._stop_workers()

    async def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.terminate()
        if not self._keepers:
            return
        await asyncio.wait(self._keepers, timeout=self.config.drain_timeout_s + EXIT_GRACE_S)
        for worker in self.workers:
            if worker.running:
                log.warning("%s (pid %s) did not exit in time: killed", worker.name, worker.pid)
                worker.kill()
        await asyncio.gather(*self._keepers, return_exceptions=True)

    def _router_config(self) -> RouterConfig:
        return self.config.router.replace(
            host=self.config.host,
            port=self.config.port,
            grpc_port=self.config.grpc_port,
            backends=tuple(worker.url for worker in self.workers),
            admin_token=self.config.admin_token,
            drain_timeout_s=self.config.drain_timeout_s,
        )

    def _public_url(self) -> str:
        return backend_url(self.config.host, self.router_port)

    # --- one task per worker --------------------------------------------------------------

    async def _keep(self, worker: ManagedWorker) -> None:
        """Run one worker until the supervisor stops: start it, and again each time it exits."""
        policy = RestartPolicy(self.config.backoff)
        loop = asyncio.get_running_loop()
        while True:
            process = await self._spawn(worker)
            started = loop.time()
            code = await self._watch(worker, process)
            if self._stopping.is_set():
                log.info("%s (pid %d) exited with %s", worker.name, process.pid, code)
                return
            delay = policy.delay(started_at=started, exited_at=loop.time())
            log.warning(
                "%s (pid %d) exited with %s: restarting it in %.1f s",
                worker.name, process.pid, code, delay,
            )  # fmt: skip
            if await _set_within(self._stopping, delay):
                return
            worker.restarts += 1

    async def _spawn(self, worker: ManagedWorker) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            *self._worker_command(worker), env=self._worker_env(), start_new_session=True
        )
        worker.process = process
        if self._stopping.is_set():  # stop() ran while it started, and did not see it
            worker.terminate()
        log.info("%s started (pid %d) on %s", worker.name, process.pid, worker.url)
        return process

    async def _watch(self, worker: ManagedWorker, process: asyncio.subprocess.Process) -> int:
        """Wait for the process to exit, noting meanwhile when it becomes ready."""
        readiness = asyncio.create_task(self._await_ready(worker, process))
        try:
            return await process.wait()
        finally:
            worker.ready = False
            readiness.cancel()
            await asyncio.gather(readiness, return_exceptions=True)

    async def _await_ready(
        self, worker: ManagedWorker, process: asyncio.subprocess.Process
    ) -> None:
        pool = Pool(LOOPBACK, worker.port, max_connections=1, connect_timeout_s=1.0)
        if await _until_ready(pool, self.config.ready_interval_s, process):
            self._worker_ready(worker, process)

    def _worker_ready(self, worker: ManagedWorker, process: asyncio.subprocess.Process) -> None:
        worker.ready = True
        again = " again" if worker.restarts else ""
        log.info("%s (pid %d) ready%s on %s", worker.name, process.pid, again, worker.url)
        if all(w.ready for w in self.workers):
            self._workers_ready.set()

    async def _announce(self) -> None:
        """Say once that the fleet is ready: every worker is, and the router has seen one."""
        await self._workers_ready.wait()
        host, port = parse_backend(self.router_url)
        await _until_ready(Pool(host, port, max_connections=1), self.config.ready_interval_s)
        count = len(self.workers)
        noun = "worker" if count == 1 else "workers"
        grpc = self._router.grpc_port if self._router is not None else None
        also = f" (gRPC on port {grpc})" if grpc else ""
        print(f"tailserve up: router on {self._public_url()}{also}, {count} {noun} ready",
              flush=True)  # fmt: skip
        self.ready.set()

    def _worker_command(self, worker: ManagedWorker) -> list[str]:
        return [
            sys.executable, "-m", "tailserve.cli", "serve",
            "--repository", self.config.repository,
            "--host", LOOPBACK,
            "--http-port", str(worker.port),
            "--grpc-port", "0",
            "--worker-id", worker.name,
            "--drain-timeout", str(self.config.drain_timeout_s),
            *self.config.worker_args,
        ]  # fmt: skip

    def _worker_env(self) -> dict[str, str] | None:
        # The token travels in the environment, where `ps` does not show it to other users.
        if self.config.admin_token is None:
            return None
        return {**os.environ, "TAILSERVE_ADMIN_TOKEN": self.config.admin_token}


async def _until_ready(
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


async def _set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


def _task(coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    task = asyncio.create_task(coroutine, name=name)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
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
