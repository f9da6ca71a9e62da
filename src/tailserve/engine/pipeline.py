"""A pipeline model's run: its steps in order, each within its share of the deadline.

Each step gets the time its budget allows (`budgets.allot`); one that would run late does what
its ``on_late`` declares rather than fail the request:

- ``fewer``: before it runs, cut the candidate rows (best first) to what fits its time, by the
  called model's cost model and queue when it has them, else in proportion to its share;
- ``variant``: call the model's cheapest variant when the first would not fit;
- ``fallback``: when it runs out of time or its model refuses, copy the declared state (or,
  for a retrieval, the precomputed list) and go on.

A step with no fallback that runs past its budget takes the time from the steps after it; only
the request's own deadline stops it. Every step's time and degradations go in the response
(``parameters.stages``) and to the observer (metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tailserve.engine.budgets import (
    Allotment,
    allot_step,
    critical_paths,
    proportional_rows,
    rows_that_fit,
)
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.engine.retrieval import RetrievalIndex
from tailserve.engine.validation import InputPlan
from tailserve.errors import DeadlineExceeded, InvalidInput, Unavailable
from tailserve.modelconfig import ModelConfig
from tailserve.modelconfig.pipeline import PipelineConfig, PipelineStep, dependencies_of
from tailserve.tensors import Tensor, datatype_of

if TYPE_CHECKING:
    from tailserve.cache.features import FeatureResolver

Array = np.ndarray[Any, Any]


class ModelPort(Protocol):
    """What a step needs to know of a model it calls, beside calling it."""

    @property
    def variants(self) -> tuple[str, ...]: ...

    def wait_s(self) -> float:
        """How long a request offered now would queue."""

    def cost(self, inputs: list[Tensor]) -> Callable[[int], float] | None:
        """The predicted time of the first ``n`` rows of ``inputs`` (None: not known)."""


class IndexSource(Protocol):
    """A retrieve step's index: read from the store when first needed."""

    @property
    def loaded(self) -> RetrievalIndex | None: ...

    @property
    def problem(self) -> str | None:
        """Why the index could not be read last time (None: it could, or not tried yet)."""

    async def get(self) -> RetrievalIndex: ...


class PipelineHost(Protocol):
    """The worker as the pipeline sees it (`engine.pipeline_host`)."""

    async def call(self, request: InferRequest) -> InferResponse: ...

    def port(self, model: str) -> ModelPort: ...

    async def resolver(self, model: str, deadline: float) -> FeatureResolver:
        """The feature lookups of ``model`` (loading it first if it is cold)."""


class PipelineObserver(Protocol):
    def on_stage(
        self, pipeline: str, stage: str, seconds: float, degradations: list[str]
    ) -> None: ...


@dataclass(slots=True)
class Stage:
    """One step's account in the response."""

    name: str
    budget_s: float
    seconds: float = 0.0
    rows: int | None = None
    degraded: list[str] = field(default_factory=list)
    variant: str | None = None

    def document(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "us": int(self.seconds * 1e6),
            "budget_us": int(self.budget_s * 1e6),
            "degraded": self.degraded,
        }
        if self.rows is not None:
            out["rows"] = self.rows
        if self.budget_s and self.seconds > self.budget_s:
            out["over_budget"] = True  # ran past its share (a step with no fallback may)
        if self.variant is not None:
            out["variant"] = self.variant
        return out


class _Late(Exception):
    """A step ran out of its time."""


@dataclass(frozen=True, slots=True)
class _Made:
    """What a step made: outputs by the step's (or its model's) names, the rows it worked
    on, and the cheaper variant that served it (None: the first, or no model)."""

    outputs: dict[str, Array]
    rows: int | None = None
    variant: str | None = None


