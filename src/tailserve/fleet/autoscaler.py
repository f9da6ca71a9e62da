"""How many serving workers `tailserve up` wants: a pure policy over what each worker carries.

Two signals set the count. Demand: the requests in flight over what one worker should carry
(`target_in_flight`, Ray Serve's target ongoing requests) is the floor. Pressure on the SLO (a
p99 or a front-door queue wait near the SLO, refusals, or every worker's CPU busy while the
machine has a core to spare) adds a worker even when the in-flight count looks fine, because the
SLO is what users see and the target is only an estimate.

Up is quick and down is slow: a missing worker breaks the SLO within seconds, a spare one costs
some memory.

- Up once every sample for `upscale_delay_s` wanted more, to the lowest of those samples'
  recommendations, so that one spike neither scales nor overshoots. When the requests in flight
  are over `panic_factor` times what the serving workers should carry (Knative's panic mode),
  `panic_delay_s` is enough, and the count goes straight to what demand needs.
- Down once every sample for `downscale_delay_s` wanted fewer (the Kubernetes HPA's
  stabilisation window: the highest recommendation over the window wins), by one worker. Each
  change starts a new window, so the next step measures the fleet the last one left: a removal
  moves its load onto the others, and an estimate of how many are enough is easiest to trust
  one worker at a time.
- Between `calm_fraction` and `pressure_fraction` of the SLO the count holds. That band, the
  windows and one-step removals keep a load that oscillates faster than the window from
  flapping the fleet.

On one machine (`cores` given) a worker more than the cores adds no capacity, only contention:
the count stops at the cores unless `min_workers` asks for more, and busy CPUs count as
pressure only while a core is spare. Pure: the caller passes `now` (a monotonic clock) and one
`WorkerLoad` per serving worker, sampled every second or so.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tailserve.errors import ConfigError

# Float times (0.1 s steps add up to 0.30000000000000004) must not miss a delay by a hair.
_EPS = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerLoad:
    """One serving worker, sampled now (`fleet.load` reads it from the front door's statistics
    and the worker's metrics); rates and delays cover the last few seconds."""

    in_flight: int  # requests being served or queued for this worker
    queue_delay_s: float  # mean wait in the front door's queue for this worker
    p99_s: float | None  # None: too few requests to say
    refusals_per_s: float  # 503s for overload
    cpu: float  # cores used


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingConfig:
    min_workers: int = 1
    max_workers: int = 4
    slo_s: float = 0.050
    # Ongoing requests a worker should carry: about half of what it holds at its SLO capacity.
    target_in_flight: float = 8.0
    upscale_delay_s: float = 3.0
    panic_delay_s: float = 1.0
    panic_factor: float = 2.0
    downscale_delay_s: float = 60.0  # Knative's stable window
    pressure_fraction: float = 0.8  # of the SLO, by the p99 or the queue wait: add a worker
    calm_fraction: float = 0.5  # below it a worker may go; between the two the count holds
    cpu_busy: float = 0.9  # cores a worker uses when its CPU is saturated
    cores: int | None = None  # the machine's usable cores; None: workers do not share them

    def __post_init__(self) -> None:
        n, m = self.min_workers, self.max_workers
        _require(n >= 1, f"min_workers (the fewest workers) must be at least 1, not {n}")
        _require(m >= n, f"max_workers ({m}) must be at least min_workers ({n})")
        _require(self.slo_s > 0, f"slo_s (the latency objective) must be over 0, not {self.slo_s}")
        _require(
            self.target_in_flight > 0,
            f"target_in_flight (requests a worker carries) must be over 0, "
            f"not {self.target_in_flight}",
        )
        panic, up, down = self.panic_delay_s, self.upscale_delay_s, self.downscale_delay_s
        _require(0 <= panic <= up, f"panic_delay_s ({panic}) must be 0 to upscale_delay_s ({up})")
        _require(
            up <= down,
            f"upscale_delay_s ({up}) must be at most downscale_delay_s ({down}): "
            "adding a worker may not wait longer than removing one",
        )
        _require(self.panic_factor > 1, f"panic_factor must be over 1, not {self.panic_factor}")
        calm, pressure = self.calm_fraction, self.pressure_fraction
        _require(
            0 < calm < pressure,
            f"calm_fraction ({calm}) must be over 0 and under pressure_fraction ({pressure})",
        )
        _require(
            self.cpu_busy > 0,
            f"cpu_busy (cores a busy worker uses) must be over 0, not {self.cpu_busy}",
        )
        _require(
            self.cores is None or self.cores >= 1, f"cores must be at least 1, not {self.cores}"
        )

    @property
    def ceiling(self) -> int:
        """The most workers wanted: `max_workers`, or the cores where fewer (`min_workers` wins)."""
        cores = self.max_workers if self.cores is None else self.cores
        return max(self.min_workers, min(self.max_workers, cores))


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    wanted: int
    reason: str  # plain words, for logs and GET /v2/fleet
    inputs: dict[str, float]  # the aggregates the decision used (no p99_s when none was known)


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    wanted: int  # this sample's recommendation, within min and the ceiling
    panic: bool


class Autoscaler:
    """The wanted count of one fleet; `decide` once a sample, with the serving workers' loads."""

    def __init__(self, config: ScalingConfig | None = None) -> None:
        self.config = config or ScalingConfig()
        self._wanted: int | None = None
        # This count's recommendations, oldest first: from the last change, over the longest
        # window, plus the one sample before it (it says what held when the window opened).
        self._samples: deque[_Sample] = deque()

    def decide(self, now: float, loads: Sequence[WorkerLoad]) -> Decision:
        cfg = self.config
        if self._wanted is None:  # start from what serves
            self._wanted = min(max(len(loads), cfg.min_workers), cfg.ceiling)
        old = self._wanted
        inputs, why, sample = self._recommend(now, old, loads)
        self._samples.append(sample)
        while len(self._samples) > 1 and self._samples[1].at <= now - cfg.downscale_delay_s:
            self._samples.popleft()
        new, reason = self._step(now, old, sample, why)
        if new != old:
            self._wanted = new
            self._samples.clear()
        return Decision(wanted=new, reason=reason, inputs=inputs)

    def _recommend(
        self, now: float, old: int, loads: Sequence[WorkerLoad]
    ) -> tuple[dict[str, float], str, _Sample]:
        """What this sample alone asks for, why in words, and the inputs it used."""
        cfg, top, slo = self.config, self.config.ceiling, self.config.slo_s
        serving = len(loads)
        in_flight = sum(load.in_flight for load in loads)
        need = math.ceil(in_flight / cfg.target_in_flight)  # capped with the rest, below
        known = [load.p99_s for load in loads if load.p99_s is not None]
        # The worst worker: the front door spreads requests evenly, so its share is over the SLO.
        p99 = max(known, default=None)
        queue = max((load.queue_delay_s for load in loads), default=0.0)
        refusals = sum(load.refusals_per_s for load in loads)
        cpu = sum(load.cpu for load in loads)
        inputs = {
            "serving": float(serving),
            "wanted_before": float(old),
            "in_flight": float(in_flight),
            "need": float(need),
            "queue_delay_s": queue,
            "refusals_per_s": refusals,
            "cpu": cpu,
        }
        if p99 is not None:
            inputs["p99_s"] = p99
        if not loads:  # nothing to judge by (all warming or restarting): keep the count
            inputs["recommended"] = float(old)
            return inputs, "no worker serving", _Sample(now, old, panic=False)

        pressure: list[str] = []
        notes: list[str] = []
        over = f"over {cfg.pressure_fraction:.0%} of the {_ms(slo)} SLO"
        if p99 is not None and p99 >= cfg.pressure_fraction * slo:
            pressure.append(f"p99 {_ms(p99)} {over}")
        if queue >= cfg.pressure_fraction * slo:
            pressure.append(f"queue wait {_ms(queue)} {over}")
        if refusals > 0:
            pressure.append(f"{refusals:.1f} refusals/s")
        if all(load.cpu >= cfg.cpu_busy for load in loads):
            spare = None if cfg.cores is None else cfg.cores - cpu
            if spare is None or spare >= cfg.cpu_busy:
                pressure.append("CPU busy on every worker")
            else:
                notes.append(f"CPU busy on every worker, but no core of {cfg.cores} is spare")
        panic = in_flight > cfg.panic_factor * serving * cfg.target_in_flight
        demand = f"{in_flight} in flight need {_workers(need)} at {cfg.target_in_flight:g} each"
        latency = max(p99 or 0.0, queue)
        if panic:
            wanted = max(need, old)
            why = f"panic: {demand}, over {cfg.panic_factor:g}x what {serving} carry"
        elif pressure:
            wanted, why = max(serving + 1, need, old), ", ".join(pressure)
        elif need > old:
            wanted, why = need, demand
        elif latency >= cfg.calm_fraction * slo:
            wanted = old
            band = f"{cfg.calm_fraction:.0%} and {cfg.pressure_fraction:.0%} of the {_ms(slo)} SLO"
            why = f"latency {_ms(latency)} between {band}"
        else:
            wanted, why = need, f"calm ({demand}, latency {_ms(latency)})"
        wanted = max(cfg.min_workers, wanted)
        if wanted > top:
            notes.append(
                f"capped at {top}: the machine has {cfg.cores} cores"
                if top < cfg.max_workers
                else f"capped at max_workers {top}"
            )
            wanted = top
        inputs["recommended"] = float(wanted)
        return inputs, "; ".join([why, *notes]), _Sample(now, wanted, panic)

    def _step(self, now: float, old: int, latest: _Sample, why: str) -> tuple[int, str]:
        """Move the count if the recommendations have stayed on one side of it long enough."""
        cfg = self.config
        if latest.wanted > old:
            start, delay = self._run_start(lambda s: s.wanted > old), cfg.upscale_delay_s
            if latest.panic:  # the panic run, unless only the ordinary one has lasted
                panic_start = self._run_start(lambda s: s.wanted > old and s.panic)
                if now - start + _EPS < delay or now - panic_start + _EPS >= cfg.panic_delay_s:
                    start, delay = panic_start, cfg.panic_delay_s
            held = now - start
            if held + _EPS < delay:
                return old, f"{why} for {held:.1f} s of {delay:g} s: holding {old}"
            window = [s.wanted for s in self._samples if s.at >= max(start, now - delay - _EPS)]
            new = min(window, default=latest.wanted)
            return new, f"{why} for {held:.1f} s: {old} -> {new}"
        if latest.wanted < old:
            start = self._run_start(lambda s: s.wanted < old)
            low = now - start
            if low + _EPS < cfg.downscale_delay_s:
                return old, f"{why} for {low:.0f} s of {cfg.downscale_delay_s:g} s: holding {old}"
            return old - 1, f"{why} for {low:.0f} s: {old} -> {old - 1}, one at a time"
        return old, f"{why}: holding {old}"

    def _run_start(self, inside: Callable[[_Sample], bool]) -> float:
        """When the newest run of samples that pass ``inside`` began."""
        start = self._samples[-1].at
        for sample in reversed(self._samples):
            if not inside(sample):
                break
            start = sample.at
        return start


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"autoscaling: {message}")


def _workers(count: int) -> str:
    return "1 worker" if count == 1 else f"{count} workers"


def _ms(seconds: float) -> str:
    return "off the scale" if math.isinf(seconds) else f"{seconds * 1e3:.0f} ms"
