"""Pipelines as policy: budgets carved from the deadline, and each way a late step degrades,
run against a fake worker (the host) so that the steps' timing is the test's to set."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tailserve.engine.budgets import allot, critical_paths, proportional_rows, rows_that_fit
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.engine.pipeline import Pipeline
from tailserve.engine.retrieval import RetrievalIndex
from tailserve.errors import ConfigError, DeadlineExceeded, DeadlineUnmeetable
from tailserve.modelconfig import ModelConfig, parse_model_config
from tailserve.tensors import Tensor

# --- budgets ----------------------------------------------------------------------------------


def test_each_step_gets_its_budget_and_a_share_of_the_time_to_spare() -> None:
    share = allot([0.004, 0.006, 0.020], 0, now=10.0, deadline=10.030)
    assert share.deadline == pytest.approx(10.004) and not share.behind
    # 50 ms for 30 ms of budgets: each step's is stretched by 5/3.
    share = allot([0.004, 0.006, 0.020], 0, now=10.0, deadline=10.050)
    assert share.deadline == pytest.approx(10.0 + 0.004 * 5 / 3) and not share.behind
    # ... to run in before it is given up on; its work is still planned to its budget.
    assert share.plan == pytest.approx(10.004)


def test_budgets_shrink_in_proportion_when_the_steps_before_ran_late() -> None:
    # 15 ms left for 26 ms of budgets: the step has 15/26 of its 6.
    share = allot([0.004, 0.006, 0.020], 1, now=10.035, deadline=10.050)
    assert share.ratio == pytest.approx(15 / 26)
    assert share.deadline == pytest.approx(10.035 + 0.006 * 15 / 26) and share.behind
    assert share.plan == share.deadline


def test_a_step_without_a_budget_may_use_what_is_left() -> None:
    share = allot([0.004, 0.0], 1, now=10.0, deadline=10.030)
    assert share.deadline == 10.030 and not share.behind


def test_rows_that_fit_is_the_most_whose_cost_fits() -> None:
    def cost(rows: int) -> float:
        return 0.001 + rows * 0.0001  # 1 ms + 0.1 ms a row

    assert rows_that_fit(400, 50, 0.050, cost) == 400
    assert rows_that_fit(400, 50, 0.011, cost) == 100
    assert rows_that_fit(400, 50, 0.001, cost) == 50  # none fits: the floor
    assert proportional_rows(400, 50, 0.5) == 200
    assert proportional_rows(400, 50, 0.01) == 50
    assert proportional_rows(30, 50, 0.5) == 30


def test_retrieval_finds_the_best_scoring_items_best_first() -> None:
    rng = np.random.default_rng(1)
    items = rng.normal(size=(1000, 8)).astype(np.float32)
    query = rng.normal(size=8).astype(np.float32)
    ids, scores = RetrievalIndex(items).search(query, 10)
    expected = np.argsort(-(items @ query))[:10]
    np.testing.assert_array_equal(ids, expected)
    assert np.all(np.diff(scores) <= 0)
    ids, _ = RetrievalIndex(items, fallback=np.array([5, 3, 9])).precomputed(2)
    np.testing.assert_array_equal(ids, [5, 3])


# --- the config -------------------------------------------------------------------------------


def config(steps: list[dict[str, Any]], *, budgets: bool = True) -> ModelConfig:
    raw = {
        "name": "flow",
        "runtime": "pipeline",
        "inputs": [{"name": "ids", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "final", "datatype": "FP32", "shape": [-1]}],
        "slo": {"p99_ms": 50},
        "pipeline": {"budgets": budgets, "steps": steps},
    }
    return parse_model_config(raw, source="flow/model.yaml")


SCORE = {
    "name": "score",
    "kind": "model",
    "model": "scorer",
    "budget_ms": 20,
    "inputs": {"x": "ids"},
    "outputs": {"y": "final"},
}


def test_a_step_reading_what_nothing_gave_is_refused_naming_it() -> None:
    bad = {**SCORE, "inputs": {"x": "nowhere"}}
    with pytest.raises(ConfigError, match=r"steps\[0\].*reads 'nowhere'"):
        config([bad])


def test_fewer_needs_rows_and_fallback_needs_what_to_copy() -> None:
    with pytest.raises(ConfigError, match="'fewer' needs 'rows'"):
        config([{**SCORE, "on_late": ["fewer"]}])
    with pytest.raises(ConfigError, match="'fallback' needs 'fallback'"):
        config([{**SCORE, "on_late": ["fallback"]}])


def test_a_pipeline_section_goes_with_the_pipeline_runtime() -> None:
    raw = {
        "name": "m",
        "runtime": "onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        "pipeline": {"steps": [SCORE]},
    }
    with pytest.raises(ConfigError, match="field 'pipeline'"):
        parse_model_config(raw, source="m/model.yaml")


# --- running --------------------------------------------------------------------------------


class Port:
    def __init__(self, per_row_s: float, wait_s: float = 0.0, variants: tuple[str, ...] = ()):
        self.per_row_s = per_row_s
        self._wait_s = wait_s
        self.variants = variants

    def wait_s(self) -> float:
        return self._wait_s

    def cost(self, inputs: list[Tensor]) -> Callable[[int], float] | None:
        return lambda rows: rows * self.per_row_s


class Host:
    """The worker, faked: the model doubles its input, or does what the test says."""

    def __init__(self, port: Port, behaviour: str = "answer") -> None:
        self._port = port
        self.behaviour = behaviour
        self.requests: list[InferRequest] = []
        self.never = asyncio.Event()

    async def call(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        if self.behaviour == "refuse":
            raise DeadlineUnmeetable("the scorer's queue is too long for this deadline")
        if self.behaviour == "hang":
            await self.never.wait()
        x = request.inputs[0].data
        variants = self._port.variants
        variant = request.parameters.get("variant") or (variants[0] if variants else None)
        parameters = {"variant": variant} if variant else {}
        y = Tensor("y", "FP32", (x * 2).astype(np.float32))
        return InferResponse(request.model, "1", [y], parameters=parameters)

    def port(self, model: str) -> Port:
        return self._port

    async def resolver(self, model: str, deadline: float) -> Any:
        raise AssertionError("no feature steps here")


IDS = [Tensor("ids", "INT64", np.arange(400, dtype=np.int64))]


def deadline_in(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


def ticking() -> Callable[[], float]:
    """A clock that moves a microsecond a reading, from the loop's now: a test's time that a busy
    machine's lost milliseconds do not eat into (the real clock is for the tests that wait)."""
    start = asyncio.get_running_loop().time()
    readings = itertools.count()
    return lambda: start + next(readings) * 1e-6