class Pipeline:
    def __init__(
        self,
        config: ModelConfig,
        host: PipelineHost,
        *,
        indexes: Mapping[str, IndexSource] | None = None,
        queries: dict[str, FeatureResolver] | None = None,
        observer: PipelineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert config.pipeline is not None
        self.name = config.name
        self.spec: PipelineConfig = config.pipeline
        self.plan = InputPlan(config)
        self.outputs = [(spec.name, spec.shape) for spec in config.outputs]
        self._host = host
        self._indexes = indexes or {}
        self._queries = queries or {}
        self._observer = observer
        self._clock = clock
        budgets = [step.budget_ms / 1e3 for step in self.spec.steps]
        self._waits = [dependencies_of(self.spec, i) for i in range(len(self.spec.steps))]
        self._budgets = budgets
        self._paths = critical_paths(budgets, self._waits)
        # The first model a step calls ("": none).
        self.first_model = next((s.model for s in self.spec.steps if s.kind == "model"), "")
        self._abandoned: set[asyncio.Future[_Made]] = set()

    async def run(
        self, inputs: list[Tensor], deadline: float
    ) -> tuple[dict[str, Array], list[Stage]]:
        """The pipeline's outputs for one request, and each step's account."""
        checked = self.plan.check(inputs)
        state = {
            name: Tensor(name, datatype_of(array), array) for name, array in checked.arrays.items()
        }
        steps = self.spec.steps
        stages = [Stage(step.name, 0.0) for step in steps]
        runs: list[asyncio.Task[None]] = []
        for index in range(len(steps)):
            waits = [runs[j] for j in self._waits[index]]
            work = self._run_step(index, state, deadline, stages[index], waits)
            runs.append(asyncio.ensure_future(work))
        try:
            await asyncio.gather(*runs)
        except BaseException:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        missing = [name for name, _ in self.outputs if name not in state]
        if missing:
            raise InvalidInput(f"pipeline {self.name!r} made no {missing[0]!r}")
        return {name: _shaped(state[name].data, spec) for name, spec in self.outputs}, stages

    async def _run_step(
        self,
        index: int,
        state: dict[str, Tensor],
        deadline: float,
        stage: Stage,
        waits: list[asyncio.Task[None]],
    ) -> None:
        """Step ``index`` once the steps it waits for are done, within its share."""
        if waits:
            await asyncio.gather(*waits)
        step = self.spec.steps[index]
        start = self._clock()
        if self.spec.budgets:
            share = allot_step(self._budgets[index], self._paths[index], start, deadline)
        else:
            share = Allotment(deadline, deadline, 1.0)
        stage.budget_s = max(0.0, share.plan - start)
        try:
            await self._step(step, state, share, deadline, stage)
        except (_Late, Unavailable) as exc:
            if not (self.spec.budgets and "fallback" in step.on_late):
                if isinstance(exc, _Late):
                    raise DeadlineExceeded(
                        f"pipeline {self.name!r}: step {step.name!r} ran past the "
                        "request's deadline"
                    ) from None
                raise
            self._fall_back(step, state, stage, exc)
            stage.degraded.append("fallback")
        finally:
            stage.seconds = self._clock() - start
            if self._observer is not None:
                self._observer.on_stage(self.name, step.name, stage.seconds, stage.degraded)

    # --- steps ------------------------------------------------------------------------------

    async def _step(
        self,
        step: PipelineStep,
        state: dict[str, Tensor],
        share: Allotment,
        deadline: float,
        stage: Stage,
    ) -> None:
        # Only a step that can fall back is cut off at its own time; the others may take
        # what the steps after them would have had, up to the request's deadline.
        can_stop = self.spec.budgets and "fallback" in step.on_late
        cutoff = share.deadline if can_stop else deadline
        if step.kind == "topk":
            self._top(step, state, stage)
            return
        left = cutoff - self._clock()
        if left <= 0:
            raise _Late
        if step.kind == "retrieve":
            work = self._retrieve(step, state, share, stage)
        elif step.kind == "features":
            work = self._features(step, state, share, stage)
        else:
            work = self._model(step, state, share, cutoff, stage)
        # Shielded: a step given up on runs to its end in the background rather than being
        # cancelled mid-call (a Redis read cancelled halfway costs its connection, and the
        # reconnect is paid by the next request); what it makes then is dropped.
        task = asyncio.ensure_future(work)
        try:
            made = await asyncio.wait_for(asyncio.shield(task), timeout=left)
        except TimeoutError:
            self._abandon(task)
            raise _Late from None
        except asyncio.CancelledError:
            task.cancel()
            raise
        stage.rows = made.rows
        if made.variant is not None:
            stage.variant = made.variant
            stage.degraded.append("variant")
        self._write(step, state, made.outputs)

    def _abandon(self, task: asyncio.Future[_Made]) -> None:
        self._abandoned.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future[_Made]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # (seen: a late step's failure is no one's to report)

    async def close(self) -> None:
        """Cancel the steps still running after their requests gave up on them."""
        for task in list(self._abandoned):
            task.cancel()
        await asyncio.gather(*self._abandoned, return_exceptions=True)

    async def _retrieve(
        self, step: PipelineStep, state: dict[str, Tensor], share: Allotment, stage: Stage
    ) -> _Made:
        # Decided before the first wait: a step given up on as late goes on in the background,
        # and must not change its stage's record after the stage was reported.
        top = step.top
        if self._degrading(step, "fewer") and share.behind:
            top = proportional_rows(top, step.min_rows, share.ratio)
            stage.degraded.append("fewer")
        index = await self._indexes[step.name].get()
        query_id = state[step.query]
        resolved = await self._queries[step.name].resolve([Tensor("query", "INT64", query_id.data)])
        vector = resolved[0].data.reshape(-1)
        ids, scores = index.search(vector, top)
        return _Made({"ids": ids, "scores": scores}, len(ids))

    async def _features(
        self, step: PipelineStep, state: dict[str, Tensor], share: Allotment, stage: Stage
    ) -> _Made:
        if self._degrading(step, "fewer") and share.behind:
            found = len(state[step.rows[0]].data)
            kept = proportional_rows(found, step.min_rows, share.ratio)
            if kept < found:
                _cut(state, step.rows, slice(0, kept))
                stage.degraded.append("fewer")
        ids = [self._input(state, name, source) for name, source in step.inputs.items()]
        rows = len(state[step.rows[0]].data) if step.rows else None
        resolver = await self._host.resolver(step.model, share.deadline)
        resolved = await resolver.resolve(ids)
        return _Made({tensor.name: tensor.data for tensor in resolved}, rows)

    async def _model(
        self,
        step: PipelineStep,
        state: dict[str, Tensor],
        share: Allotment,
        cutoff: float,
        stage: Stage,
    ) -> _Made:
        port = self._host.port(step.model)
        inputs = [self._input(state, name, source) for name, source in step.inputs.items()]
        parameters: dict[str, Any] = {}
        if self.spec.budgets and (
            self._degrading(step, "fewer") or self._degrading(step, "variant")
        ):
            cost = port.cost(inputs)
            room = share.plan - self._clock() - port.wait_s()
            rows = len(inputs[0].data) if inputs and inputs[0].data.ndim else 1
            kept = rows
            if self._degrading(step, "fewer"):
                if cost is not None:
                    kept = rows_that_fit(rows, step.min_rows, room, cost)
                elif share.behind:
                    kept = proportional_rows(rows, step.min_rows, share.ratio)
                if kept < rows:
                    _cut(state, step.rows, slice(0, kept))
                    inputs = [self._input(state, n, s) for n, s in step.inputs.items()]
                    stage.degraded.append("fewer")
            late = share.behind or (cost is not None and cost(kept) > room)
            if self._degrading(step, "variant") and len(port.variants) > 1 and late:
                parameters["variant"] = port.variants[-1]
        now = self._clock()
        parameters["timeout"] = max(1, int((cutoff - now) * 1e6))
        request = InferRequest(
            step.model, inputs, parameters=parameters, received_at=now, inner=True
        )
        sent = len(inputs[0].data) if inputs and inputs[0].data.ndim else None
        response = await self._host.call(request)
        variant = response.parameters.get("variant")
        cheaper = (
            variant
            if variant is not None and port.variants and variant != port.variants[0]
            else None
        )
        return _Made({t.name: t.data for t in response.outputs}, sent, cheaper)

    def _top(self, step: PipelineStep, state: dict[str, Tensor], stage: Stage) -> None:
        scores = np.asarray(state[step.by].data).reshape(-1)
        keep = min(step.k, len(scores))
        order = np.argsort(-scores, kind="stable")[:keep]
        _cut(state, step.rows, order)
        stage.rows = keep

    # --- helpers ----------------------------------------------------------------------------

    def _degrading(self, step: PipelineStep, how: str) -> bool:
        return self.spec.budgets and how in step.on_late

    def _fall_back(
        self, step: PipelineStep, state: dict[str, Tensor], stage: Stage, cause: Exception
    ) -> None:
        if step.kind == "retrieve":
            index = self._indexes[step.name].loaded
            if index is None or not len(index.fallback):
                stored = self._indexes[step.name]
                why = (
                    cause.message
                    if isinstance(cause, Unavailable)
                    else stored.problem
                    or "it ran out of time with the retrieval index still being read"
                )
                raise Unavailable(
                    f"pipeline {self.name!r}: step {step.name!r} could not run ({why}) and has "
                    "no precomputed list to stand in",
                    retry_after_s=1.0,
                )
            ids, scores = index.precomputed(step.top)
            self._write(step, state, {"ids": ids, "scores": scores})
            stage.rows = len(ids)
        for source, target in step.fallback.items():
            tensor = state[source]
            state[target] = Tensor(target, tensor.datatype, tensor.data)

    @staticmethod
    def _input(state: dict[str, Tensor], name: str, source: str) -> Tensor:
        tensor = state[source]
        return Tensor(name, tensor.datatype, tensor.data)

    @staticmethod
    def _write(step: PipelineStep, state: dict[str, Tensor], made: dict[str, Array]) -> None:
        for name, target in step.outputs.items():
            array = made.get(name)
            if array is not None:
                data = np.asarray(array)
                if data.ndim == 2 and data.shape[1] == 1:
                    data = data.reshape(-1)  # a column: one value a candidate
                state[target] = Tensor(target, datatype_of(data), data)


def _cut(state: dict[str, Tensor], names: list[str], rows: slice | Array) -> None:
    """Keep ``rows`` of every candidate-aligned tensor (they are cut together)."""
    for name in names:
        tensor = state.get(name)
        if tensor is not None:
            state[name] = Tensor(name, tensor.datatype, tensor.data[rows])


def _shaped(array: Array, shape: list[int]) -> Array:
    """A candidate list as the output declares it: ``[-1]`` is one flat row of values (a
    model step answers a column, ``[n, 1]``)."""
    return array.reshape(-1) if shape == [-1] else array
