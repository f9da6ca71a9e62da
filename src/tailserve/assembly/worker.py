"""One worker process: owns the socket, the signals, the model manager and the shutdown order.

Start: listen at once (live), load and warm every model in the background, then report ready.
SIGTERM or SIGINT, once or repeated within a few seconds (`loops.StopSignals`): report unready,
stop accepting, let every request in flight finish (up to the drain timeout), close the models,
exit 0. SIGQUIT, or a signal after those seconds, cuts the drain short.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailserve.cache.redis import RedisTier, connect, node_url, parse_url, secured_url
from tailserve.cache.replies import ReplyMemo
from tailserve.cache.resp import LeanRedis
from tailserve.cache.tiered import ResultCache
from tailserve.engine import traffic
from tailserve.engine.dataplane import DataPlane
from tailserve.engine.pipeline_host import DataPlaneHost
from tailserve.engine.served import Served, ServedPipeline, VersionBuilder
from tailserve.errors import ConfigError
from tailserve.jobs.desk import JobDesk
from tailserve.jobs.records import id_prefix
from tailserve.jobs.runner import JobRunner, RunnerConfig
from tailserve.jobs.store import JobStore, MemoryJobStore
from tailserve.jobs.webhook import Webhooks
from tailserve.modelconfig import FeaturesConfig
from tailserve.observability.loop_lag import LoopLag
from tailserve.observability.metrics import CostRow, Metrics
from tailserve.observability.trace_log import TraceRecorder
from tailserve.observability.tracing import CacheMarks, StageMarks, Tracing, start_tracing
from tailserve.process.collector import FullCollections, freeze_held
from tailserve.process.loops import Stop, StopSignals
from tailserve.protocols.http.app import HttpApp, SlowFault
from tailserve.repository.manager import ModelManager
from tailserve.settings import Settings
from tailserve.transport.admin_access import AdminAccess, admin_access
from tailserve.transport.server import HttpServer

if TYPE_CHECKING:
    from tailserve.cache.feature_store import FeatureStore
    from tailserve.cache.features import FeatureResolver
    from tailserve.protocols.grpc.service import InferenceService
    from tailserve.transport.http2 import Http2Server

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, settings: Settings, *, tracing: Tracing | None = None) -> None:
        self.settings = settings = _checked(settings)
        self._subscriptions = 0
        self.metrics = Metrics()
        self.loop_lag = LoopLag(on_sample=self.metrics.loop_lag.child().observe)
        self.collections = (
            FullCollections(
                settings.gc_full_interval_s, on_pause=self.metrics.gc_full_pause.child().observe
            )
            if settings.gc_full_interval_s > 0
            else None
        )
        self.worker_id = settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self._l2 = self._redis_tier()
        self.cache = ResultCache(redis=self._l2, worker_id=self.worker_id, observer=self.metrics)
        # OpenTelemetry (observability/tracing.py): None unless an endpoint is set (or a test
        # gives its own); the cache and pipelines then note their moments for the spans.
        self.tracing = tracing or start_tracing(
            "tailserve-worker", endpoint=settings.otel_endpoint, sample=settings.otel_sample
        )
        if self.tracing is not None:
            self.cache.observer = CacheMarks(self.metrics)
        # Made when the first model that reads the feature store loads.
        self.feature_store: FeatureStore | None = None
        self.manager, self.dataplane = self._data_plane()
        memo = (
            ReplyMemo(int(settings.reply_memo_mb * 2**20)) if settings.reply_memo_mb > 0 else None
        )
        self.metrics.watch_cache(self.cache, memo)
        self.recorder = None
        if settings.trace_file:
            self.recorder = TraceRecorder(Path(settings.trace_file), sample=settings.trace_sample)
        self.admin_access = admin_access(settings.host, settings.admin_token)
        self.job_store, self.job_runner, self.jobs = self._jobs()
        self.app = self._http_app(memo)
        self._loading: asyncio.Task[None] | None = None
        self._http: HttpServer | None = None
        # Set by the request to stop (SIGTERM, SIGINT, `request_exit`); `_forced` by SIGQUIT
        # or a signal after the grace window, which cuts the drain short.
        self._exit = asyncio.Event()
        self._forced = asyncio.Event()
        self._signals = StopSignals(self._stop_requested, forcing="requests in flight fail")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grpc: Http2Server | None = None  # the gRPC port's server, while it serves
        self._grpc_service: InferenceService | None = None
        self.loaded = asyncio.Event()

    def _data_plane(self) -> tuple[ModelManager[Served], DataPlane]:
        """The models (their builder and catalogue) and the data plane over them."""
        settings = self.settings
        assert settings.repository is not None  # (`_checked`)
        builder = VersionBuilder(
            observer=self.metrics,
            loop=self.loop_lag,
            cache=self.cache,
            feature_resolver=self._feature_resolver if settings.redis_url else None,
            drain_timeout_s=settings.drain_timeout_s,
        )
        manager = ModelManager(
            Path(settings.repository),
            builder,
            on_ready_change=self.metrics.set_model_ready,
            budget_bytes=int(settings.model_memory_mb * 2**20),
            pinned=settings.pinned(),
            eviction="traffic" if settings.model_eviction == "traffic" else "lru",
            observer=self.metrics,
        )
        residency = manager.residency
        self.metrics.watch_residency(lambda: (residency.budget, residency.resident()))
        dataplane = DataPlane(manager, strict_readiness=settings.strict_readiness, cache=self.cache)
        dataplane.on_served = self.metrics.on_served
        self.metrics.watch_slos(self._slos)
        builder.pipeline_host = DataPlaneHost(dataplane)
        builder.pipeline_observer = (
            self.metrics if self.tracing is None else StageMarks(self.metrics)
        )
        self.metrics.watch_costs(self._cost_rows)
        return manager, dataplane

    def _jobs(self) -> tuple[JobStore, JobRunner, JobDesk]:
        """The job store, the runner that works its jobs, and the desk that takes them."""
        store = self._job_store()
        runner = JobRunner(
            store,
            self.dataplane,
            worker=self.worker_id,
            config=RunnerConfig(concurrency=self.settings.jobs_concurrency),
            webhooks=Webhooks(on_outcome=self._webhook_outcome),
            loop=self.loop_lag,
            observer=self.metrics,
        )
        desk = JobDesk(
            store,
            self.dataplane,
            # In-process jobs live in this worker: their ids name it, for the front door.
            id_prefix="" if store.durable else id_prefix(self.worker_id),
            pressed=runner.pressed,
        )
        self.metrics.jobs_running.set_function(lambda: runner.running)
        return store, runner, desk

    def _http_app(self, memo: ReplyMemo | None) -> HttpApp:
        settings = self.settings
        return HttpApp(
            self.dataplane,
            self.metrics,
            admin_token=settings.admin_token,
            admin_access=self.admin_access,
            recorder=self.recorder,
            reply_memo=memo,
            jobs=self.jobs,
            tracing=self.tracing,
            grpc=self._grpc_bridge(),
            slow_fault=(
                SlowFault(settings.fault_slow_fraction, settings.fault_slow_factor)
                if settings.fault_slow_fraction > 0
                else None
            ),
        )

    def _redis_client(self, **options: Any) -> Any:
        assert self.settings.redis_url is not None
        return connect(self.settings.redis_url, cluster=self.settings.redis_cluster, **options)

    def _job_store(self) -> JobStore:
        visibility = self.settings.jobs_visibility_timeout_s
        if not self.settings.redis_url:
            return MemoryJobStore(visibility_timeout_s=visibility)
        from tailserve.jobs.redis_store import RedisJobStore

        return RedisJobStore(self._redis_client(timeout_s=1.0), visibility_timeout_s=visibility)

    async def _webhook_outcome(
        self, job_id: str, attempts: int, delivered: bool | None, error: str | None
    ) -> None:
        await self.job_store.note_webhook(
            job_id, attempts=attempts, delivered=delivered, error=error
        )

    def _redis_tier(self) -> RedisTier | None:
        if not self.settings.redis_url:
            return None
        observe = self.metrics.cache_l2_latency.child().observe
        fast = None
        # The lean connection speaks plain TCP: over TLS (rediss://) or a socket file, the
        # hot path stays with redis-py.
        lean = self.settings.redis_url.startswith("redis://")
        if self.settings.redis_client == "lean" and not self.settings.redis_cluster and lean:
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
        # no socket timeout: it waits for messages. On a cluster, the node the URL names first,
        # then in turn those the cluster client knows: the one named may be the one that died.
        url = self.settings.redis_url
        assert url is not None
        turn, self._subscriptions = self._subscriptions, self._subscriptions + 1
        if turn and self.settings.redis_cluster and self._l2 is not None:
            nodes = self._l2.client.get_nodes()
            if nodes:
                node = nodes[(turn - 1) % len(nodes)]
                url = node_url(url, node.host, node.port)
        return connect(url, timeout_s=1.0, socket_timeout=None)

    def _feature_resolver(self, config: FeaturesConfig) -> FeatureResolver:
        from tailserve.cache.feature_store import FeatureStore
        from tailserve.cache.features import FeatureResolver

        if self.feature_store is None:
            self.feature_store = FeatureStore(
                self._redis_client(), cluster=self.settings.redis_cluster
            )
        return FeatureResolver(config, self.feature_store, time.monotonic, observer=self.metrics)

    def _slos(self) -> dict[str, float]:
        """Each model's p99 objective, seconds (a cold model's as last read)."""
        return {
            state.name: state.config.slo.p99_ms / 1e3
            for state in self.manager.states()
            if state.config is not None
        }

    def _cost_rows(self) -> list[CostRow]:
        rows = []
        for state in self.manager.states():
            for version, served in list(state.versions.items()):
                if isinstance(served, ServedPipeline):
                    continue
                for label, cost in served.scheduler.batcher.costs().items():
                    rows.append(
                        CostRow(state.name, str(version), label, cost.fixed_s, cost.per_row_s)
                    )
        return rows

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until SIGTERM or SIGINT (or `request_exit`), then drain and stop."""
        if self.settings.gil_switch_interval_ms > 0:
            # Process-wide, like the freeze below: a worker is its own process.
            sys.setswitchinterval(self.settings.gil_switch_interval_ms / 1e3)
        self._loop = asyncio.get_running_loop()
        self._signals.install(self._loop)
        try:
            await self._start()
            self._http = HttpServer(
                self.app,
                max_body_bytes=self.settings.max_body_bytes,
                keep_alive_s=self.settings.keep_alive_s,
                read_timeout_s=self.settings.read_timeout_s,
                head_timeout_s=self.settings.head_timeout_s,
                access_log=self.settings.access_log,
            )
            await self._http.start(
                self.settings.host,
                self.settings.http_port,
                sockets=sockets,
                backlog=self.settings.backlog,
            )
            counts: list[traffic.Counts] = [self._http]
            if self._grpc_service is not None:
                counts.append(self._grpc_service.traffic)
            self.loop_lag.requests = lambda: traffic.total(counts)
            self.metrics.watch_traffic(self.loop_lag.requests)
            log.info("HTTP on %s:%d", self.settings.host, self._http.port)
            if self.admin_access is AdminAccess.CLOSED:
                log.warning(
                    "admin routes closed: listening on %s, beyond loopback, with no "
                    "admin token (set --admin-token or TAILSERVE_ADMIN_TOKEN to use "
                    "them)",
                    self.settings.host,
                )
            await self._exit.wait()
            # No new requests; those in flight finish (up to the drain timeout), then the
            # connections close.
            drains = [self._http.drain(self.settings.drain_timeout_s, self._forced)]
            if self._grpc is not None:
                drains.append(self._grpc.drain(self.settings.drain_timeout_s, self._forced))
            await asyncio.gather(*drains)
        finally:
            await self._stop()
            self._signals.remove()

    def request_exit(self, *, force: bool = False) -> None:
        """Begin the graceful shutdown, as SIGTERM does (``force``: as SIGQUIT does, cutting
        the drain short). Safe to call from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._signals.received("request_exit", force)
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._signals.received("request_exit", force)
        else:
            loop.call_soon_threadsafe(self._signals.received, "request_exit", force)

    def _stop_requested(self, stop: Stop) -> None:
        if stop is Stop.SAME:
            return
        self._begin_drain()
        if stop is Stop.FORCE:
            self._forced.set()
        self._exit.set()

    def _begin_drain(self) -> None:
        if not self.dataplane.draining:
            log.info("draining: no new requests; finishing those in flight")
        self.dataplane.draining = True

    async def _start(self) -> None:
        self.loop_lag.start()
        if self.collections is not None:
            self.collections.start(asyncio.get_running_loop())
        await self._start_grpc()
        if self.cache.redis is not None:
            await self.cache.redis.connect()
            self.cache.start_listening(self._pubsub_client)
        self._loading = asyncio.create_task(self._load_models(), name="load-models")
        if self.settings.jobs_concurrency > 0:
            self.job_runner.start()

    async def _stop(self) -> None:
        self.dataplane.draining = True
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None
        if self._http is not None:
            self._http.close()
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._loading is not None:
            await asyncio.gather(self._loading, return_exceptions=True)
        # The jobs held go back to their queues before their models close.
        await self.job_runner.close()
        await self.job_store.close()
        await self.manager.close()
        await self.cache.close()
        if self.feature_store is not None:
            await self.feature_store.close()
        self.loop_lag.stop()
        if self.collections is not None:
            self.collections.stop()
        if self.recorder is not None:
            self.recorder.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # (what is still batched goes out first)

    def _grpc_bridge(self) -> Any:
        """Unary gRPC calls on the HTTP port, as the front door forwards them (None where
        grpcio is not installed). Its service's calls are not counted twice in the loop's
        backlog: the HTTP server counts them."""
        try:
            from tailserve.protocols.grpc.over_http1 import GrpcOverHttp1
            from tailserve.protocols.grpc.service import InferenceService
        except ImportError:
            return None
        return GrpcOverHttp1(InferenceService(self.dataplane, self.metrics, self.tracing))

    async def _start_grpc(self) -> None:
        """The Open Inference Protocol over gRPC on ``grpc_port`` (0: none), served by the
        worker's HTTP/2 server (`protocols.grpc.over_http2`). A worker that cannot serve it
        (the grpc extra not installed, the port taken) says so and serves HTTP: the requests
        that can be served still are."""
        port = self.settings.grpc_port
        if not port:
            return
        try:
            from tailserve.protocols.grpc.over_http2 import GrpcOverHttp2
            from tailserve.protocols.grpc.service import InferenceService
            from tailserve.transport.http2 import Http2Server
        except ImportError as exc:
            log.error("worker: no gRPC on port %d: %s (pip install 'tailserve[grpc]')", port, exc)
            return
        limit = self.settings.max_body_bytes
        self._grpc_service = InferenceService(self.dataplane, self.metrics, self.tracing)
        server = Http2Server(
            GrpcOverHttp2(self._grpc_service, max_message_bytes=limit),
            max_body_bytes=limit,
            read_timeout_s=self.settings.read_timeout_s,
        )
        try:
            await server.start(self.settings.host, port, backlog=self.settings.backlog)
        except OSError as exc:
            host = self.settings.host
            log.error("worker: no gRPC on %s:%d: %s; serving HTTP only", host, port, exc)
            return
        self._grpc = server
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
        freeze_held()
        self.dataplane.initial_load_done = True
        self.loaded.set()
        states = self.manager.states()
        cold = sum(state.cold for state in states)
        log.info(
            "ready: %d model(s) serving%s",
            sum(state.ready for state in states),
            f", {cold} loaded on demand (memory budget)" if cold else "",
        )


def _checked(settings: Settings) -> Settings:
    """The settings a worker can start with: a repository that is a folder, and the Redis URL
    with its password and TLS files in it (redis+cluster://... as redis://... on a cluster)."""
    if not settings.repository:
        raise ConfigError("no model repository given (--repository DIR)")
    if not Path(settings.repository).is_dir():
        raise ConfigError(f"model repository {settings.repository} is not a folder")
    if not settings.redis_url:
        return settings
    url, cluster = parse_url(settings.redis_url, cluster=settings.redis_cluster)
    url = secured_url(
        url,
        password=settings.redis_password,
        password_file=settings.redis_password_file,
        ca_file=settings.redis_tls_ca_file,
        cert_file=settings.redis_tls_cert_file,
        key_file=settings.redis_tls_key_file,
    )
    return settings.replace(redis_url=url, redis_cluster=cluster)
