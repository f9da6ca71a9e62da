"""The stack of `tailserve up`, assembled and supervised: workers on loopback ports, the front
door in front.

Start: choose free loopback ports for each worker (HTTP, and gRPC when the stack serves it),
start the admin lane (the fleet's own routes, `fleet.admin_lane`), write the front door's config
(`frontdoor.render`) and start HAProxy on it (`frontdoor.haproxy`), then start each worker
(`tailserve serve`). Nothing waits for models to load: HAProxy checks each model's readiness on
each worker and sends a model's requests only where it is ready. The supervisor watches
readiness too, to report it (`/v2/fleet`) and to say once that the fleet is ready.

A worker that exits is started again on the same ports (the front door's config names them),
after a delay that doubles while it keeps dying (`RestartPolicy`); so does the front door.
When the repository's models change (a load through the admin lane), the front door is
reloaded with one backend a model, without dropping a connection.

SIGTERM, SIGINT or SIGHUP, to the supervisor alone or to its whole process group, once or
repeated within a few seconds (as make or a shell passing it on delivers it twice): the front
door drains first (it stops listening; requests in flight finish), then every worker gets
SIGTERM and drains itself; a worker still running after the drain timeout is killed. SIGQUIT,
or a signal after those seconds, kills every worker and the front door at once
(`loops.StopSignals`). The front door and the workers run in sessions of their own (at the
supervisor's session's CPU priority: `process.sessions`), so a signal to the group reaches only
the supervisor, which keeps that order; the price is that a supervisor killed with SIGKILL
leaves them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailserve.assembly.child_commands import (
    descriptor_limit,
    lane_command,
    repository_models,
    worker_command,
)
from tailserve.assembly.hugepages import with_huge_pages
from tailserve.assembly.scaling import Scaler, ScalingPlan
from tailserve.errors import ConfigError, UpstreamError
from tailserve.fleet import gpus
from tailserve.fleet.admin_lane import AdminLane, Slot
from tailserve.fleet.processes import (
    LOOPBACK,
    ManagedWorker,
    Role,
    free_ports,
    owned_task,
    prediction,
    set_within,
    until_ok,
    until_ready,
)
from tailserve.fleet.restarts import Backoff, RestartPolicy, front_door_backoff
from tailserve.frontdoor.haproxy import HAProxy, await_server_script, grpc_ejection_script
from tailserve.frontdoor.render import (
    SERVING_WEIGHT,
    FrontDoorPolicy,
    Listen,
    Member,
    render,
    worker_backends,
)
from tailserve.process.loops import STOP_SIGNALS, Stop, StopSignals
from tailserve.process.sessions import start_session
from tailserve.router.config import backend_url
from tailserve.router.lanes import DEFAULT_THRESHOLD_MS, slow_models
from tailserve.transport.admin_access import AdminAccess, admin_access
from tailserve.transport.http1 import Pool, frame_request
from tailserve.transport.server import HttpServer

log = logging.getLogger(__name__)

# SIGHUP too: the workers are in sessions of their own, so a closed terminal would otherwise
# kill the supervisor alone and leave them running.
SHUTDOWN_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP)
# Beyond the drain timeout, the time a drained worker has to close its models and exit.
EXIT_GRACE_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    repository: str
    host: str = LOOPBACK
    port: int = 8080
    # The front door's gRPC port (the Open Inference Protocol's gRPC service, spread over the
    # workers' own gRPC ports; 0: none, as here; `tailserve up` listens on 8081).
    grpc_port: int = 0
    workers: int = 1
    # The front door's policy (balancing, admission, retries, ejection).
    policy: FrontDoorPolicy = field(default_factory=FrontDoorPolicy)
    # The workers' admin routes need it (and so the fleet's, which pass it on).
    admin_token: str | None = None
    # The password of --redis-url, taken out of it: it reaches the workers by the environment.
    redis_password: str | None = None
    drain_timeout_s: float = 30.0
    # More `tailserve serve` flags, the same for every worker (--redis-url URL).
    worker_args: tuple[str, ...] = ()
    # Jobs are kept in each worker's memory (no Redis): the front door routes a job's id to
    # the worker that holds it, and the admin lane lists every worker's.
    jobs_in_process: bool = True
    log_level: str = "info"
    ready_interval_s: float = 0.25
    backoff: Backoff = field(default_factory=Backoff)
    # The hedging lane: models predicted slower than this for one row (0: none by cost) and
    # the models named here go through `tailserve route`, which hedges them.
    hedge_lane_ms: float = DEFAULT_THRESHOLD_MS
    hedge_models: tuple[str, ...] = ()
    # More `tailserve route` flags for the lane (--otel-endpoint URL).
    lane_args: tuple[str, ...] = ()
    # How often the workers' cost models are read to sort the models into lanes.
    classify_interval_s: float = 5.0
    # Autoscaling between bounds, with a warm pool (None: `workers` serve, always).
    scaling: ScalingPlan | None = None
    # The GPUs the workers are spread over, one each (CUDA_VISIBLE_DEVICES; empty: the CPU).
    gpus: tuple[str, ...] = ()

    @property
    def lane(self) -> bool:
        return self.hedge_lane_ms > 0 or bool(self.hedge_models)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, not {self.workers}")
        if self.scaling is not None and not (
            self.scaling.scaling.min_workers <= self.workers <= self.scaling.scaling.max_workers
        ):
            raise ConfigError(
                f"the workers to start with ({self.workers}) must be within --min-workers "
                f"and --max-workers"
            )
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must be at least 0, not {self.drain_timeout_s}")


class Supervisor:
    """The front door and N workers, from one event loop: `start`, then `stop` (or `run`,
    which waits for a signal in between)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.workers: list[ManagedWorker] = []
        # Set once, when every worker has been ready and the front door too (the first start).
        self.ready = asyncio.Event()
        self._workers_ready = asyncio.Event()
        self._signalled = asyncio.Event()
        self._run_dir = tempfile.TemporaryDirectory(prefix="tailserve-up-")
        self.front_door_process = HAProxy(Path(self._run_dir.name))
        # The hedging lane's workers: those in the rotation (it watches the file).
        self._lane_backends = Path(self._run_dir.name) / "lane-backends"
        self._admin = AdminLane(self, admin_access(config.host, config.admin_token))
        self._admin_server = HttpServer(self._admin, max_body_bytes=16 * 1024 * 1024)
        self._models: dict[str, float] = {}
        self._stats_port = 0
        self._listen_port = 0
        # The hedging lane's process (`tailserve route`), where there is one, and the models
        # it takes.
        self.lane: ManagedWorker | None = None
        self.slow: frozenset[str] = frozenset(config.hedge_models)
        self._keepers: dict[str, asyncio.Task[None]] = {}  # a running slot's (and the lane's)
        self._door_keeper: asyncio.Task[None] | None = None
        self._announcer: asyncio.Task[None] | None = None
        self._classifier: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self.scaler = None if config.scaling is None else Scaler(self, config.scaling)
        self._scaling: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The front door's HTTP port."""
        if not self._listen_port:
            raise RuntimeError("the supervisor has not started")
        return self._listen_port

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the front door."""
        wildcard = {"0.0.0.0": LOOPBACK, "": LOOPBACK, "::": "::1"}
        return backend_url(wildcard.get(self.config.host, self.config.host), self.port)

    # --- the admin lane's view (fleet.admin.Fleet) ---------------------------------------------

    def slots(self) -> list[Slot]:
        return [worker.slot() for worker in self.workers]

    def autoscaler(self) -> dict[str, Any] | None:
        return None if self.scaler is None else self.scaler.document()

    def front_door(self) -> dict[str, Any]:
        door = self.front_door_process
        lane = (
            None
            if self.lane is None
            else {
                "pid": self.lane.pid,
                "ready": self.lane.ready,
                "url": self.lane.url,
                "models": sorted(self.slow),
                "threshold_ms": self.config.hedge_lane_ms,
            }
        )
        return {
            "pid": door.pid,
            "running": door.running,
            "reloads": door.reloads,
            "models": sorted(self._models),
            "config": str(door.config_path),
            "lane": lane,
        }

    @property
    def stats_port(self) -> int:
        return self._stats_port

    def slos_s(self) -> dict[str, float]:
        """Each model's SLO (its config's ``slo.p99_ms``), seconds: the dashboard's line."""
        return {model: ms / 1e3 for model, ms in self._models.items()}

    async def models_changed(self) -> None:
        """Reload the front door if the repository's models are not those it routes."""
        async with self._reload_lock:
            models = repository_models(Path(self.config.repository))
            if models == self._models or self._stopping.is_set():
                return
            self._models = models
            await self.front_door_process.reload(self._front_door_config())

    # --- run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve until SIGTERM, SIGINT or SIGHUP, then drain and stop."""
        signals = StopSignals(
            self._on_signal,
            signals=SHUTDOWN_SIGNALS,
            forcing="killing the workers and the front door",
        )
        signals.install(asyncio.get_running_loop())
        try:
            await self.start()
            await self._signalled.wait()
            log.info("signalled: draining the front door, then the workers")
        finally:
            await self.stop()
            signals.remove()

    def _on_signal(self, stop: Stop) -> None:
        # Set first: the run, waiting on it, marks the stack stopping before a keeper sees its
        # killed process exit (and starts it again).
        self._signalled.set()
        if stop is Stop.FORCE:  # requests in flight fail at once
            for worker in self._slots():
                worker.kill()
            self.front_door_process.kill()

    async def start(self) -> None:
        """Start the admin lane, the front door, then the workers; return without waiting for
        the workers to be ready."""
        grpc = self.config.grpc_port != 0
        plan = self.config.scaling
        count = self.config.workers if plan is None else plan.slots
        # The admin lane binds its port first, and every other port is chosen in one go: a
        # port chosen free and released could be the next one the system hands out.
        await self._admin_server.start(LOOPBACK, 0)
        self._admin.start()
        ports = free_ports(count * (2 if grpc else 1) + 3)
        self._stats_port, lane_port, listen_port = ports.pop(), ports.pop(), ports.pop()
        self.workers = [
            ManagedWorker(f"worker-{i}", ports[i], ports[count + i] if grpc else 0)
            for i in range(count)
        ]
        standby = self.config.workers + (0 if plan is None else plan.warm_pool)
        log.info("%s", gpus.describe(self.config.gpus, count))
        for i, worker in enumerate(self.workers):
            worker.command = worker_command(self.config, worker)
            worker.env = gpus.worker_env(i, self.config.gpus)
            serving = i < self.config.workers
            worker.role = Role.SERVING if serving else Role.STANDBY if i < standby else Role.OFF
        if self.config.lane:
            self.lane = ManagedWorker("lane", lane_port)
            self._write_lane_backends()
            self.lane.command = lane_command(self.config, self.lane, self._lane_backends)
        self._models = repository_models(Path(self.config.repository))
        # The front door first: a taken public port fails before any worker has started.
        self._listen_port = self.config.port or listen_port
        try:
            await self.front_door_process.start(self._front_door_config())
        except ConfigError as exc:
            await self._close_admin()
            where = f"{self.config.host}:{self.config.port}"
            raise ConfigError(f"the front door cannot start on {where}: {exc}") from None
        if self._admin.access is AdminAccess.CLOSED:
            log.warning(
                "admin routes closed: the front door listens on %s, beyond loopback, "
                "with no admin token (set --admin-token or TAILSERVE_ADMIN_TOKEN to use "
                "them)",
                self.config.host,
            )
        self._door_keeper = owned_task(self._keep_front_door(), "keep the front door")
        for worker in self._slots():
            if worker.role is not Role.OFF:
                self.activate(worker)
        self._announcer = owned_task(self._announce(), "announce")
        if self.scaler is not None:
            self._scaling = owned_task(self.scaler.run(), "autoscale")
        if self.lane is not None and self.config.hedge_lane_ms > 0:
            self._classifier = owned_task(self._classify(), "classify")

    async def stop(self) -> None:
        """Drain the front door, then the workers; kill a worker still running after the
        timeout."""
        if self._stopping.is_set():
            return
        self._stopping.set()  # from here on nothing is restarted
        for task in (self._scaling, self._announcer, self._classifier, self._door_keeper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        try:
            await self.front_door_process.drain(self.config.drain_timeout_s)
        finally:
            await self._stop_workers()
            await self._close_admin()
            self._run_dir.cleanup()

    async def _close_admin(self) -> None:
        await self._admin_server.drain(1.0)
        await self._admin.close()

    def _slots(self) -> list[ManagedWorker]:
        """The processes kept: the workers, and the lane where there is one."""
        return [*self.workers, *([self.lane] if self.lane else [])]

    async def _stop_workers(self) -> None:
        slots = self._slots()
        for worker in slots:
            worker.terminate()
        keepers = list(self._keepers.values())
        if not keepers:
            return
        await asyncio.wait(keepers, timeout=self.config.drain_timeout_s + EXIT_GRACE_S)
        for worker in slots:
            if worker.running:
                log.warning("%s (pid %s) did not exit in time: killed", worker.name, worker.pid)
                worker.kill()
        await asyncio.gather(*keepers, return_exceptions=True)

    # --- the rotation (the autoscaler's hands) --------------------------------------------------

    def activate(self, worker: ManagedWorker, role: Role | None = None) -> None:
        """Keep a process running in ``worker``'s slot (started now unless it runs)."""
        if role is not None:
            worker.role = role
        keeper = self._keepers.get(worker.name)
        if keeper is None or keeper.done():
            self._keepers[worker.name] = owned_task(self._keep(worker), f"keep {worker.name}")

    async def rotate(self, worker: ManagedWorker, role: Role) -> None:
        """Put ``worker`` in the front door's rotation (SERVING) or take it out, at once."""
        async with self._reload_lock:
            worker.role = role
            weight = SERVING_WEIGHT if role is Role.SERVING else 0
            await self.front_door_process.set_weight(worker.name, self.worker_backends(), weight)
            if self.lane is not None:
                self._write_lane_backends()
        if role is Role.SERVING:
            self.activate(worker)

    async def reload_front_door(self) -> None:
        async with self._reload_lock:
            if not self._stopping.is_set():
                await self.front_door_process.reload(self._front_door_config())

    def _write_lane_backends(self) -> None:
        serving = [w.url for w in self.workers if w.role is Role.SERVING]
        partial = self._lane_backends.with_suffix(".partial")
        partial.write_text("".join(f"{url}\n" for url in serving), encoding="utf-8")
        partial.replace(self._lane_backends)

    def worker_backends(self) -> list[str]:
        return worker_backends(self._listen(), self._models)

    def _listen(self) -> Listen:
        return Listen(
            host=self.config.host,
            port=self._listen_port,
            grpc_port=self.config.grpc_port,
            admin_port=self._admin_server.port,
            stats_port=self._stats_port,
            drain_timeout_s=self.config.drain_timeout_s,
            state_file=str(self.front_door_process.state_path),
            lane_port=self.lane.port if self.lane else 0,
            jobs_in_process=self.config.jobs_in_process,
            grpc_ejection=grpc_ejection_script(),
            await_server=await_server_script(),
        )

    def _front_door_config(self) -> str:
        listen = self._listen()
        members = [
            Member(w.name, LOOPBACK, w.port, w.grpc_port, serving=w.role is Role.SERVING)
            for w in self.workers
        ]
        # HAProxy needs two descriptors a connection, and refuses to start past the limit.
        policy = self.config.policy
        most = max(256, descriptor_limit() // 2 - 100)
        if policy.max_connections > most:
            policy = dataclasses.replace(policy, max_connections=most)
        return render(listen, members, self._models, policy, self.slow)

    def _public_url(self) -> str:
        return backend_url(self.config.host, self.port)

    # --- the front door -------------------------------------------------------------------------

    async def _keep_front_door(self) -> None:
        """Start the front door again whenever it exits on its own."""
        policy = RestartPolicy(front_door_backoff(self.config.backoff))
        loop = asyncio.get_running_loop()
        door = self.front_door_process
        while True:
            started = loop.time()
            code = await door.wait()
            if self._stopping.is_set() or door.draining:
                return
            delay = policy.delay(started_at=started, exited_at=loop.time())
            log.warning(
                "the front door (pid %s) exited with %s: restarting it in %.1f s",
                door.pid,
                code,
                delay,
            )
            if await set_within(self._stopping, delay):
                return
            try:
                await door.start(self._front_door_config())
            except ConfigError:
                log.exception("the front door did not start again")

    # --- one task per worker --------------------------------------------------------------

    async def _keep(self, worker: ManagedWorker) -> None:
        """Run one worker until the supervisor stops: start it, and again each time it exits."""
        policy = RestartPolicy(self.config.backoff)
        loop = asyncio.get_running_loop()
        while True:
            process = await self._spawn(worker)
            started = loop.time()
            code = await self._watch(worker, process)
            if self._stopping.is_set() or worker.role is Role.OFF:
                log.info("%s (pid %d) exited with %s", worker.name, process.pid, code)
                return
            delay = policy.delay(started_at=started, exited_at=loop.time())
            log.warning(
                "%s (pid %d) exited with %s: restarting it in %.1f s",
                worker.name,
                process.pid,
                code,
                delay,
            )
            if await set_within(self._stopping, delay):
                return
            worker.restarts += 1

    async def _spawn(self, worker: ManagedWorker) -> asyncio.subprocess.Process:
        process = await start_session(*worker.command, env=self._worker_env(worker))
        worker.process = process
        worker.started_at, worker.ready_at = asyncio.get_running_loop().time(), None
        if self._stopping.is_set():  # stop() ran while it started, and did not see it
            worker.terminate()
        log.info("%s started (pid %d) on %s", worker.name, process.pid, worker.url)
        return process

    async def _watch(self, worker: ManagedWorker, process: asyncio.subprocess.Process) -> int:
        """Wait for the process to exit, noting meanwhile when it becomes ready."""
        readiness = asyncio.create_task(self._await_ready(worker, process))
        try:
            code = await process.wait()
        finally:
            worker.ready = False
            readiness.cancel()
            await asyncio.gather(readiness, return_exceptions=True)
        if not self._stopping.is_set():
            # The front door's checks would take a second or two to see it: until then each
            # request sent there fails its connection. Told now, it sends none there (and with
            # no worker up, holds them) until the checks find it back.
            with contextlib.suppress(OSError, UpstreamError, RuntimeError):
                await self.front_door_process.set_down(worker.name, self.worker_backends())
        return code

    async def _await_ready(
        self, worker: ManagedWorker, process: asyncio.subprocess.Process
    ) -> None:
        pool = Pool(LOOPBACK, worker.port, max_connections=1, connect_timeout_s=1.0)
        if await until_ready(pool, self.config.ready_interval_s, process):
            self._worker_ready(worker, process)

    def _worker_ready(self, worker: ManagedWorker, process: asyncio.subprocess.Process) -> None:
        worker.ready = True
        worker.ready_at = asyncio.get_running_loop().time()
        again = " again" if worker.restarts else ""
        role = "" if worker.role is Role.SERVING else f" ({worker.role.value})"
        log.info("%s (pid %d) ready%s on %s%s", worker.name, process.pid, again, worker.url, role)
        if all(w.ready for w in self.workers if w.role is not Role.OFF):
            self._workers_ready.set()

    async def _announce(self) -> None:
        """Say once that the fleet is ready: every worker is, and the front door has seen one."""
        await self._workers_ready.wait()
        pool = Pool(
            LOOPBACK if self.config.host in ("0.0.0.0", "") else self.config.host,
            self.port,
            max_connections=1,
        )
        await until_ready(pool, self.config.ready_interval_s)
        await self._until_routed()
        count = sum(w.role is Role.SERVING for w in self.workers)
        noun = "worker" if count == 1 else "workers"
        grpc = self.config.grpc_port
        also = f" (gRPC on port {grpc})" if grpc else ""
        print(
            f"tailserve up: front door on {self._public_url()}{also}, {count} {noun} ready",
            flush=True,
        )
        self.ready.set()

    async def _until_routed(self) -> None:
        """Wait until each model that the first worker serves is served through the front door
        too (its checks have seen it ready)."""
        worker = self.workers[0]
        direct = Pool(LOOPBACK, worker.port, max_connections=1)
        door = Pool(
            LOOPBACK if self.config.host in ("0.0.0.0", "") else self.config.host,
            self.port,
            max_connections=1,
        )
        try:
            for model in self._models:
                path = f"/v2/models/{model}/ready"
                with contextlib.suppress(UpstreamError):
                    reply = await direct.request(frame_request("GET", path, direct.origin), 2.0)
                    if reply.status == 200:
                        await until_ok(door, path, self.config.ready_interval_s / 5)
                        # (The route answers from the cold backend too: wait for its own.)
                        await self._until_up(f"m.{model}")
        finally:
            await asyncio.gather(direct.close(), door.close())

    async def _until_up(self, backend: str) -> None:
        """Wait until the front door has a server up in ``backend`` (one it lacks: at once)."""
        door = self.front_door_process
        while True:
            try:
                if not door.running or await door.servers_up(backend):
                    return
            except OSError as exc:  # (its CLI socket, while it starts again: asked again)
                log.info("the front door's CLI did not answer (%s): asking again", exc)
            await asyncio.sleep(self.config.ready_interval_s / 5)

    async def _classify(self) -> None:
        """Every few seconds, the models whose cost models say they are slow take the lane."""
        await self._workers_ready.wait()
        pools: dict[int, Pool] = {}
        try:
            while True:
                ready = [w for w in self.workers if w.ready]
                if ready:
                    worker = ready[0]
                    pool = pools.setdefault(
                        worker.port, Pool(LOOPBACK, worker.port, max_connections=1)
                    )
                    predictions = {m: await prediction(pool, m) for m in self._models}
                    slow = slow_models(
                        predictions, self.config.hedge_lane_ms, self.config.hedge_models
                    )
                    if slow != self.slow:
                        log.info("the hedging lane takes %s", ", ".join(sorted(slow)) or "none")
                        self.slow = slow
                        async with self._reload_lock:
                            await self.front_door_process.reload(self._front_door_config())
                await asyncio.sleep(self.config.classify_interval_s)
        finally:
            await asyncio.gather(*(pool.close() for pool in pools.values()))

    def _worker_env(self, worker: ManagedWorker) -> dict[str, str]:
        extra = dict(worker.env)
        # The token travels in the environment, where `ps` does not show it to other users.
        if self.config.admin_token is not None:
            extra["TAILSERVE_ADMIN_TOKEN"] = self.config.admin_token
        if self.config.redis_password is not None:
            extra["TAILSERVE_REDIS_PASSWORD"] = self.config.redis_password
        return with_huge_pages({**os.environ, **extra})