async def test_on_schedule_no_step_degrades_and_each_is_accounted() -> None:
    host = Host(Port(per_row_s=0.00001))
    clock = ticking()
    steps = [{**SCORE, "on_late": ["fewer"], "rows": ["ids"]}]
    pipeline = Pipeline(config(steps), host, clock=clock)
    outputs, stages = await pipeline.run(IDS, clock() + 0.05)
    np.testing.assert_array_equal(outputs["final"], np.arange(400) * 2)
    (stage,) = stages
    assert stage.degraded == [] and stage.rows == 400 and stage.seconds > 0
    assert stage.document()["budget_us"] > 19_000
    # With no fallback to give, the step may run into the time of the steps after it: its
    # model's deadline is the request's.
    assert 40_000 < host.requests[0].parameters["timeout"] <= 50_000


async def test_fewer_passes_on_as_many_rows_as_the_models_cost_fits() -> None:
    # 0.1 ms a row and 5 ms of queue ahead: of the step's 20 ms, 15 are left for 150 rows.
    host = Host(Port(per_row_s=0.0001, wait_s=0.005))
    steps = [{**SCORE, "on_late": ["fewer"], "rows": ["ids"], "min_rows": 50}]
    clock = ticking()
    outputs, stages = await Pipeline(config(steps), host, clock=clock).run(IDS, clock() + 0.02)
    assert 140 <= len(outputs["final"]) <= 150
    np.testing.assert_array_equal(outputs["final"], np.arange(len(outputs["final"])) * 2)
    assert stages[0].degraded == ["fewer"]


async def test_a_refused_step_falls_back_to_what_it_declares() -> None:
    host = Host(Port(per_row_s=0.0), behaviour="refuse")
    steps = [
        {"name": "prior", "kind": "topk", "by": "ids", "k": 400, "rows": ["ids"]},
        {**SCORE, "on_late": ["fallback"], "fallback": {"ids": "final"}},
    ]
    clock = ticking()
    outputs, stages = await Pipeline(config(steps), host, clock=clock).run(IDS, clock() + 0.05)
    np.testing.assert_array_equal(np.sort(outputs["final"]), np.arange(400))
    assert stages[1].degraded == ["fallback"]


async def test_a_step_out_of_time_falls_back_at_its_share() -> None:
    host = Host(Port(per_row_s=0.0), behaviour="hang")
    steps = [
        {**SCORE, "budget_ms": 5, "on_late": ["fallback"], "fallback": {"ids": "final"}},
        {"name": "after", "kind": "topk", "by": "final", "k": 10, "rows": ["final"]},
    ]
    steps[1]["budget_ms"] = 195
    loop = asyncio.get_running_loop()
    started = loop.time()
    pipeline = Pipeline(config(steps), host)
    outputs, stages = await pipeline.run(IDS, deadline_in(1.0))
    # Stopped at its share (5 of the 200 ms of budgets: 25 ms of the second), far before the
    # request's deadline; its model was told so.
    assert loop.time() - started < 0.5
    assert host.requests[0].parameters["timeout"] <= 25_000
    assert stages[0].degraded == ["fallback"] and len(outputs["final"]) == 10
    # What the call given up on makes is dropped; closing the pipeline ends it.
    host.never.set()
    await pipeline.close()
    assert stages[0].rows is None and len(host.requests) == 1


