"""The scheduler in process, with an in-memory runtime: batching, splitting, errors, draining."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from tailserve.engine.batching import NoBatching, SizeOrTimeout
from tailserve.engine.scheduler import Scheduler
from tailserve.errors import ModelExecutionError, ModelNotReady, Overloaded
from tailserve.runtimes import Arrays, Signature


class Recorder:
    """Adds 100 to x; records batch sizes; can hold every batch until released."""

    def __init__(self, *, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.fail = fail

    def load(self) -> None: ...

    def describe(self) -> Signature:
        return Signature((), ())

    def predict(self, inputs: Arrays) -> Arrays:
        self.entered.set()
        self.release.wait(10)
        self.batches.append(len(inputs["x"]))
        if self.fail:
            raise ValueError("boom")
        return {"y": inputs["x"] + 100}

    def unload(self) -> None: ...


def x(*values: float) -> Arrays:
    return {"x": np.array(values, dtype=np.float32).reshape(-1, 1)}


def scheduler(runtime: Any, *, max_queue: int = 100, delay: float = 0.05) -> Scheduler:
    s = Scheduler(
        model="m",
        runtimes=[runtime],
        policy=SizeOrTimeout(8, delay),
        max_queue_size=max_queue,
        batched=True,
    )
    s.start()
    return s


async def test_concurrent_requests_batch_and_split_back_by_request() -> None:
    runtime = Recorder()
    s = scheduler(runtime)
    results = await asyncio.gather(*(s.infer(x(i, i + 0.5), 2) for i in range(4)))
    await s.close()
    assert runtime.batches == [8]
    for i, (outputs, stats) in enumerate(results):
        np.testing.assert_array_equal(outputs["y"][:, 0], [i + 100, i + 100.5])
        assert stats.batch_size == 8


async def test_a_lone_request_goes_after_the_delay_not_before_the_batch_fills() -> None:
    runtime = Recorder()
    s = scheduler(runtime, delay=0.01)
    _, stats = await asyncio.wait_for(s.infer(x(1.0), 1), timeout=5)
    await s.close()
    assert runtime.batches == [1]
    assert stats.queue_s >= 0.009


async def test_a_runtime_error_fails_every_member_of_the_batch_and_the_next_batch_runs() -> None:
    runtime = Recorder(fail=True)
    s = scheduler(runtime)
    results = await asyncio.gather(*(s.infer(x(i), 1) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ModelExecutionError) for r in results)
    assert "boom" in str(results[0])
    runtime.fail = False
    outputs, _ = await s.infer(x(5.0), 1)
    assert outputs["y"][0, 0] == 105.0
    await s.close()


async def test_full_queue_refuses_at_once() -> None:
    runtime = Recorder()
    runtime.release.clear()
    s = scheduler(runtime, max_queue=2, delay=0.0)
    first = asyncio.create_task(s.infer(x(0.0), 1))
    # The first batch is in the runtime, holding the only instance.
    assert await asyncio.to_thread(runtime.entered.wait, 5)
    queued = [asyncio.create_task(s.infer(x(1.0), 1)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue is full"):
        await s.infer(x(2.0), 1)
    runtime.release.set()
    await asyncio.gather(first, *queued)
    await s.close()


async def test_close_runs_what_is_queued_then_refuses() -> None:
    runtime = Recorder()
    s = scheduler(runtime, delay=10.0)  # would wait 10 s for company
    pending = [asyncio.create_task(s.infer(x(float(i)), 1)) for i in range(3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(s.close(), timeout=5)
    assert [p.result()[0]["y"][0, 0] for p in pending] == [100.0, 101.0, 102.0]
    with pytest.raises(ModelNotReady):
        await s.infer(x(1.0), 1)


async def test_different_groups_never_share_a_batch() -> None:
    runtime = Recorder()
    s = scheduler(runtime)
    a = [s.infer(x(float(i)), 1, group="a") for i in range(3)]
    b = [s.infer(x(float(i)), 1, group="b") for i in range(3)]
    await asyncio.gather(*a, *b)
    await s.close()
    assert sorted(runtime.batches) == [3, 3]


async def test_no_batching_runs_each_request_alone() -> None:
    runtime = Recorder()
    s = Scheduler(model="m", runtimes=[runtime], policy=NoBatching(), max_queue_size=10,
                  batched=True)  # fmt: skip
    s.start()
    await asyncio.gather(*(s.infer(x(float(i)), 1) for i in range(4)))
    await s.close()
    assert runtime.batches == [1, 1, 1, 1]
