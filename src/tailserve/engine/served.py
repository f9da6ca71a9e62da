"""A served version of a model, and how one is built: runtimes loaded and warmed, a scheduler
with the model's batching policy, its view of the result cache and its feature resolver.

The catalogue (`tailserve.repository.manager`) decides which versions serve and when; this module
is what it calls to make and retire one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tailserve.cache import ModelView, ResultCache, model_view
from tailserve.engine.accounts import BatchObserver, LoopState
from tailserve.engine.background import BackgroundLane
from tailserve.engine.batching import Batcher, NoBatching, SizeOrTimeout
from tailserve.engine.buckets import Bucket, BucketRule
from tailserve.engine.deadline_batcher import DeadlineBatcher
from tailserve.engine.pipeline import Pipeline, PipelineHost, PipelineObserver
from tailserve.engine.refusal_audit import RefusalAudit
from tailserve.engine.retrieval import RetrievalIndex
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.validation import InputPlan
from tailserve.engine.variants import VariantChooser
from tailserve.engine.warmup import load_and_warm
from tailserve.errors import ModelNotServed, TailserveError, Unavailable
from tailserve.modelconfig import FeatureInput, FeaturesConfig, ModelConfig, served_variants
from tailserve.modelconfig.pipeline import PipelineStep, fallback_fields
from tailserve.runtimes import Runtime, RuntimeContext

if TYPE_CHECKING:
    from tailserve.cache.feature_store import FeatureSource
    from tailserve.cache.features import FeatureResolver

log = logging.getLogger(__name__)


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
    # The variants that serve, in order of preference (empty: the model has none).
    variants: tuple[str, ...] = ()


@dataclass(slots=True)
class ServedPipeline:
    """A served version of a pipeline model: no runtime of its own, its steps call the
    others (`engine.pipeline`)."""

    config: ModelConfig
    version: int
    pipeline: Pipeline


Served = ServedVersion | ServedPipeline

# Items read from the store a round trip at a time when a retrieval index loads.
_INDEX_CHUNK = 5000
# Each of those round trips' time while the worker starts.
_INDEX_STARTUP_S = 2.0


class StoredIndex:
    """A retrieve step's index, read whole from the feature store when first needed (and read
    again, at most every few seconds, while the store does not hold it)."""

    RETRY_S = 5.0

    def __init__(self, step: PipelineStep, store: FeatureSource) -> None:
        assert step.index is not None
        self._spec = step.index
        self._top = step.top
        self._store = store
        self._index: RetrievalIndex | None = None
        self._failed: tuple[float, TailserveError] | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> RetrievalIndex | None:
        return self._index

    @property
    def problem(self) -> str | None:
        return self._failed[1].message if self._failed is not None else None

    async def get(self, *, timeout_s: float | None = None) -> RetrievalIndex:
        """The index, read now if it is not held (each round trip within ``timeout_s``, else
        the store's own)."""
        if self._index is not None:
            return self._index
        async with self._lock:
            if self._index is not None:
                return self._index
            if self._failed is not None and time.monotonic() < self._failed[0] + self.RETRY_S:
                raise self._failed[1]
            try:
                self._index = await self._read(timeout_s)
            except TailserveError as exc:
                spec = self._spec
                failed = Unavailable(
                    f"the retrieval index ({spec.item_entity} vectors, version {spec.version}) "
                    f"could not be read from the feature store: {exc.message}",
                    retry_after_s=self.RETRY_S,
                )
                self._failed = (time.monotonic(), failed)
                raise failed from None
            return self._index

    async def _read(self, timeout_s: float | None) -> RetrievalIndex:
        spec, store = self._spec, self._store
        parts = [
            await store.read(
                spec.item_entity,
                spec.version,
                range(start, min(start + _INDEX_CHUNK, spec.items)),
                spec.fields,
                timeout_s=timeout_s,
            )
            for start in range(0, spec.items, _INDEX_CHUNK)
        ]
        fallback = None
        if spec.fallback_entity:
            ranks = fallback_fields(self._top)
            read = await store.read(
                spec.fallback_entity, spec.version, [0], ranks, timeout_s=timeout_s
            )
            fallback = read[0]
        return RetrievalIndex(np.concatenate(parts), fallback)


class VersionBuilder:
    """Builds served versions for the catalogue (`repository.manager.Builder`)."""

    def __init__(
        self,
        *,
        observer: BatchObserver | None = None,
        loop: LoopState | None = None,
        cache: ResultCache | None = None,
        feature_resolver: Callable[[FeaturesConfig], FeatureResolver] | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.cache = cache
        self._observer = observer
        self._loop = loop
        self._feature_resolver = feature_resolver
        self._drain_timeout_s = drain_timeout_s
        # What pipeline models call (the worker's data plane, set once it exists).
        self.pipeline_host: PipelineHost | None = None
        self.pipeline_observer: PipelineObserver | None = None
        # Loads read files and build sessions: off the event loop, one at a time (2 cores).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tailserve-loader")

    async def build(self, config: ModelConfig, version: int, version_dir: Path) -> Served:
        if config.pipeline is not None:
            return await self._pipeline(config, version)
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
        # Per instance, a runtime for each variant that may serve (the model alone: one).
        forms = served_variants(config) if config.variants.choices else [None]
        instances: list[list[Runtime]] = []
        timings: list[tuple[int, Bucket, int, float]] = []
        try:
            for _ in range(config.instances.count):
                runtimes: list[Runtime] = []
                instances.append(runtimes)
                for index, variant in enumerate(forms):
                    runtime, measured = await loop.run_in_executor(
                        self._loader,
                        load_and_warm,
                        dataclasses.replace(context, variant=variant),
                        plan,
                        buckets,
                    )
                    runtimes.append(runtime)
                    timings += [(index, *timing) for timing in measured]
        except BaseException:
            for runtime in itertools.chain.from_iterable(instances):
                runtime.unload()
            raise
        names = tuple(variant.name for variant in forms if variant is not None)
        chooser = None
        if len(names) > 1:
            chooser = VariantChooser(
                names,
                instances=config.instances.count,
                target_utilization=config.batching.target_utilization,
            )
        audit = RefusalAudit(config.slo.p99_ms / 1e3)
        scheduler = Scheduler(
            model=config.name,
            runtimes=instances,
            batcher=batcher_for(config, policy, audit),
            audit=audit,
            batched=config.batched,
            observer=self._observer,
            loop=self._loop,
            inline_below_s=config.instances.inline_below_ms / 1e3,
            background=background_lane(config),
            variants=chooser,
        )
        scheduler.best_rows = max(1, config.max_batch_size)
        for index, bucket, rows, seconds in timings:
            scheduler.seed(bucket, rows, seconds, index)
        scheduler.start()
        runtimes = list(itertools.chain.from_iterable(instances))
        served = ServedVersion(config, version, runtimes, scheduler, plan, buckets, policy)
        served.variants = names
        if config.cache.enabled and self.cache is not None:
            served.cache = model_view(self.cache, config, version)
        if config.features is not None:
            assert self._feature_resolver is not None  # checked before loading
            served.features = self._feature_resolver(config.features)
            # Before ready: the first request should not wait for a connection or the script.
            for problem in await served.features.warm():
                log.warning("model %r: its feature store is not ready: %s", config.name, problem)
        return served

    async def _pipeline(self, config: ModelConfig, version: int) -> ServedPipeline:
        assert config.pipeline is not None
        if self.pipeline_host is None:
            raise ModelNotServed(f"model {config.name!r} is a pipeline: this worker runs none")
        indexes: dict[str, StoredIndex] = {}
        queries: dict[str, FeatureResolver] = {}
        for step in config.pipeline.steps:
            if step.kind != "retrieve":
                continue
            if self._feature_resolver is None:
                raise ModelNotServed(
                    f"model {config.name!r} is not served: its step {step.name!r} searches "
                    "vectors kept in the feature store, which needs Redis (start the worker "
                    "with --redis-url)"
                )
            assert step.index is not None
            query = FeatureInput(
                input="query_vector",
                key="query",
                entity=step.index.query_entity,
                fields=step.index.fields,
                datatype="INT64",
                shape=[1],
            )
            resolver = self._feature_resolver(
                FeaturesConfig(version=step.index.version, inputs=[query])
            )
            queries[step.name] = resolver
            indexes[step.name] = stored = StoredIndex(step, resolver.store)
            try:
                # Before ready, with a start-up's time: a request's 250 ms a round trip is
                # for a store under load, not for a worker starting on a loaded machine.
                await stored.get(timeout_s=_INDEX_STARTUP_S)
            except TailserveError as exc:
                # As a feature lookup would: served, and each request says what is missing
                # until the vectors are in the store (the index is read again then).
                log.warning("model %r: step %r has no index yet: %s", config.name, step.name, exc)
        pipeline = Pipeline(
            config,
            self.pipeline_host,
            indexes=indexes,
            queries=queries,
            observer=self.pipeline_observer,
        )
        return ServedPipeline(config, version, pipeline)

    async def retire(self, served: Served) -> None:
        if isinstance(served, ServedPipeline):
            await served.pipeline.close()
            return
        await served.scheduler.close(drain_s=self._drain_timeout_s)
        for runtime in served.runtimes:
            runtime.unload()

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


def batching_policy(config: ModelConfig) -> str:
    """The policy in force: the configured one, or none for a model that cannot batch."""
    if not config.batched or not config.batching.enabled:
        return "none"
    return config.batching.policy


def background_lane(config: ModelConfig) -> BackgroundLane:
    """The model's lane for jobs: each batch within its share of the online queueing time."""
    queueing_s = config.slo.p99_ms / 1e3 * config.batching.admission_target
    return BackgroundLane(
        budget_s=queueing_s * config.jobs.budget_share, max_rows=max(1, config.max_batch_size)
    )


def batcher_for(config: ModelConfig, policy: str, audit: RefusalAudit | None = None) -> Batcher:
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
        audit=audit,
    )