async def test_without_budgets_no_step_degrades_and_a_late_one_fails_at_the_deadline() -> None:
    host = Host(Port(per_row_s=0.0), behaviour="hang")
    steps = [{**SCORE, "budget_ms": 5, "on_late": ["fallback"], "fallback": {"ids": "final"}}]
    pipeline = Pipeline(config(steps, budgets=False), host)
    with pytest.raises(DeadlineExceeded, match="step 'score'"):
        await pipeline.run(IDS, deadline_in(0.03))
    await pipeline.close()
    host.behaviour = "refuse"
    with pytest.raises(DeadlineUnmeetable):
        clock = ticking()
        await Pipeline(config(steps, budgets=False), host, clock=clock).run(IDS, clock() + 0.03)


async def test_a_step_behind_schedule_takes_the_cheapest_variant() -> None:
    host = Host(Port(per_row_s=0.001, variants=("full", "small")))
    steps = [{**SCORE, "on_late": ["variant"]}]
    clock = ticking()
    _, stages = await Pipeline(config(steps), host, clock=clock).run(IDS, clock() + 0.05)
    assert host.requests[-1].parameters["variant"] == "small"  # 400 ms of rows in 20 ms
    assert stages[0].degraded == ["variant"] and stages[0].variant == "small"
    host = Host(Port(per_row_s=0.00001, variants=("full", "small")))
    clock = ticking()
    _, stages = await Pipeline(config(steps), host, clock=clock).run(IDS, clock() + 0.05)
    assert "variant" not in host.requests[-1].parameters and stages[0].degraded == []


# --- a graph of steps -----------------------------------------------------------------------


def test_the_time_left_is_shared_along_the_longest_path_of_budgets() -> None:
    # a, then b (10) and c (30) side by side, then d (5): a's time must cover a + c + d.
    waits = [[], [0], [0], [1, 2]]
    assert critical_paths([0.005, 0.010, 0.030, 0.005], waits) == pytest.approx(
        [0.040, 0.015, 0.035, 0.005]
    )
    assert critical_paths([0.004, 0.006, 0.020], [[], [0], [1]]) == pytest.approx(
        [0.030, 0.026, 0.020]
    )  # a chain: the sum of what is left


def test_a_step_reads_only_what_the_steps_it_waits_for_made() -> None:
    left = {**SCORE, "name": "left", "after": [], "outputs": {"y": "l"}}
    right = {**SCORE, "name": "right", "after": [], "inputs": {"x": "l"}, "outputs": {"y": "r"}}
    with pytest.raises(ConfigError, match="reads 'l'"):
        config([left, right])
    with pytest.raises(ConfigError, match="'later' is not a step declared before"):
        config([{**left, "after": ["later"]}, {**right, "name": "later"}])


class Meeting(Host):
    """Two models that each answer only once the other has been called: they finish only if
    their steps run at the same time."""

    def __init__(self) -> None:
        super().__init__(Port(per_row_s=0.0))
        self.called = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def call(self, request: InferRequest) -> InferResponse:
        if request.model in self.called:
            self.called[request.model].set()
            await self.called["b" if request.model == "a" else "a"].wait()
        return await super().call(request)


async def test_steps_that_wait_for_none_of_each_other_run_at_the_same_time() -> None:
    steps = [
        {**SCORE, "name": "a", "model": "a", "after": [], "outputs": {"y": "from_a"}},
        {**SCORE, "name": "b", "model": "b", "after": [], "outputs": {"y": "from_b"}},
        {
            "name": "pick",
            "kind": "topk",
            "after": ["a", "b"],
            "by": "from_a",
            "k": 3,
            "rows": ["from_a", "from_b"],
            "outputs": {},
        },
        {**SCORE, "name": "last", "after": ["pick"], "inputs": {"x": "from_b"}},
    ]
    host = Meeting()
    outputs, stages = await Pipeline(config(steps), host).run(IDS, deadline_in(1.0))
    # b doubled the ids, the top 3 by a's doubling kept, and the last step doubled them again.
    np.testing.assert_array_equal(outputs["final"], np.array([399, 398, 397]) * 4)
    assert [stage.name for stage in stages] == ["a", "b", "pick", "last"]
    assert [request.model for request in host.requests][-1] == "scorer"
