"""The scheduler in process, with an in-memory runtime: batching, splitting, errors, draining."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from tailserve.engine.batching import Batcher, Item, NoBatching, SizeOrTimeout
from tailserve.engine.buckets import Bucket, Pad
from tailserve.engine.deadline_batcher import DeadlineBatcher
from tailserve.engine.scheduler import Scheduler
from tailserve.errors import (
    DeadlineExceeded,
    DeadlineUnmeetable,
    ModelExecutionError,
    ModelNotReady,
    Overloaded,
)
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


ALL = Bucket("all", "all")


def scheduler(
    runtime: Any, *, max_queue: int = 100, delay: float = 0.05, batcher: Batcher | None = None
) -> Scheduler:
    if batcher is None:
        batcher = SizeOrTimeout(max_rows=8, max_delay_s=delay, max_queue=max_queue)
    s = Scheduler(model="m", runtimes=[runtime], batcher=batcher, batched=True)
    s.start()
    return s


async def test_concurrent_requests_batch_and_split_back_by_request() -> None:
    runtime = Recorder()
    s = scheduler(runtime)
    results = await asyncio.gather(*(s.infer(x(i, i + 0.5), 2, ALL) for i in range(4)))
    await s.close()
    assert runtime.batches == [8]
    for i, (outputs, stats) in enumerate(results):
        np.testing.assert_array_equal(outputs["y"][:, 0], [i + 100, i + 100.5])
        assert stats.batch_size == 8


async def test_a_lone_request_goes_after_the_delay_not_before_the_batch_fills() -> None:
    runtime = Recorder()
    s = scheduler(runtime, delay=0.01)
    _, stats = await asyncio.wait_for(s.infer(x(1.0), 1, ALL), timeout=5)
    await s.close()
    assert runtime.batches == [1]
    assert stats.queue_s >= 0.009


async def test_a_runtime_error_fails_every_member_of_the_batch_and_the_next_batch_runs() -> None:
    runtime = Recorder(fail=True)
    s = scheduler(runtime)
    calls = [s.infer(x(i), 1, ALL) for i in range(3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ModelExecutionError) for r in results)
    assert "boom" in str(results[0])
    runtime.fail = False
    outputs, _ = await s.infer(x(5.0), 1, ALL)
    assert outputs["y"][0, 0] == 105.0
    await s.close()


class Faulty(SizeOrTimeout):
    """A batcher whose poll raises while ``broken`` (a bug in a policy)."""

    broken = True

    def poll(self, now: float, free_at: Any, *, draining: bool = False) -> Any:
        if self.broken and len(self):
            raise OverflowError("cannot convert float infinity to integer")
        return super().poll(now, free_at, draining=draining)


async def test_a_failing_batcher_fails_what_is_queued_and_the_scheduler_lives_on() -> None:
    batcher = Faulty(max_rows=8, max_delay_s=0.001, max_queue=100)
    s = scheduler(Recorder(), batcher=batcher)
    results = await asyncio.gather(
        *(s.infer(x(i), 1, ALL) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, ModelExecutionError) for r in results), results
    assert "batching failed" in str(results[0]) and len(batcher) == 0
    batcher.broken = False
    outputs, _ = await asyncio.wait_for(s.infer(x(5.0), 1, ALL), 10)
    assert outputs["y"][0, 0] == 105.0
    await s.close()


def test_an_endless_deadline_fills_a_batch_to_its_maximum() -> None:
    # A budget of 1e308 s would overflow int(): the batch may simply hold all it can.
    for deadline in (1e308, float("inf")):
        batcher = DeadlineBatcher(max_rows=8, max_queue=10, instances=1)
        for rows, seconds in ((1, 0.002), (8, 0.009)):  # a cost per row: the rows that fit
            batcher.observe(ALL, rows, seconds, -1)  # in the time left are worked out
        assert all(cost.per_row_s > 0 for cost in batcher.costs().values())
        for _ in range(10):
            assert batcher.offer(Item(1, ALL, 0.0, deadline), 0.0, [0.0]) is None
        assert len(batcher.poll(0.0, [0.0], draining=True).batch) == 8


async def test_full_queue_refuses_at_once() -> None:
    runtime = Recorder()
    runtime.release.clear()
    s = scheduler(runtime, max_queue=2, delay=0.0)
    first = asyncio.create_task(s.infer(x(0.0), 1, ALL))
    # The first batch is in the runtime, holding the only instance.
    assert await asyncio.to_thread(runtime.entered.wait, 5)
    queued = [asyncio.create_task(s.infer(x(1.0), 1, ALL)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue is full"):
        await s.infer(x(2.0), 1, ALL)
    runtime.release.set()
    await asyncio.gather(first, *queued)
    await s.close()


async def test_close_runs_what_is_queued_then_refuses() -> None:
    runtime = Recorder()
    s = scheduler(runtime, delay=10.0)  # would wait 10 s for company
    pending = [asyncio.create_task(s.infer(x(float(i)), 1, ALL)) for i in range(3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(s.close(), timeout=5)
    assert [p.result()[0]["y"][0, 0] for p in pending] == [100.0, 101.0, 102.0]
    with pytest.raises(ModelNotReady):
        await s.infer(x(1.0), 1, ALL)


async def test_different_classes_never_share_a_batch() -> None:
    runtime = Recorder()
    s = scheduler(runtime)
    a = [s.infer(x(float(i)), 1, Bucket("a", "a")) for i in range(3)]
    b = [s.infer(x(float(i)), 1, Bucket("b", "b")) for i in range(3)]
    await asyncio.gather(*a, *b)
    await s.close()
    assert sorted(runtime.batches) == [3, 3]


async def test_no_batching_runs_each_request_alone() -> None:
    runtime = Recorder()
    s = scheduler(runtime, batcher=NoBatching(10))
    await asyncio.gather(*(s.infer(x(float(i)), 1, ALL) for i in range(4)))
    await s.close()
    assert runtime.batches == [1, 1, 1, 1]


def deadline_batcher(max_queue: int = 100) -> DeadlineBatcher:
    return DeadlineBatcher(max_rows=8, instances=1, max_queue=max_queue)


async def test_a_deadline_that_cannot_be_met_is_refused_at_once() -> None:
    runtime = Recorder()
    s = scheduler(runtime, batcher=deadline_batcher())
    s.seed(ALL, 1, 0.050)  # batches take ~50 ms
    with pytest.raises(DeadlineUnmeetable, match="cannot be met"):
        await s.infer(x(1.0), 1, ALL, deadline=time.monotonic() + 0.010)
    assert runtime.batches == []  # nothing ran
    assert s.stats.rejected == {"deadline": 1}
    outputs, _ = await s.infer(x(1.0), 1, ALL, deadline=time.monotonic() + 5)
    assert outputs["y"][0, 0] == 101.0
    await s.close()


async def test_a_request_whose_deadline_passes_in_the_queue_expires_and_is_not_run() -> None:
    # The deadlines are on the test's clock: a loaded machine's stall cannot move them.
    now = [0.0]
    runtime = Recorder()
    runtime.release.clear()
    s = Scheduler(
        model="m",
        runtimes=[runtime],
        batcher=deadline_batcher(),
        batched=True,
        clock=lambda: now[0],
    )
    s.start()
    s.seed(ALL, 1, 0.001)
    first = asyncio.create_task(s.infer(x(0.0), 1, ALL, deadline=5.0))
    assert await asyncio.to_thread(runtime.entered.wait, 5)
    # The running batch has overrun its 1 ms prediction (a stall): nothing is handed over
    # behind it, so what waits can still expire.
    now[0] = 0.01
    # Admitted (the running batch was predicted to end soon), but the instance stays busy.
    late = asyncio.create_task(s.infer(x(1.0), 1, ALL, deadline=0.06, hard_deadline=True))
    # A request with only the SLO's deadline waits too, and runs late rather than fail.
    soft = asyncio.create_task(s.infer(x(2.0), 1, ALL, deadline=0.06))
    for _ in range(3):
        await asyncio.sleep(0)
    assert s.queue_depth == 2  # both queued behind the held batch
    now[0] = 0.11  # both deadlines pass while the instance is held
    runtime.release.set()
    await first
    with pytest.raises(DeadlineExceeded, match="deadline can no longer be met"):
        await late
    outputs, _ = await soft
    assert outputs["y"][0, 0] == 102.0
    assert runtime.batches == [1, 1]  # the expired request never reached the model
    assert s.stats.rejected == {"expired": 1}
    assert s.stats.deadline_misses == 1
    await s.close()


async def test_padded_classes_pad_to_the_longest_within_the_edge_and_split_back() -> None:
    class Lengths:
        def __init__(self) -> None:
            self.shapes: list[tuple[int, ...]] = []

        def load(self) -> None: ...

        def describe(self) -> Signature:
            return Signature((), ())

        def predict(self, inputs: Arrays) -> Arrays:
            tokens = inputs["tokens"]
            self.shapes.append(tokens.shape)
            return {"n": (tokens != 0).sum(axis=1, keepdims=True).astype(np.int64)}

        def unload(self) -> None: ...

    runtime = Lengths()
    s = scheduler(runtime, batcher=SizeOrTimeout(max_rows=8, max_delay_s=0.05, max_queue=10))
    bucket = Bucket("len<=32", "tokens<=32", Pad("tokens", 1, 32, 0))
    requests = [np.arange(1, n + 1, dtype=np.int64).reshape(1, n) for n in (3, 9, 5)]
    results = await asyncio.gather(*(s.infer({"tokens": r}, 1, bucket) for r in requests))
    await s.close()
    assert runtime.shapes == [(3, 16)]  # the longest (9), rounded up to 16: not the edge, 32
    assert [int(out["n"][0, 0]) for out, _ in results] == [3, 9, 5]


async def test_the_next_batch_waits_in_the_instances_thread_not_on_the_loop() -> None:
    now = [0.0]
    runtime = Recorder()
    runtime.release.clear()
    s = Scheduler(
        model="m",
        runtimes=[runtime],
        # One row a batch: a batch this slow would otherwise wait for company.
        batcher=DeadlineBatcher(max_rows=1, instances=1, max_queue=100),
        batched=True,
        clock=lambda: now[0],
    )
    s.start()
    s.seed(ALL, 1, 0.5)  # batches take ~0.5 s
    first = asyncio.create_task(s.infer(x(0.0), 1, ALL, deadline=10.0))
    assert await asyncio.to_thread(runtime.entered.wait, 5)
    now[0] = 0.4999  # the running batch is due to end within the loop's hand-off time
    second = asyncio.create_task(s.infer(x(1.0), 1, ALL, deadline=10.0))
    # The busy instance's worker looks again when its timer says (set for ~0.5 s of real
    # time, far longer than a loaded machine stalls this loop: the arrival does not wake
    # it), and hands the batch over behind the running one.
    for _ in range(3):
        await asyncio.sleep(0)
    assert s.queue_depth == 1  # queued, not yet handed over
    for _ in range(2000):
        if s.queue_depth == 0:
            break
        await asyncio.sleep(0.005)
    assert s.queue_depth == 0  # handed to the instance already, behind the running batch
    for _ in range(3):  # (the task that handed it over puts it in the thread's queue)
        await asyncio.sleep(0)
    runtime.release.set()
    # The loop is blocked on purpose while the thread goes on to the second batch.
    blocked_until = time.monotonic() + 10
    while runtime.batches != [1, 1] and time.monotonic() < blocked_until:
        time.sleep(0.005)  # noqa: ASYNC251
    assert runtime.batches == [1, 1]
    results = await asyncio.gather(first, second)
    assert [out["y"][0, 0] for out, _ in results] == [100.0, 101.0]
    await s.close()


class ThreadRecorder(Recorder):
    """A steady Recorder that notes which thread ran each batch and how many ran at once."""

    def __init__(self, *, steady: bool = True) -> None:
        super().__init__()
        self.steady = steady
        self.threads: list[int] = []
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def predict(self, inputs: Arrays) -> Arrays:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            self.threads.append(threading.get_ident())
            return super().predict(inputs)
        finally:
            with self._lock:
                self.running -= 1


def inline_scheduler(runtime: Any, bound_s: float) -> Scheduler:
    # The clock stands still: a batch that a loaded machine happens to preempt must not be
    # measured as slow, and leave the loop's thread for a reason the test did not give.
    s = Scheduler(
        model="m",
        runtimes=[runtime],
        batcher=NoBatching(max_queue=100),
        batched=True,
        inline_below_s=bound_s,
        clock=lambda: 0.0,
    )
    s.start()
    return s


async def test_a_batch_predicted_below_the_inline_bound_runs_on_the_loops_thread() -> None:
    runtime = ThreadRecorder()
    s = inline_scheduler(runtime, 0.005)
    s.seed(ALL, 1, 0.001)  # measured: 1 ms a batch
    results = await asyncio.gather(*(s.infer(x(float(i)), 1, ALL) for i in range(5)))
    await s.close()
    assert [out["y"][0, 0] for out, _ in results] == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert runtime.threads == [threading.get_ident()] * 5
    assert s.inline_batches == 5
    assert all(stats.batch_size == 1 for _, stats in results)


async def test_a_costlier_unmeasured_or_unsteady_batch_goes_to_the_instances_thread() -> None:
    costly = ThreadRecorder()
    s = inline_scheduler(costly, 0.005)
    s.seed(ALL, 1, 0.050)  # 50 ms a batch
    await asyncio.gather(*(s.infer(x(float(i)), 1, ALL) for i in range(3)))
    await s.close()
    assert threading.get_ident() not in costly.threads and s.inline_batches == 0
    # A runtime that is not steady (a Python model's code may sleep or wait) never runs inline.
    unsteady = ThreadRecorder(steady=False)
    s = inline_scheduler(unsteady, 0.005)
    s.seed(ALL, 1, 0.001)
    await asyncio.gather(*(s.infer(x(float(i)), 1, ALL) for i in range(3)))
    await s.close()
    assert threading.get_ident() not in unsteady.threads and s.inline_batches == 0
    # Nothing measured yet: the first batch goes to the thread; once measured (fast), the
    # batches after it run on the loop.
    fresh = ThreadRecorder()
    s = inline_scheduler(fresh, 0.005)
    await s.infer(x(1.0), 1, ALL)
    await s.infer(x(2.0), 1, ALL)
    await s.close()
    assert fresh.threads[0] != threading.get_ident()
    assert fresh.threads[1] == threading.get_ident() and s.inline_batches == 1


async def test_a_batch_never_runs_on_the_loop_while_the_instances_thread_holds_one() -> None:
    runtime = ThreadRecorder()
    runtime.release.clear()
    s = inline_scheduler(runtime, 0.005)
    first = asyncio.create_task(s.infer(x(0.0), 1, ALL))  # unmeasured: to the thread
    assert await asyncio.to_thread(runtime.entered.wait, 5)
    s.seed(ALL, 1, 0.001)  # now cheap enough to run inline, but the thread is busy
    rest = [asyncio.create_task(s.infer(x(float(i)), 1, ALL)) for i in range(1, 4)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert runtime.threads == [runtime.threads[0]] and s.inline_batches == 0
    runtime.release.set()
    results = await asyncio.gather(first, *rest)
    await s.close()
    assert [out["y"][0, 0] for out, _ in results] == [100.0, 101.0, 102.0, 103.0]
    assert runtime.most_at_once == 1


async def test_a_failing_inline_batch_fails_its_members_and_the_next_one_runs() -> None:
    runtime = ThreadRecorder()
    s = inline_scheduler(runtime, 0.005)
    s.seed(ALL, 1, 0.001)
    runtime.fail = True
    with pytest.raises(ModelExecutionError, match="boom"):
        await s.infer(x(1.0), 1, ALL)
    runtime.fail = False
    outputs, _ = await s.infer(x(2.0), 1, ALL)
    await s.close()
    assert outputs["y"][0, 0] == 102.0 and s.inline_batches == 2


class CountingPolls(SizeOrTimeout):
    polls = 0

    def poll(self, now: float, free_at: Any, *, draining: bool = False) -> Any:
        self.polls += 1
        return super().poll(now, free_at, draining=draining)


async def test_an_arrival_wakes_the_instance_only_when_the_batcher_asks() -> None:
    # A long delay: the batch goes when its eighth row comes. The first arrival starts its
    # wait and the eighth fills it; the six between change nothing a poll would answer.
    batcher = CountingPolls(max_rows=8, max_delay_s=30.0, max_queue=100)
    s = scheduler(Recorder(), batcher=batcher)
    calls = []
    for i in range(8):
        calls.append(asyncio.create_task(s.infer(x(float(i)), 1, ALL)))
        for _ in range(3):
            await asyncio.sleep(0)  # the instance's worker runs, were it woken
        if i < 7:
            assert s.queue_depth == i + 1  # queued, the batch not gone
        if i == 6:
            # The start and the first arrival; the next six woke nothing. (After the eighth,
            # how often a busy instance looks again rests on the batch's time, not arrivals.)
            assert batcher.polls <= 2
    results = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert [out["y"][0, 0] for out, _ in results] == [100.0 + i for i in range(8)]
    await s.close()


async def test_a_model_is_pressed_while_its_queue_is_past_what_admission_allows() -> None:
    runtime = Recorder()
    batcher = DeadlineBatcher(max_rows=1, instances=1, max_queue=1000, admission_target=0.3)
    s = Scheduler(model="m", runtimes=[runtime], batcher=batcher, batched=True)
    s.seed(ALL, 1, 0.005, 0)  # 5 ms a request
    s.start()
    assert not s.pressed(0.050)
    runtime.release.clear()
    deadline = time.monotonic() + 10.0
    queued = [asyncio.ensure_future(s.infer(x(i), 1, ALL, deadline=deadline)) for i in range(8)]
    await asyncio.sleep(0)
    await asyncio.to_thread(runtime.entered.wait, 5)
    # ~7 x 5 ms queued: past 30% of a 50 ms budget, within 30% of a second's.
    assert s.pressed(0.050)
    assert not s.pressed(1.0)
    runtime.release.set()
    await asyncio.gather(*queued)
    assert not s.pressed(0.050)
    await s.close()
