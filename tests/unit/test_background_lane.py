"""The background lane (jobs' work): what it hands an idle instance, and, in a scheduler, that
online requests always go first and a job's batch never holds an instance past the budget."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from tailserve.engine.background import BackgroundLane
from tailserve.engine.batching import Item, SizeOrTimeout
from tailserve.engine.buckets import Bucket
from tailserve.engine.scheduler import Scheduler
from tailserve.errors import ModelNotReady, Overloaded
from tailserve.runtimes import Arrays, Signature

ALL = Bucket("all", "all")
OTHER = Bucket("other", "other")


class _Payload:
    """What the lane reads of an item's payload: whether its future is done."""

    def __init__(self, done: bool = False) -> None:
        self.future = self
        self._done = done

    def done(self) -> bool:
        return self._done


def item(rows: int, bucket: Bucket = ALL, *, done: bool = False) -> Item:
    return Item(rows, bucket, 0.0, payload=_Payload(done))


def per_row(seconds: float) -> Any:
    return lambda bucket, rows: seconds * rows


def test_a_batch_takes_head_pieces_of_one_class_while_they_fit_the_budget() -> None:
    lane = BackgroundLane(budget_s=0.010, max_rows=100)
    for rows in (3, 3, 3, 3):
        lane.add(item(rows))
    batch = lane.take(per_row(0.001), idle_others=0, instances=1)
    assert [i.rows for i in batch] == [3, 3, 3]  # 9 ms; a fourth would be 12 ms
    assert len(lane) == 1


def test_a_batch_stops_at_another_class_and_at_max_rows() -> None:
    lane = BackgroundLane(budget_s=1.0, max_rows=5)
    for rows, bucket in ((2, ALL), (2, ALL), (2, ALL), (1, OTHER)):
        lane.add(item(rows, bucket))
    assert [i.rows for i in lane.take(per_row(0.001), idle_others=0, instances=1)] == [2, 2]
    assert [i.rows for i in lane.take(per_row(0.001), idle_others=0, instances=1)] == [2]
    assert [i.bucket for i in lane.take(per_row(0.001), idle_others=0, instances=1)] == [OTHER]


def test_a_piece_over_the_budget_waits_for_another_idle_instance_where_there_are_several() -> None:
    lane = BackgroundLane(budget_s=0.001, max_rows=10)
    lane.add(item(1))
    slow = per_row(0.005)
    assert lane.take(slow, idle_others=0, instances=2) == []
    assert len(lane.take(slow, idle_others=1, instances=2)) == 1
    lane.add(item(1))
    assert len(lane.take(slow, idle_others=0, instances=1)) == 1  # no finer cut exists


def test_pieces_whose_job_gave_up_are_skipped_and_the_lane_is_bounded() -> None:
    lane = BackgroundLane(budget_s=1.0, max_rows=10, max_waiting=2)
    lane.add(item(1, done=True))
    lane.add(item(2))
    with pytest.raises(Overloaded):
        lane.add(item(3))
    assert [i.rows for i in lane.take(per_row(0.001), idle_others=0, instances=1)] == [2]


def test_rows_that_fit_is_the_most_rows_within_the_budget() -> None:
    lane = BackgroundLane(budget_s=0.010, max_rows=4096)
    cost = lambda rows: 0.002 + 0.0001 * rows  # noqa: E731
    size = lane.rows_that_fit(cost, 100_000)
    assert cost(size) <= 0.010 < cost(size + 1)
    assert lane.rows_that_fit(cost, 7) == 7
    assert lane.rows_that_fit(lambda rows: 1.0, 50) == 1


class Gate:
    """Adds 100 to x; records each batch's size and whether it came from the lane (x < 0);
    holds every batch until released."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.entered = threading.Event()

    def load(self) -> None: ...

    def describe(self) -> Signature:
        return Signature((), ())

    def predict(self, inputs: Arrays) -> Arrays:
        kind = "job" if inputs["x"][0, 0] < 0 else "online"
        self.batches.append((kind, len(inputs["x"])))
        self.entered.set()
        self.release.wait(10)
        return {"y": inputs["x"] + 100}

    def unload(self) -> None: ...


def x(*values: float) -> Arrays:
    return {"x": np.array(values, dtype=np.float32).reshape(-1, 1)}


async def test_online_requests_go_before_queued_job_pieces() -> None:
    runtime = Gate()
    lane = BackgroundLane(budget_s=1.0, max_rows=2)
    s = Scheduler(
        model="m",
        runtimes=[runtime],
        batcher=SizeOrTimeout(max_rows=8, max_delay_s=0.0, max_queue=100),
        batched=True,
        background=lane,
    )
    s.start()
    first = asyncio.create_task(s.infer(x(1.0), 1, ALL))
    await asyncio.to_thread(runtime.entered.wait, 5)  # the instance is busy with it
    jobs = [asyncio.create_task(s.infer_background(x(-1.0), 1, ALL)) for _ in range(4)]
    online = [asyncio.create_task(s.infer(x(2.0), 1, ALL)) for _ in range(3)]
    await asyncio.sleep(0)
    runtime.release.set()
    await asyncio.gather(first, *online, *jobs)
    await s.close()
    kinds = [kind for kind, _ in runtime.batches]
    assert kinds[:2] == ["online", "online"]  # the first, then the three that came meanwhile
    assert kinds[2:] == ["job", "job"]
    assert [rows for _, rows in runtime.batches[2:]] == [2, 2]  # the lane's max_rows
    outputs, _ = await jobs[0]
    np.testing.assert_array_equal(outputs["y"], [[99.0]])


async def test_an_unloading_model_fails_its_waiting_job_pieces() -> None:
    runtime = Gate()
    s = Scheduler(
        model="m",
        runtimes=[runtime],
        batcher=SizeOrTimeout(max_rows=8, max_delay_s=0.0, max_queue=100),
        batched=True,
        background=BackgroundLane(budget_s=1.0, max_rows=8),
    )
    s.start()
    busy = asyncio.create_task(s.infer(x(1.0), 1, ALL))
    await asyncio.to_thread(runtime.entered.wait, 5)
    waiting = asyncio.create_task(s.infer_background(x(-1.0), 1, ALL))
    await asyncio.sleep(0)
    closing = asyncio.create_task(s.close(drain_s=5))
    await asyncio.sleep(0)
    runtime.release.set()
    await closing
    await busy
    with pytest.raises(ModelNotReady):
        await waiting
