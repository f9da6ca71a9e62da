"""One worker process: owns the socket, the signals, the model manager and the shutdown order.

Start: listen at once (live), load and warm every model in the background, then report ready.
SIGTERM: report unready, stop accepting, let every request in flight finish (up to the drain
timeout), close the models, exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from tailserve.cache.redis import RedisTier, connect
from tailserve.cache.resp import LeanRedis
from tailserve.cache.tiered import ResultCache
from tailserve.engine.dataplane import DataPlane
from tailserve.errors import ConfigError
from tailserve.observability.loop_lag import LoopLag
from tailserve.observability.metrics import CostRow, Metrics
from tailserve.observability.trace_log import TraceRecorder
from tailserve.protocols.grpc.startup import serve_or_log
from tailserve.protocols.http.app import HttpApp, SlowFault
from tailserve.protocols.http.timing import TimedHttpToolsProtocol
from tailserve.repository.config import FeaturesConfig
from tailserve.repository.manager import ModelManager
from tailserve.settings import Settings

if TYPE_CHECKING:
    from tailserve.cache.features import FeatureResolver, FeatureStore

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler, do not re-raise the signal after shutdown: a drained
        # worker exits 0.
        self._on_exit()
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


class Worker:
    def __init__(self, settings: Settings) -> None:
        if not settings.repository:
            raise ConfigError("no model repository given (--repository DIR)")
        if not Path(settings.repository).is_dir():
            raise ConfigError(f"model repository {settings.repository} is not a folder")
        self.settings = settings
        self.metrics = Metrics()
        self.loop_lag = LoopLag(on_sample=self.metrics.loop_lag.child().observe)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.cache = ResultCache(
            redis=self._redis_tier(), worker_id=self.worker_id, observer=self.metrics
        )
        self.metrics.cache_source = self.cache
        # Made when the first model that reads the feature store loads.
        self.feature_store: FeatureStore | None = None
        self.manager = ModelManager(
            Path(settings.repository),
            observer=self.metrics,
            on_ready_change=self.metrics.set_model_ready,
            drain_timeout_s=settings.drain_timeout_s,
            loop=self.loop_lag,
            cache=self.cache,
            feature_resolver=self._feature_resolver if settings.redis_url else None,
        )
        self.dataplane = DataPlane(
            self.manager, strict_readiness=settings.strict_readiness, cache=self.cache
        )
        self.metrics.cost_source = self._cost_rows
        self.recorder = None
        if settings.trace_file:
            self.recorder = TraceRecorder(Path(settings.trace_file), sample=settings.trace_sample)
        self.app = HttpApp(
            self.dataplane,
            self.metrics,
            max_body_bytes=settings.max_body_bytes,
            admin_token=settings.admin_token,
            lifespan=self._lifespan,
            recorder=self.recorder,
            slow_fault=(
                SlowFault(settings.fault_slow_fraction, settings.fault_slow_factor)
                if settings.fault_slow_fraction > 0
                else None
            ),
        )
        self._loading: asyncio.Task[None] | None = None
        self._uvicorn: _Uvicorn | None = None
        self._grpc: Any = None  # grpc.aio.Server, while it serves
        self.loaded = asyncio.Event()

    def _redis_client(self, **options: Any) -> Any:
        assert self.settings.redis_url is not None
        return connect(self.settings.redis_url, cluster=self.settings.redis_cluster, **options)

    def _redis_tier(self) -> RedisTier | None:
        if not self.settings.redis_url:
            return None
        observe = self.metrics.cache_l2_latency.child().observe
        fast = None
        if self.settings.redis_client == "lean" and not self.settings.redis_cluster:
            fast = LeanRedis(self.settings.redis_url)
        elif self.settings.redis_client not in ("lean", "redis-py"):
            raise ConfigError(
                f"redis_client must be 'lean' or 'redis-py', not {self.settings.redis_client!r}"
            )
        return RedisTier(
            self._redis_client(),
            budget_s=self.settings.cache_l2_budget_ms / 1e3,
            cluster=self.settings.redis_cluster,
            fast=fast,
            on_latency=observe,
            on_skip=lambda operation, reason, count: self.metrics.cache_l2_skipped.add(
                count, operation, reason
            ),
            loop_lag=lambda: self.loop_lag.lag_s,
        )

    def _pubsub_client(self) -> Any:
        # Pub/sub needs a plain connection (on a cluster, any node hears every PUBLISH), and
        # no socket timeout: it waits for messages.
        assert self.settings.redis_url is not None
        return connect(self.settings.redis_url, timeout_s=1.0, socket_timeout=None)

    def _feature_resolver(self, config: FeaturesConfig) -> FeatureResolver:
        from tailserve.cache.features import FeatureResolver, FeatureStore

        if self.feature_store is None:
            self.feature_store = FeatureStore(self._redis_client())
        return FeatureResolver(config, self.feature_store, time.monotonic, observer=self.metrics)

    def _cost_rows(self) -> list[CostRow]:
        rows = []
        for state in self.manager.states():
            for version, served in list(state.versions.items()):
                for label, cost in served.scheduler.batcher.costs().items():
                    rows.append(CostRow(state.name, str(version), label, cost.fixed_s,
                                        cost.per_row_s))  # fmt: skip
        return rows

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if self.settings.gil_switch_interval_ms > 0:
            # Process-wide, like gc.freeze below: a worker is its own process.
            sys.setswitchinterval(self.settings.gil_switch_interval_ms / 1e3)
        config = uvicorn.Config(
            self.app,
            host=self.settings.host,
            port=self.settings.http_port,
            # httptools, noting when each request began to arrive (its deadline's start).
            http=TimedHttpToolsProtocol,
            loop="none",
            lifespan="on",
            access_log=self.settings.access_log,
            log_config=None,
            log_level=self.settings.log_level,
            timeout_graceful_shutdown=int(self.settings.drain_timeout_s),
            backlog=self.settings.backlog,
            server_header=False,
            # No X-Forwarded-* rewriting: it wraps every request, and a worker trusts no proxy.
            proxy_headers=False,
        )
        self._uvicorn = _Uvicorn(config, on_exit=self._begin_drain)
        await self._uvicorn.serve(sockets=sockets)

    def request_exit(self) -> None:
        """Begin the same graceful shutdown SIGTERM begins (for in-process use and tests)."""
        self._begin_drain()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def _begin_drain(self) -> None:
        if not self.dataplane.draining:
            log.info("draining: no new requests; finishing those in flight")
        self.dataplane.draining = True

    async def _lifespan(
        self, receive: Callable[[], Awaitable[dict[str, Any]]], send: Callable[..., Awaitable[None]]
    ) -> None:
        await receive()  # lifespan.startup
        self.loop_lag.start()
        await self._start_grpc()
        if self.cache.redis is not None:
            await self.cache.redis.connect()
            self.cache.start_listening(self._pubsub_client)
        self._loading = asyncio.create_task(self._load_models(), name="load-models")
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown: uvicorn has already waited for connections
        self.dataplane.draining = True
        if self._grpc is not None:  # calls in flight finish (up to the drain timeout)
            await self._grpc.stop(self.settings.drain_timeout_s)
            self._grpc = None
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._loading is not None:
            await asyncio.gather(self._loading, return_exceptions=True)
        await self.manager.close()
        await self.cache.close()
        if self.feature_store is not None:
            await self.feature_store.close()
        self.loop_lag.stop()
        if self.recorder is not None:
            self.recorder.close()
        await send({"type": "lifespan.shutdown.complete"})

    async def _start_grpc(self) -> None:
        """The Open Inference Protocol over gRPC on ``grpc_port`` (0: none). A worker that
        cannot serve it (grpcio not installed, the port taken) says so and serves HTTP: the
        requests that can be served still are."""

        def build() -> Any:
            from tailserve.protocols.grpc.service import InferenceService

            return InferenceService(self.dataplane, self.metrics).handlers()

        port = self.settings.grpc_port
        self._grpc = await serve_or_log(build, self.settings.host, port,
                                        max_message_bytes=self.settings.max_body_bytes,
                                        what="worker")  # fmt: skip
        if self._grpc is None:
            return
        log.info("gRPC (OIP v2) on %s:%d", self.settings.host, port)

    async def _load_models(self) -> None:
        try:
            failed = await self.manager.load_all()
        except Exception:
            log.exception("loading the model repository failed")
            raise
        if failed:
            log.error("models that failed to load: %s", ", ".join(failed))
        # Objects that live as long as the models (sessions, boosters, configs) leave the
        # collector's generations: full collections over them paused requests for 65-85 ms.
        gc.collect()
        gc.freeze()
        self.dataplane.initial_load_done = True
        self.loaded.set()
        log.info("ready: %d model(s) serving", sum(s.ready for s in self.manager.states()))
