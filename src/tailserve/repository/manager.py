"""Which models and versions serve: loading, warming, swapping and unloading them.

A load builds every chosen version anew (runtimes loaded and warmed in a loader thread) while the
versions already serving keep answering; only when all are warm does one assignment swap them in.
The old versions then drain: requests already queued on them finish. A failed load leaves what
was serving in place and records the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from tailserve.cache import ModelView, ResultCache, model_view
from tailserve.engine.batching import Batcher, NoBatching, SizeOrTimeout
from tailserve.engine.buckets import Bucket, BucketRule
from tailserve.engine.deadline import DeadlineBatcher
from tailserve.engine.scheduler import BatchObserver, LoopState, Scheduler
from tailserve.engine.validation import InputPlan
from tailserve.engine.warmup import warmup_batches
from tailserve.errors import (
    ConfigError,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    ModelNotReady,
    ModelNotServed,
    TailserveError,
)
from tailserve.modelconfig import FeaturesConfig, ModelConfig, load_model_config
from tailserve.repository.discovery import choose_versions, model_dirs, versions_on_disk
from tailserve.runtimes import Arrays, Runtime, RuntimeContext, create_runtime
from tailserve.tensors import Tensor

if TYPE_CHECKING:
    from tailserve.cache.features import FeatureResolver

log = logging.getLogger(__name__)


class ModelStatus(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(slots=True)
class ServedVersion:
    config: ModelConfig
    version: int
    runtimes: list[Runtime]
    scheduler: Scheduler
    plan: InputPlan
    buckets: BucketRule
    policy: str
    # The result cache as this version uses it (None: the model does not cache).
    cache: ModelView | None = None
    # Fills inputs from the feature store by entity id (None: the client sends them all).
    features: FeatureResolver | None = None


@dataclass(slots=True)
class ModelState:
    name: str
    status: ModelStatus = ModelStatus.UNAVAILABLE
    reason: str = ""
    # Left out for want of a service the worker was not given (ModelNotServed): no failure.
    not_served: bool = False
    config: ModelConfig | None = None
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ready(self) -> bool:
        # Versions are present only once warm, and stay while a reload builds their successors.
        return bool(self.versions)


class ModelManager:
    def __init__(
        self,
        repository: Path,
        *,
        observer: BatchObserver | None = None,
        on_ready_change: Callable[[str, bool], None] | None = None,
        drain_timeout_s: float = 30.0,
        loop: LoopState | None = None,
        cache: ResultCache | None = None,
        feature_resolver: Callable[[FeaturesConfig], FeatureResolver] | None = None,
    ) -> None:
        self.repository = repository
        self.cache = cache
        self._feature_resolver = feature_resolver
        self._observer = observer
        self._on_ready_change = on_ready_change
        self._drain_timeout_s = drain_timeout_s
        self._loop = loop
        self._models: dict[str, ModelState] = {}
        # Loads read files and build sessions: off the event loop, one at a time (2 cores).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tailserve-loader")

    # --- queries (on the request path: no awaits, no I/O) ---------------------------------

    def get(self, name: str, version: str | None = None) -> ServedVersion:
        state = self._models.get(name)
        if state is None:
            raise ModelNotFound(f"unknown model {name!r}")
        if not state.versions:
            detail = f": {state.reason}" if state.reason else ""
            raise ModelNotReady(
                f"model {name!r} is not ready ({state.status.value.lower()}){detail}",
                retry_after_s=1.0,
            )
        if version is None:
            return state.versions[max(state.versions)]
        try:
            served = state.versions.get(int(version))
        except ValueError:
            raise InvalidInput(f"model version must be a whole number, got {version!r}") from None
        if served is None:
            serving = sorted(state.versions)
            raise ModelNotFound(
                f"model {name!r} has no version {version} serving (serving: {serving})"
            )
        return served

    def state(self, name: str) -> ModelState:
        state = self._models.get(name)
        if state is None:
            raise ModelNotFound(f"unknown model {name!r}")
        return state

    def states(self) -> list[ModelState]:
        return [self._models[name] for name in sorted(self._models)]

    def known_on_disk(self) -> dict[str, Path]:
        return model_dirs(self.repository)

    @property
    def all_ready(self) -> bool:
        """Every model that has been asked to load is serving (failed ones count as not)."""
        return all(state.ready for state in self._models.values())

    # --- changes ----------------------------------------------------------------------------

    async def load_all(self) -> list[str]:
        """Load every model in the repository; return the names that failed (logged). A model
        the worker is not set up to serve is left out with an INFO line: it did not fail."""
        failed = []
        for name in self.known_on_disk():
            self._models.setdefault(name, ModelState(name, status=ModelStatus.LOADING))
        for name in self.known_on_disk():
            try:
                await self.load(name)
            except ModelNotServed as exc:
                log.info("%s", exc.message)
            except TailserveError as exc:
                log.error("model %r failed to load: %s", name, exc.message)
                failed.append(name)
        return failed

    async def load(self, name: str) -> None:
        """(Re)load a model from disk: new versions warm first, then swap, then drain the old."""
        model_dir = self.repository / name
        if name not in self.known_on_disk():
            raise ModelNotFound(f"model {name!r} is not in the repository {self.repository}")
        state = self._models.setdefault(name, ModelState(name))
        async with state.lock:
            state.status = ModelStatus.LOADING
            try:
                config = load_model_config(model_dir)
                if config.name != name:
                    raise ConfigError(
                        f"{model_dir / 'model.yaml'}: field 'name': {config.name!r} does not "
                        f"match its folder {name!r}"
                    )
                source = str(model_dir / "model.yaml")
                chosen = choose_versions(config.version_policy, versions_on_disk(model_dir), source)
                fresh: dict[int, ServedVersion] = {}
                try:
                    for version in chosen:
                        fresh[version] = await self._build(
                            config, version, model_dir / str(version)
                        )
                except BaseException:
                    await asyncio.gather(*(self._retire(v) for v in fresh.values()))
                    raise
            except TailserveError as exc:
                state.reason = exc.message
                state.not_served = isinstance(exc, ModelNotServed)
                state.status = ModelStatus.READY if state.versions else ModelStatus.UNAVAILABLE
                self._notify(state)
                raise
            old = state.versions
            state.config, state.versions = config, fresh
            state.status, state.reason, state.not_served = ModelStatus.READY, "", False
            self._notify(state)
            log.info("model %r serving versions %s", name, sorted(fresh))
            await asyncio.gather(*(self._retire(v) for v in old.values()))

    async def unload(self, name: str) -> None:
        state = self.state(name)
        async with state.lock:
            old, state.versions = state.versions, {}
            state.status, state.reason = ModelStatus.UNLOADING, ""
            self._notify(state)
            await asyncio.gather(*(self._retire(v) for v in old.values()))
            state.status = ModelStatus.UNAVAILABLE
            log.info("model %r unloaded", name)

    async def close(self) -> None:
        for state in self._models.values():
            old, state.versions = state.versions, {}
            state.status = ModelStatus.UNAVAILABLE
            await asyncio.gather(*(self._retire(v) for v in old.values()))
        self._loader.shutdown(wait=False, cancel_futures=True)

    # --- helpers ----------------------------------------------------------------------------

    async def _build(self, config: ModelConfig, version: int, version_dir: Path) -> ServedVersion:
        if config.features is not None:
            from tailserve.cache.features import check_features

            check_features(config)
        if config.features is not None and self._feature_resolver is None:
            raise ModelNotServed(
                f"model {config.name!r} is not served: it reads its inputs from the feature "
                "store, which needs Redis (start the worker with --redis-url)"
            )
        loop = asyncio.get_running_loop()
        context = RuntimeContext(config=config, version=version, version_dir=version_dir)
        policy = batching_policy(config)
        plan = InputPlan(config)
        buckets = BucketRule(config, classes=policy == "deadline")
        runtimes: list[Runtime] = []
        timings: list[tuple[Bucket, int, float]] = []
        try:
            for _ in range(config.instances.count):
                runtime, measured = await loop.run_in_executor(
                    self._loader, _load_and_warm, context, plan, buckets
                )
                runtimes.append(runtime)
                timings += measured
        except BaseException:
            for runtime in runtimes:
                runtime.unload()
            raise
        scheduler = Scheduler(
            model=config.name,
            runtimes=runtimes,
            batcher=_batcher(config, policy),
            batched=config.batched,
            observer=self._observer,
            loop=self._loop,
            inline_below_s=config.instances.inline_below_ms / 1e3,
        )
        for bucket, rows, seconds in timings:
            scheduler.seed(bucket, rows, seconds)
        scheduler.start()
        served = ServedVersion(config, version, runtimes, scheduler, plan, buckets, policy)
        if config.cache.enabled and self.cache is not None:
            served.cache = model_view(self.cache, config, version)
        if config.features is not None:
            assert self._feature_resolver is not None  # checked before loading
            served.features = self._feature_resolver(config.features)
        return served

    async def _retire(self, served: ServedVersion) -> None:
        await served.scheduler.close(drain_s=self._drain_timeout_s)
        for runtime in served.runtimes:
            runtime.unload()

    def _notify(self, state: ModelState) -> None:
        if self._on_ready_change is not None:
            self._on_ready_change(state.name, state.ready)


def batching_policy(config: ModelConfig) -> str:
    """The policy in force: the configured one, or none for a model that cannot batch."""
    if not config.batched or not config.batching.enabled:
        return "none"
    return config.batching.policy


def _batcher(config: ModelConfig, policy: str) -> Batcher:
    batching = config.batching
    if policy == "none":
        return NoBatching(batching.max_queue_size)
    if policy == "size_or_timeout":
        return SizeOrTimeout(
            max_rows=config.max_batch_size,
            max_delay_s=batching.max_queue_delay_ms / 1000.0,
            max_queue=batching.max_queue_size,
        )
    return DeadlineBatcher(
        max_rows=config.max_batch_size,
        instances=config.instances.count,
        max_queue=batching.max_queue_size,
        target_utilization=batching.target_utilization,
        admission_target=batching.admission_target,
    )


def _load_and_warm(
    context: RuntimeContext, plan: InputPlan, buckets: BucketRule
) -> tuple[Runtime, list[tuple[Bucket, int, float]]]:
    """In the loader thread: load one instance, check it against model.yaml, warm it up.

    Returns the instance and, to seed the cost models, each warm-up shape's time by cost class
    once that shape is warm (`_settled`)."""
    config = context.config
    where = f"model {config.name!r} version {context.version}"
    runtime = create_runtime(context)
    try:
        runtime.load()
    except TailserveError:
        raise
    except Exception as exc:
        # Third-party loaders raise anything; it becomes a load error at this boundary.
        raise ModelLoadError(f"{where}: load failed: {type(exc).__name__}: {exc}") from exc
    # Per input shape: a batch of it and the times of its runs.
    runs: dict[tuple[tuple[int, ...], ...], tuple[Arrays, list[float]]] = {}
    try:
        _check_signature(runtime, config, where)
        for batch in warmup_batches(config, buckets.by, buckets.warmup_lengths()):
            rows = len(next(iter(batch.values()))) if config.batched else None
            started = time.perf_counter()
            outputs = runtime.predict(batch)
            seconds = time.perf_counter() - started
            shapes = tuple(array.shape for array in batch.values())
            runs.setdefault(shapes, (batch, []))[1].append(seconds)
            for spec in config.outputs:
                out = outputs.get(spec.name)
                if out is None:
                    raise ModelLoadError(f"{where}: warm-up gave no output {spec.name!r}")
                if rows is not None and len(out) != rows:
                    raise ModelLoadError(
                        f"{where}: warm-up output {spec.name!r} has {len(out)} rows for {rows}"
                    )
    except TailserveError as exc:
        runtime.unload()
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: warm-up failed: {exc.message}") from exc
    except Exception as exc:
        runtime.unload()
        raise ModelLoadError(f"{where}: warm-up failed: {exc}") from exc
    timings = [
        _timing(config, plan, buckets, batch, _settled(runtime, batch, times))
        # (A shape run once, repeat: 1 being the default, had only a cold run: _settled runs
        # it until warm, so every class starts from a measured time, not the flat guess.)
        for batch, times in runs.values()
    ]
    return runtime, timings


# A shape's warm-up time is taken once two runs in a row agree within this share, after at
# most this many runs more than the warm-up made.
_SETTLED_WITHIN = 0.25
_MAX_EXTRA_RUNS = 3


def _settled(
    runtime: Runtime,
    batch: Arrays,
    times: list[float],
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The time of a shape's batch once it is warm, to seed its class's cost model.

    The first run of a shape pays for lazy initialisation, and with ONNX Runtime the second
    too (it plans the memory of that shape then: 64 rows of 512 tokens took 447 ms, then
    1,115 ms, then 184 ms every time). Seeded with a cold time, a class's requests would be
    refused at low load as if they took ten times longer. So the batch runs again until two
    runs in a row agree."""
    times = times[1:]
    for _ in range(_MAX_EXTRA_RUNS):
        if len(times) >= 2 and abs(times[-1] - times[-2]) <= _SETTLED_WITHIN * times[-2]:
            break
        started = clock()
        runtime.predict(batch)
        times.append(clock() - started)
    return min(times[-2:]) if len(times) >= 2 else times[-1]


def _timing(
    config: ModelConfig, plan: InputPlan, buckets: BucketRule, batch: Arrays, seconds: float
) -> tuple[Bucket, int, float]:
    specs = {spec.name: spec for spec in config.inputs}
    tensors = [Tensor(name, specs[name].datatype, array) for name, array in batch.items()]
    checked = plan.check(tensors)
    return buckets.classify(checked), checked.rows, seconds


def _check_signature(runtime: Runtime, config: ModelConfig, where: str) -> None:
    signature = runtime.describe()
    # Only artifacts with typed graphs (ONNX) name their tensors reliably enough to insist.
    if not signature.inputs or any(spec.datatype is None for spec in signature.inputs):
        return
    have = {spec.name for spec in signature.inputs}
    for spec in config.inputs:
        if spec.name not in have:
            raise ModelLoadError(
                f"{where}: model.yaml input {spec.name!r} is not an input of the artifact "
                f"(it has {sorted(have)})"
            )
