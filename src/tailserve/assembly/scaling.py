"""Autoscaling for `tailserve up`: the loop that samples each serving worker's load, asks the
autoscaler (`fleet.autoscaler`, pure) how many should serve, and carries the answer out.

- **Up:** a standby from the warm pool is promoted: its weight in every backend goes from 0 to
  1 through HAProxy's runtime API (milliseconds; the worker is already loaded, warm and
  checked). With no standby ready, a stopped slot starts cold and enters the rotation once its
  checks pass.
- **Down:** the worker leaves the rotation first (weight 0: no new request reaches it), its
  requests in flight and queued finish, and only then does it get SIGTERM (it drains anything
  else itself). No request fails for it.
- **The warm pool** is refilled in the background: `warm_pool` slots kept started and warm
  outside the rotation while there is room. A promoted standby is replaced only once the fleet
  has stopped growing for `refill_after_s`: on a small machine a cold start in the middle of a
  step takes the CPU the serving workers need.

After a change the front door is reloaded too (debounced), so that its queue bound follows the
number of serving workers; the weights it renders are the same the runtime API set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tailserve.errors import UpstreamError
from tailserve.fleet.autoscaler import Autoscaler, Decision, ScalingConfig
from tailserve.fleet.load import LoadSampler, carried, cpu_seconds, parse_stat
from tailserve.fleet.processes import LOOPBACK, ManagedWorker, Role, owned_task
from tailserve.transport.http1 import Pool, frame_request

if TYPE_CHECKING:
    from tailserve.assembly.stack import Supervisor

log = logging.getLogger(__name__)

# How often the drain of a worker leaving the rotation looks at what it still carries.
DRAIN_POLL_S = 0.1
# After a change, the front door is reloaded this much later (changes in between share it).
RELOAD_AFTER_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingPlan:
    """The autoscaler's bounds and the warm pool (`tailserve up --min-workers --max-workers
    --warm-pool`)."""

    scaling: ScalingConfig
    warm_pool: int = 0
    interval_s: float = 1.0
    # A promoted standby is replaced once the fleet has not grown for this long: a cold start
    # takes a core for a second or more, which a fleet that is still absorbing a step needs.
    refill_after_s: float = 10.0

    @property
    def slots(self) -> int:
        return self.scaling.max_workers + self.warm_pool


class Scaler:
    def __init__(self, supervisor: Supervisor, plan: ScalingPlan) -> None:
        self.supervisor = supervisor
        self.plan = plan
        self.autoscaler = Autoscaler(plan.scaling)
        self.sampler = LoadSampler()
        self.last: Decision | None = None
        self.last_at: float | None = None
        # Promotion: decision to the front door's acknowledgement of the new weights.
        self.promotions_s: list[float] = []
        self._pools: dict[int, Pool] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._reload: asyncio.Task[None] | None = None
        self._refill: asyncio.Task[None] | None = None
        self._grew_at = -float("inf")

    def document(self) -> dict[str, Any]:
        """For ``GET /v2/fleet``."""
        workers = self.supervisor.workers
        cold = [w.cold_start_s for w in workers if w.cold_start_s is not None]
        return {
            "min_workers": self.plan.scaling.min_workers,
            "max_workers": self.plan.scaling.max_workers,
            "warm_pool": self.plan.warm_pool,
            "serving": sum(w.role is Role.SERVING for w in workers),
            "wanted": None if self.last is None else self.last.wanted,
            "reason": None if self.last is None else self.last.reason,
            "inputs": None if self.last is None else self.last.inputs,
            "decided_at": self.last_at,
            "cold_start_s": cold[-1] if cold else None,
            "promotion_s": self.promotions_s[-1] if self.promotions_s else None,
        }

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.plan.interval_s)
                try:
                    await self.tick()
                except (OSError, UpstreamError) as exc:
                    log.warning("autoscaler: could not sample the fleet: %s", exc)
        finally:
            others = [t for t in (self._reload, self._refill) if t is not None]
            for task in [*self._drains.values(), *others]:
                task.cancel()
            await asyncio.gather(*self._drains.values(), return_exceptions=True)
            await asyncio.gather(*(pool.close() for pool in self._pools.values()))

    async def tick(self) -> Decision:
        """Sample, decide, act: one round."""
        supervisor = self.supervisor
        serving = [w for w in supervisor.workers if w.role is Role.SERVING and w.ready]
        stat = parse_stat(await supervisor.front_door_process.command("@1 show stat"))
        pages = await asyncio.gather(*(self._metrics(w) for w in serving))
        now = time.monotonic()
        loads = self.sampler.sample(
            now,
            stat,
            supervisor.worker_backends(),
            [w.name for w in serving],
            {w.name: page for w, page in zip(serving, pages, strict=True)},
            {w.name: cpu_seconds(w.pid) if w.pid else None for w in serving},
        )
        decision = self.autoscaler.decide(now, [loads[w.name] for w in serving])
        if self.last is None or decision.wanted != self.last.wanted:
            log.info("autoscaler: %s", decision.reason)
        self.last, self.last_at = decision, time.time()
        await self.apply(decision.wanted)
        return decision

    async def apply(self, wanted: int) -> None:
        """Bring the number of serving slots to ``wanted`` and refill the warm pool."""
        workers = self.supervisor.workers
        serving = [w for w in workers if w.role is Role.SERVING]
        changed = False
        for _ in range(wanted - len(serving)):
            changed |= await self._add()
            self._grew_at = time.monotonic()
        if wanted < len(serving):
            # The youngest leave first: the oldest have the warmest caches.
            leaving = sorted(serving, key=lambda w: w.ready_at or float("inf"))[wanted:]
            for worker in leaving:
                await self._retire(worker)
            changed = True
        if changed:
            self._reload_soon()
        self._refill_soon()

    def _refill_soon(self) -> None:
        """Refill the warm pool once the fleet has not grown for `refill_after_s`."""
        if self._refill is not None and not self._refill.done():
            return

        async def refill() -> None:
            # The deadline moves each time the fleet grows again meanwhile.
            while (wait := self._grew_at + self.plan.refill_after_s - time.monotonic()) > 0:  # noqa: ASYNC110
                await asyncio.sleep(wait)
            workers = self.supervisor.workers
            standby = [w for w in workers if w.role is Role.STANDBY]
            for worker in [w for w in workers if w.role is Role.OFF and not w.running]:
                if len(standby) >= self.plan.warm_pool:
                    break
                self.supervisor.activate(worker, Role.STANDBY)
                standby.append(worker)

        self._refill = owned_task(refill(), "refill the warm pool")

    async def _add(self) -> bool:
        """One more slot in the rotation: a ready standby at once, else a warming one, else a
        cold start. False when every slot is taken."""
        workers = self.supervisor.workers
        standby = [w for w in workers if w.role is Role.STANDBY]
        ready = [w for w in standby if w.ready]
        if ready or standby:
            chosen = (ready or standby)[0]
            started = time.perf_counter()
            await self.supervisor.rotate(chosen, Role.SERVING)
            if chosen.ready:
                self.promotions_s.append(time.perf_counter() - started)
                log.info("%s promoted from the warm pool", chosen.name)
            return True
        idle = [w for w in workers if w.role is Role.OFF and not w.running]
        if not idle:
            return False
        self.supervisor.activate(idle[0], Role.SERVING)
        log.info("%s starting cold (no standby ready)", idle[0].name)
        return True

    async def _retire(self, worker: ManagedWorker) -> None:
        await self.supervisor.rotate(worker, Role.OFF)
        self._drains[worker.name] = owned_task(self._drain(worker), f"drain {worker.name}")

    async def _drain(self, worker: ManagedWorker) -> None:
        """Wait until the front door has nothing in flight or queued for ``worker``, then ask
        it to exit (it drains what else it has itself)."""
        supervisor = self.supervisor
        loop = asyncio.get_running_loop()
        deadline = loop.time() + supervisor.config.drain_timeout_s
        try:
            while loop.time() < deadline and worker.role is Role.OFF:
                try:
                    text = await supervisor.front_door_process.command("@1 show stat")
                except OSError:  # the master socket, while a reload re-creates it
                    await asyncio.sleep(DRAIN_POLL_S)
                    continue
                stat = parse_stat(text)
                if carried(stat, supervisor.worker_backends(), worker.name) == 0:
                    break
                await asyncio.sleep(DRAIN_POLL_S)
            if worker.role is Role.OFF:
                log.info("%s out of the rotation and idle: stopping it", worker.name)
                worker.terminate()
        finally:
            self._drains.pop(worker.name, None)

    def _reload_soon(self) -> None:
        if self._reload is not None and not self._reload.done():
            return

        async def later() -> None:
            await asyncio.sleep(RELOAD_AFTER_S)
            await self.supervisor.reload_front_door()

        self._reload = owned_task(later(), "reload the front door")

    async def _metrics(self, worker: ManagedWorker) -> str | None:
        pool = self._pools.get(worker.port)
        if pool is None:
            pool = self._pools[worker.port] = Pool(LOOPBACK, worker.port, max_connections=1)
        with contextlib.suppress(UpstreamError):
            reply = await pool.request(frame_request("GET", "/metrics", pool.origin), 2.0)
            if reply.status == 200:
                return reply.body.decode("utf-8", errors="replace")
        return None
