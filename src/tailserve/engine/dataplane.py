"""The one data plane behind every protocol: health, metadata, inference and the repository.

The HTTP and gRPC adapters convert their wire format to these calls and back; nothing here
knows a status code, a header or an encoded reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np

from tailserve.cache import ModelView, ResultCache, keys
from tailserve.cache.entry import Outputs
from tailserve.engine.accounts import BatchStats
from tailserve.engine.cost import LinearCost
from tailserve.engine.kept_refusals import KeptRefusals
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.engine.options import cache_mode, deadline_and_priority
from tailserve.engine.served import Served, ServedPipeline, ServedVersion
from tailserve.engine.validation import Checked
from tailserve.errors import InvalidInput, ModelNotFound, TailserveError
from tailserve.modelconfig import ModelConfig
from tailserve.repository.manager import ModelManager, ModelStatus
from tailserve.tensors import Tensor, numpy_dtype
from tailserve.version import __version__

_CACHED = BatchStats(0.0, 0.0, 0, "")

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]


class Hit(NamedTuple):
    """A fresh L1 hit: the served version's cache view, the key and the entry's stored bytes
    (an adapter may keep its encoded reply against that entry, while L1 holds it)."""

    view: ModelView
    key: str
    value: bytes


class DataPlane:
    def __init__(
        self,
        manager: ModelManager[Served],
        *,
        strict_readiness: bool = False,
        cache: ResultCache | None = None,
    ) -> None:
        self.manager = manager
        self.cache = cache
        self._strict = strict_readiness
        self.initial_load_done = False
        self.draining = False
        # Online inference requests seen (a count that only grows; one may count twice): how
        # the job runner knows whether online traffic is there to make room for.
        self.online_requests = 0
        # Told of each client's inference answered: model, rows, seconds since received.
        self.on_served: Callable[[str, int, float], None] | None = None
        # Where every adapter screens a request before reading it (`shed`, with the refusals
        # of a moment ago kept for the like requests after them).
        self.refusals = KeptRefusals(self.shed, self.refused)

    # --- health and metadata ----------------------------------------------------------------

    def knows(self, model: str) -> bool:
        """Whether ``model`` is in the repository (a metric label only for those: a client
        cannot grow the label set by inventing names)."""
        try:
            self.manager.state(model)
        except TailserveError:
            return False
        return True

    def serving(self, model: str, version: str | None = None) -> ServedVersion | None:
        """The version serving now, for a decoder made from its inputs (None: none is)."""
        try:
            served = self.manager.peek(model, version)
        except TailserveError:
            return None
        return served if isinstance(served, ServedVersion) else None

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Ready once the first load of every model has finished, and not shutting down.

        A model that failed to load keeps the server unready only with strict readiness; by
        default it is reported (model ready = false, repository index) and the rest serve. A
        model the worker was not set up to serve (a feature store, no Redis) did not fail: it
        is reported the same way and keeps no server unready.
        """
        if self.draining or not self.initial_load_done:
            return False
        states = [state for state in self.manager.states() if not state.cold]
        if self._strict:
            return all(state.ready or state.not_served for state in states)
        return all(state.ready or state.status is not ModelStatus.LOADING for state in states)

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "tailserve", "version": __version__, "extensions": EXTENSIONS}

    def model_ready(self, name: str, version: str | None = None) -> bool:
        state = self.manager.state(name)
        if version is None:
            return state.ready
        return state.ready and _as_int(version) in state.versions

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        served = self.manager.get(name, version)
        state = self.manager.state(name)
        config = served.config
        return {
            "name": name,
            "versions": [str(v) for v in sorted(state.versions)],
            "platform": _platform(config),
            "inputs": [_tensor_metadata(config, spec) for spec in config.inputs],
            "outputs": [_tensor_metadata(config, spec) for spec in config.outputs],
        }

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        served = self.manager.get(name, version)
        config: dict[str, Any] = msgspec.to_builtins(served.config)
        return config

    # --- inference --------------------------------------------------------------------------

    def shed(
        self,
        name: str,
        version: str | None,
        *,
        received_at: float,
        deadline_ms: float | None,
    ) -> None:
        """Before a request is decoded: refuse it at once if its model is already too busy for
        any request of its deadline (``deadline_ms``, else the SLO), taken at the highest
        priority. A request let in is then inferred ``screened``: its offer to the batcher may
        use more of its time left (`Item.screened`). A caller whose request may name a looser
        ``timeout`` than the SLO, and has no ``deadline_ms``, leaves it to `infer`.

        A model with a result cache is refused here only for the event loop's backlog, which a
        hit waits for as a miss does; a miss meets the model's test when it is offered.
        """
        self.online_requests += 1
        served = self.manager.peek(name, version)
        if served is None:  # unloaded for the memory budget: `infer` loads it, or refuses
            return
        if isinstance(served, ServedPipeline):
            self._shed_pipeline(served, received_at, deadline_ms)
            return
        config = served.config
        budget = deadline_ms / 1e3 if deadline_ms is not None else config.slo.p99_ms / 1e3
        cached = served.cache is not None and self.cache is not None
        served.scheduler.shed(deadline=received_at + budget, priority=1, queue=not cached)

    def _shed_pipeline(
        self, served: ServedPipeline, received_at: float, deadline_ms: float | None
    ) -> None:
        """A pipeline's request is refused before it is read only when the event loop's
        backlog leaves it too little of its deadline (its steps' models judge their queues,
        each within its share); the loop's state is read through its first model."""
        first = served.pipeline.first_model
        try:
            gate = self.manager.peek(first) if first else None
        except TailserveError:  # not ready: the step falls back, or says so
            return
        if not isinstance(gate, ServedVersion):
            return
        budget = deadline_ms / 1e3 if deadline_ms is not None else served.config.slo.p99_ms / 1e3
        gate.scheduler.shed(deadline=received_at + budget, priority=1, queue=False)

    def refused(self, name: str, version: str | None) -> None:
        """Count a request refused on an earlier shed's word (`DeadlineUnmeetable.
        reusable_until`) against the model that refused it."""
        self.model(name, version).scheduler.refused()

    async def infer(
        self,
        request: InferRequest,
        *,
        screened: bool = False,
        on_hit: Callable[[Hit], None] | None = None,
    ) -> InferResponse:
        """The request's response. ``screened``: `shed` let it in before it was decoded.
        ``on_hit``: told when the answer came fresh from L1."""
        self.online_requests += 1
        served = await self.manager.acquire(
            request.model, request.version, lambda c: deadline_and_priority(c, request)[0]
        )
        config = served.config
        wanted = _wanted_outputs(config, request)
        deadline, hard, priority = deadline_and_priority(config, request)
        if isinstance(served, ServedPipeline):
            return self._served(
                request, await self._run_pipeline(served, request, wanted, deadline)
            )
        pinned = _pinned_variant(served, request)

        checked = None
        view = served.cache
        if view is not None and view.keys.lossy and served.features is None:
            # Checked before the lookup: a request differing from a computed one only in what
            # the key leaves out or rounds (a missing or bad input among those) must get its
            # 400 on a hit as on a miss.
            checked = _checked(served, request, request.inputs)

        async def compute() -> tuple[Outputs, BatchStats]:
            inputs = request.inputs
            if served.features is not None:
                inputs = await served.features.resolve(inputs)
            plan = checked if checked is not None else _checked(served, request, inputs)
            bucket = served.buckets.classify(plan)
            outputs, stats = await served.scheduler.infer(
                plan.arrays,
                plan.rows,
                bucket,
                deadline=deadline,
                priority=priority,
                hard_deadline=hard,
                screened=screened,
                inner=request.inner,
                variant=pinned,
            )
            if served.variants and not stats.variant:  # (one variant: no choice to make)
                stats = dataclasses.replace(stats, variant=served.variants[0])
            return outputs, stats

        parameters: dict[str, Any] = {"model_version": str(served.version)}
        stats: BatchStats | None
        if view is None or self.cache is None:
            outputs, stats = await compute()
        else:
            outputs, stats = await self._cached(
                served, request, deadline, compute, on_hit, parameters
            )
        if stats is None:  # answered from the cache: no queue, no batch
            stats = _CACHED
        elif stats.variant:
            parameters["variant"] = stats.variant
        parameters.update(
            queue_us=int(stats.queue_s * 1e6),
            compute_us=int(stats.compute_s * 1e6),
            batch_size=stats.batch_size,
            cost_class=stats.cost_class,
        )
        if request.received_at is not None and not request.inner:
            served.scheduler.answered(time.monotonic() - request.received_at)
        return self._served(request, _response(served, request, wanted, outputs, parameters))

    async def _cached(
        self,
        served: ServedVersion,
        request: InferRequest,
        deadline: float,
        compute: Callable[[], Awaitable[tuple[Outputs, BatchStats]]],
        on_hit: Callable[[Hit], None] | None,
        parameters: dict[str, Any],
    ) -> tuple[Outputs, BatchStats | None]:
        """``compute`` through the result cache: the outputs, and the batch's stats (None: an
        answer from the cache); where the answer came from goes into ``parameters``."""
        view, cache = served.cache, self.cache
        assert view is not None and cache is not None
        key = view.keys.key(request.inputs, request.parameters)
        budget_s = deadline - (request.received_at or deadline)
        slo_s = served.config.slo.p99_ms / 1e3

        def pressed() -> bool:
            return served.scheduler.pressed(budget_s if budget_s > 0 else slo_s)

        answer = await cache.serve(view, key, cache_mode(request), compute, pressed)
        if answer.value is not None and on_hit is not None:
            on_hit(Hit(view, key, answer.value))
        parameters["cache"] = answer.source
        if answer.lineage is not None and answer.extra is None:
            lineage = answer.lineage
            parameters["cache_computed_at"] = lineage.computed_at
            parameters["cache_computed_by"] = lineage.computed_by
            if lineage.variant:
                parameters["variant"] = lineage.variant
        return answer.outputs, answer.extra

    def _served(self, request: InferRequest, response: InferResponse) -> InferResponse:
        if self.on_served is not None and request.received_at is not None and not request.inner:
            shape = response.outputs[0].data.shape if response.outputs else (0,)
            rows = shape[0] if shape else 1
            self.on_served(request.model, rows, time.monotonic() - request.received_at)
        return response

    async def _run_pipeline(
        self,
        served: ServedPipeline,
        request: InferRequest,
        wanted: list[tuple[str, str, dict[str, Any]]],
        deadline: float,
    ) -> InferResponse:
        outputs, stages = await served.pipeline.run(request.inputs, deadline)
        parameters: dict[str, Any] = {
            "model_version": str(served.version),
            # (its steps' models queue and batch; the pipeline is one request of its own)
            "queue_us": 0,
            "compute_us": int(sum(stage.seconds for stage in stages) * 1e6),
            "batch_size": 1,
            "cost_class": "pipeline",
            "stages": [stage.document() for stage in stages],
        }
        degraded = sorted({f"{s.name}:{how}" for s in stages for how in s.degraded})
        if degraded:
            parameters["degraded"] = ",".join(degraded)
        return _response(served, request, wanted, outputs, parameters)

    def model(self, name: str, version: str | None = None) -> ServedVersion:
        """A served model that runs a runtime of its own (a pipeline has none: 400)."""
        served = self.manager.get(name, version)
        if isinstance(served, ServedPipeline):
            raise InvalidInput(
                f"model {name!r} is a pipeline: it has no batches, jobs or statistics of its "
                "own (its steps' models do)"
            )
        return served

    async def infer_job(self, request: InferRequest) -> InferResponse:
        """A job's request, run in its model's background lane (engine/background.py): not
        through the cache, with no deadline, only in the time online requests leave free; one
        of many rows in pieces that each fit the lane's budget."""
        served = self.model(request.model, request.version)
        wanted = _wanted_outputs(served.config, request)
        inputs = request.inputs
        if served.features is not None:
            inputs = await served.features.resolve(inputs)
        plan = served.plan.check(inputs, max_rows=served.config.jobs.max_rows)
        scheduler, buckets = served.scheduler, served.buckets
        if not served.config.batched or plan.rows <= 1:
            outputs, stats = await scheduler.infer_background(
                plan.arrays, plan.rows, buckets.classify(plan)
            )
        else:

            def piece(start: int, end: int) -> Checked:
                arrays = {name: array[start:end] for name, array in plan.arrays.items()}
                return Checked(arrays, end - start, plan.group)

            def predict(rows: int) -> float:
                return scheduler.predict(buckets.classify(piece(0, rows)), rows)

            size = scheduler.background.rows_that_fit(predict, plan.rows)
            parts = [piece(at, min(at + size, plan.rows)) for at in range(0, plan.rows, size)]
            done = await asyncio.gather(
                *(scheduler.infer_background(p.arrays, p.rows, buckets.classify(p)) for p in parts)
            )
            outputs = {name: np.concatenate([d[0][name] for d in done]) for name in done[0][0]}
            stats = BatchStats(
                max(d[1].queue_s for d in done),
                sum(d[1].compute_s for d in done),
                len(parts),
                done[0][1].cost_class,
            )
        parameters: dict[str, Any] = {
            "model_version": str(served.version),
            "queue_us": int(stats.queue_s * 1e6),
            "compute_us": int(stats.compute_s * 1e6),
            "batch_size": stats.batch_size,
            "cost_class": stats.cost_class,
        }
        return _response(served, request, wanted, outputs, parameters)

    async def invalidate(
        self, model: str | None = None, version: str | None = None, prefix: str | None = None
    ) -> dict[str, Any]:
        """Drop cached results by model, version or key prefix, on every worker."""
        if self.cache is None:
            raise InvalidInput("this worker has no result cache")
        if prefix is not None:
            if model is not None or version is not None:
                raise InvalidInput("give either a key 'prefix' or a 'model' (and 'version')")
            if not isinstance(prefix, str) or not prefix.startswith(keys.PREFIX + ":"):
                raise InvalidInput(
                    f"'prefix' must be a cache key prefix starting with "
                    f"{keys.PREFIX + ':'!r}, got {prefix!r}"
                )
            chosen = prefix
        elif model is not None:
            if not isinstance(model, str):
                raise InvalidInput(f"'model' must be a model name, got {model!r}")
            chosen = keys.model_prefix(model)
            if version is not None:
                # A field of the body, not a path: a bad one is a bad request, not a 404.
                chosen = keys.version_prefix(model, _as_int(version, InvalidInput, "'version'"))
        else:
            raise InvalidInput("say what to invalidate: 'model' (and 'version') or 'prefix'")
        report = await self.cache.invalidate(chosen)
        return {"prefix": chosen, **report}

    def model_stats(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension document, with tailserve's batching state added."""
        state = self.manager.state(name)
        if version is not None:
            chosen = [self.manager.get(name, version)]
        else:
            chosen = [state.versions[v] for v in sorted(state.versions)]
        documents = []
        for served in chosen:
            if isinstance(served, ServedPipeline):
                documents.append({"name": name, "version": str(served.version)})
                continue
            scheduler = served.scheduler
            document = scheduler.stats.document(name, str(served.version))
            document["batching"] = {
                "policy": served.policy,
                "queued": scheduler.queue_depth,
                "busy_instances": scheduler.busy_instances,
                # Batches run on the event loop's thread (cheap ones: instances.inline_below_ms).
                "inline_batches": scheduler.inline_batches,
                "rejected": dict(scheduler.stats.rejected),
                "refusals_reused": scheduler.stats.refusals_reused,
                "false_refusals": scheduler.stats.false_refusals,
                "recent_rejections": list(scheduler.stats.recent_rejections),
                "admission_share": _share(scheduler.batcher),
                "delays_ms": _delays(scheduler.batcher),
                "deadline_misses": scheduler.stats.deadline_misses,
                "cost_model": {
                    label: _cost_document(cost, served.config.max_batch_size)
                    for label, cost in scheduler.batcher.costs().items()
                },
            }
            if served.cache is not None:
                l1 = served.cache.l1
                document["cache"] = {
                    "l1": {
                        "entries": len(l1),
                        "bytes": l1.bytes,
                        "evictions": l1.evictions,
                        "policy": l1.policy,
                        "max_entries": l1.max_entries,
                        "max_bytes": l1.max_bytes,
                    },
                    "l2": self._l2_state(),
                    "key_prefix": served.cache.keys.prefix,
                }
            documents.append(document)
        return {"model_stats": documents}

    def _l2_state(self) -> dict[str, Any] | None:
        redis = self.cache.redis if self.cache is not None else None
        if redis is None:
            return None
        return {
            "breaker": redis.breaker.state.name.lower(),
            "skipped": redis.skipped,
            "skips": {f"{op}/{reason}": n for (op, reason), n in sorted(redis.skips.items())},
        }

    # --- repository -------------------------------------------------------------------------

    def repository_index(self, *, ready_only: bool = False) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        loaded = {state.name: state for state in self.manager.states()}
        for name in sorted(set(loaded) | set(self.manager.known_on_disk())):
            state = loaded.get(name)
            if state is None:
                entries.append({"name": name, "state": "UNAVAILABLE", "reason": "not loaded"})
                continue
            if state.versions:
                for version in sorted(state.versions):
                    entries.append({"name": name, "version": str(version), "state": "READY"})
            else:
                entries.append({"name": name, "state": state.status.value, "reason": state.reason})
        if ready_only:
            entries = [e for e in entries if e["state"] == "READY"]
        return entries

    async def load_model(self, name: str) -> None:
        await self.manager.load(name)

    async def unload_model(self, name: str) -> None:
        await self.manager.unload(name)


def _response(
    served: Served,
    request: InferRequest,
    wanted: list[tuple[str, str, dict[str, Any]]],
    outputs: Outputs,
    parameters: dict[str, Any],
) -> InferResponse:
    tensors = []
    for name, spec_datatype, tensor_parameters in wanted:
        array = np.asarray(outputs[name], dtype=numpy_dtype(spec_datatype))
        tensors.append(Tensor(name, spec_datatype, array, tensor_parameters))
    return InferResponse(
        model=request.model,
        version=str(served.version),
        outputs=tensors,
        id=request.id,
        parameters=parameters,
    )


def _checked(served: ServedVersion, request: InferRequest, inputs: list[Tensor]) -> Checked:
    """The inputs checked by the served version's plan (done already where the request's
    decoder was made from that plan, for the inputs the client sent)."""
    done = request.checked
    if done is not None and done[0] is served.plan and inputs is request.inputs:
        return done[1]
    return served.plan.check(inputs)


def _pinned_variant(served: ServedVersion, request: InferRequest) -> int | None:
    """The variant the request asks for by name (parameter ``variant``), if any."""
    name = request.parameters.get("variant", request.variant)
    if name is None:
        return None
    if not isinstance(name, str):
        raise InvalidInput(f"parameter 'variant' must be a variant's name, got {name!r}")
    if not served.variants:
        raise InvalidInput(f"model {served.config.name!r} has no variants to choose from")
    if name not in served.variants:
        raise InvalidInput(
            f"model {served.config.name!r} has no variant {name!r} serving "
            f"(serving: {', '.join(served.variants)})"
        )
    return served.variants.index(name) if len(served.variants) > 1 else None


def _delays(batcher: Any) -> dict[str, float]:
    """What the batcher adds to its estimates for the time outside the model (ms)."""
    names = {
        "event_loop": "loop_delay_s",
        "hand_off": "overhead_s",
        "admission_correction": "correction_s",
    }
    return {name: getattr(batcher, attribute, 0.0) * 1e3 for name, attribute in names.items()}


def _share(batcher: Any) -> float | None:
    """The share of its time left a request may queue (the deadline batcher's only)."""
    share = getattr(batcher, "share", None)
    return share() if share is not None else None


def _cost_document(cost: LinearCost, max_rows: int) -> dict[str, Any]:
    return {
        "fixed_ms": cost.fixed_s * 1e3,
        "per_row_us": cost.per_row_s * 1e6,
        "error_ms": cost.error_s * 1e3,
        "observations": cost.observations,
        "predicted_ms": {str(rows): cost.predict(rows) * 1e3 for rows in sorted({1, max_rows})},
    }


def _wanted_outputs(
    config: ModelConfig, request: InferRequest
) -> list[tuple[str, str, dict[str, Any]]]:
    declared = {spec.name: spec.datatype for spec in config.outputs}
    if request.outputs is None:
        return [(name, datatype, {}) for name, datatype in declared.items()]
    wanted = []
    for output in request.outputs:
        datatype = declared.get(output.name)
        if datatype is None:
            raise InvalidInput(
                f"model {config.name!r} has no output named {output.name!r} "
                f"(outputs: {', '.join(declared)})"
            )
        wanted.append((output.name, datatype, output.parameters))
    return wanted


def _tensor_metadata(config: ModelConfig, spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": config.full_shape(spec)}


def _platform(config: ModelConfig) -> str:
    return {
        "onnx": "onnxruntime_onnx",
        "lightgbm": "lightgbm",
        "sklearn": "sklearn",
        "python": "python",
        "torch": "pytorch_libtorch",
        "pipeline": "ensemble",
    }[config.runtime]


def _as_int(
    version: Any, refuse: type[TailserveError] = ModelNotFound, what: str = "model version"
) -> int:
    """A version as a whole number; anything else is refused with ``refuse`` (in a path, an
    unknown model version: 404; in a body's field, a bad request)."""
    if isinstance(version, bool) or not isinstance(version, int | str):
        raise refuse(f"{what} must be a whole number, got {version!r}")
    try:
        return int(version)
    except ValueError:
        raise refuse(f"{what} must be a whole number, got {version!r}") from None
