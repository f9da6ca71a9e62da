"""``tailserve route``: the Python routing lane, behind the front door.

The router runs the worker's HTTP/1.1 server (transport/server.py) with `RouterApp`
(router/router_app.py) as its application, so it reads requests as a worker does: whole (none over
``max_body_bytes``: 413), keep-alive, pipelined requests answered in order, idle connections
closed after ``keep_alive_s`` and late requests refused (408) after ``read_timeout_s``. Replies
from the backends come back whole too; large bodies go straight through the front door, and
this lane takes the slow request classes, where hedging pays.

This module owns the process: the `Dispatcher` (replica choice, hedging, retries, ejection,
shedding), membership and health checks, the gRPC front, and the drain on SIGTERM or SIGINT
(repeated within a few seconds, the same request to stop; SIGQUIT, or one after those seconds,
cuts the drain short: `loops.StopSignals`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tailserve.observability.tracing import Tracing, start_tracing
from tailserve.process.collector import freeze_held
from tailserve.process.loops import Stop, StopSignals
from tailserve.protocols.grpc.startup import serve_or_log
from tailserve.router.config import RouterConfig
from tailserve.router.dispatch import Dispatcher
from tailserve.router.membership import Membership
from tailserve.router.router_app import RouterApp, backends_state
from tailserve.router.router_metrics import RouterMetrics
from tailserve.transport.server import HttpServer

log = logging.getLogger(__name__)


class Router:
    """The lane: a `Dispatcher` behind the HTTP server (and the gRPC front)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._dispatcher: Dispatcher | None = None
        self._http: HttpServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.draining = False
        self.port = config.port
        # The gRPC front (`grpc_gateway`), while it serves; its port once bound.
        self._grpc: Any = None
        self.grpc_port: int | None = None
        # OpenTelemetry (router/route_spans.py): None unless an endpoint is set.
        self.tracing: Tracing | None = None

    @property
    def dispatcher(self) -> Dispatcher:
        assert self._dispatcher is not None, "the router has not started"
        return self._dispatcher

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.dispatcher.loop

    @property
    def metrics(self) -> RouterMetrics:
        return self.dispatcher.metrics

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Read the membership, check every backend once, then listen."""
        config = self.config
        dispatcher = self._dispatcher = Dispatcher(config)
        membership = Membership(config, dispatcher.set_members)
        await membership.refresh()
        await dispatcher.check_all()
        loop = dispatcher.loop
        self._tasks = [
            loop.create_task(dispatcher.run_health()),
            loop.create_task(membership.run()),
        ]
        self.tracing = self.tracing or start_tracing(
            "tailserve-router", endpoint=config.otel_endpoint, sample=config.otel_sample
        )
        self._http = HttpServer(
            RouterApp(dispatcher, ready=self.ready, tracing=self.tracing),
            max_body_bytes=config.max_body_bytes,
            keep_alive_s=config.keep_alive_s,
            read_timeout_s=config.read_timeout_s,
        )
        await self._http.start(config.host, config.port)
        self.port = self._http.port
        log.info(
            "router on %s: %d backends, policy %s, hedging %s",
            self.url,
            len(dispatcher.upstreams),
            config.balance,
            "on" if config.hedge else "off",
        )
        await self._start_grpc()
        # What the router holds for its life (modules, the dispatcher, the gRPC stack) leaves
        # the collector's generations: a full collection over it stalled every request in
        # flight for 16-22 ms, a few times a run, which was the p99.9 of a healthy pool.
        freeze_held()

    async def _start_grpc(self) -> None:
        """The Open Inference Protocol's gRPC service on ``grpc_port`` (0: none), sent on to
        the workers over HTTP. A router that cannot serve it (grpcio not installed, the port
        taken) says so and serves HTTP."""

        def build() -> Any:
            from tailserve.router.grpc_gateway import Gateway

            return Gateway(self).handlers()

        port = self.config.grpc_port
        self._grpc = await serve_or_log(
            build,
            self.config.host,
            port,
            max_message_bytes=self.config.max_body_bytes,
            what="router",
        )
        if self._grpc is None:
            return
        self.grpc_port = port
        log.info("router: gRPC on %s:%d, sent on to the workers over HTTP", self.config.host, port)

    async def drain(
        self, timeout_s: float | None = None, forced: asyncio.Event | None = None
    ) -> None:
        """Stop accepting, let the requests in flight finish (up to the timeout, or until
        ``forced`` is set), close."""
        self.draining = True
        timeout = self.config.drain_timeout_s if timeout_s is None else timeout_s
        # gRPC calls in flight finish too (up to the same timeout); new ones are refused.
        grpc_stop = None
        if self._grpc is not None:
            grpc_stop = self.loop.create_task(_stop_grpc(self._grpc, timeout, forced))
            self._grpc = None
        if self._http is not None:
            # What is left after the timeout is cancelled: its copies are withdrawn.
            await self._http.drain(timeout, forced)
        if grpc_stop is not None:
            await grpc_stop
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._dispatcher is not None:
            await self._dispatcher.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # (what is still batched goes out first)

    async def serve(self) -> None:
        """Run until SIGTERM or SIGINT, then drain (SIGQUIT cuts the drain short)."""
        stop, forced = asyncio.Event(), asyncio.Event()

        def act(decision: Stop) -> None:
            if decision is Stop.FORCE:
                forced.set()
            stop.set()

        signals = StopSignals(act, forcing="requests in flight fail")
        signals.install(asyncio.get_running_loop())
        try:
            await self.start()
            await stop.wait()
            log.info("router draining")
            await self.drain(forced=forced)
        finally:
            signals.remove()

    def knows(self, model: str) -> bool:
        # (Only models some backend lists become metric labels: a client cannot grow the
        # label set by inventing model names.)
        return model in self.dispatcher.known_models()

    def ready(self) -> bool:
        """Some backend is in service, and the router is not draining."""
        now = self.loop.time()
        return not self.draining and any(b.in_service(now) for b in self.dispatcher.backends)

    def state(self) -> dict[str, object]:
        """Each backend's routing state and the budgets' counters (``/router/backends``)."""
        return backends_state(self.dispatcher)


async def _stop_grpc(server: Any, timeout_s: float, forced: asyncio.Event | None) -> None:
    """Stop a grpc.aio server with ``timeout_s`` of grace, none once ``forced`` is set (a
    second stop with less grace ends the first sooner: grpc.aio's rule)."""
    stopping = asyncio.ensure_future(server.stop(timeout_s))
    if forced is None:
        await stopping
        return
    cut = asyncio.ensure_future(forced.wait())
    try:
        await asyncio.wait((stopping, cut), return_when=asyncio.FIRST_COMPLETED)
        if cut.done():
            await server.stop(0)
        await stopping
    finally:
        cut.cancel()
