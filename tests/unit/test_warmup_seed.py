"""The warm-up time that seeds a cost class: taken only once the shape is warm."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tailserve.engine.warmup import settled


class Scripted:
    """A runtime whose runs take the scripted times, on a fake clock."""

    def __init__(self, times: list[float]) -> None:
        self.times = list(times)
        self.now = 0.0
        self.runs = 0

    def clock(self) -> float:
        return self.now

    def predict(self, batch: dict[str, Any]) -> dict[str, Any]:
        self.now += self.times[self.runs]
        self.runs += 1
        return batch


BATCH = {"x": np.zeros((64, 512), dtype=np.int64)}


def test_a_second_cold_run_is_not_taken_for_the_cost() -> None:
    # What ONNX Runtime did with 64 rows of 512 tokens: 447 ms, 1,115 ms, then 184 ms.
    runtime = Scripted([0.184, 0.181, 0.183, 0.182])
    seconds = settled(runtime, BATCH, [0.447, 1.115], runtime.clock)  # type: ignore[arg-type]
    assert seconds == pytest.approx(0.181)
    assert runtime.runs == 2  # ran again until two runs in a row agreed


def test_a_warm_shape_runs_no_more() -> None:
    runtime = Scripted([0.010])
    seconds = settled(runtime, BATCH, [0.5, 0.0101, 0.0100], runtime.clock)  # type: ignore[arg-type]
    assert seconds == pytest.approx(0.0100)
    assert runtime.runs == 0


def test_a_shape_that_never_settles_stops_after_a_few_runs() -> None:
    runtime = Scripted([0.1, 0.3, 0.1, 0.3, 0.1])
    settled(runtime, BATCH, [1.0, 0.3], runtime.clock)  # type: ignore[arg-type]
    assert runtime.runs == 3


def test_a_shape_warmed_up_once_runs_until_warm_and_seeds_its_class() -> None:
    # repeat: 1 (the default) leaves one cold run: it is dropped, and the batch runs again
    # until two runs agree.
    runtime = Scripted([0.020, 0.0101, 0.0100])
    seconds = settled(runtime, BATCH, [0.9], runtime.clock)  # type: ignore[arg-type]
    assert seconds == pytest.approx(0.0100)
    assert runtime.runs == 3
