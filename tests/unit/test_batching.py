"""The size-or-timeout policy, driven by a fake clock: no asyncio, no model."""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.engine.batching import Decision, NoBatching, SizeOrTimeout


@dataclass
class Item:
    rows: int
    enqueued_at: float
    group: tuple[str, ...] = ("a",)


def test_empty_queue_waits_for_arrivals() -> None:
    assert SizeOrTimeout(8, 0.002).decide(0.0, []) == Decision()


def test_lone_request_waits_until_its_delay_runs_out() -> None:
    policy = SizeOrTimeout(8, 0.002)
    queue = [Item(1, enqueued_at=10.0)]
    assert policy.decide(10.001, queue) == Decision(wait_until=10.002)
    assert policy.decide(10.002, queue) == Decision(take=1)


def test_full_batch_goes_at_once() -> None:
    policy = SizeOrTimeout(4, 1.0)
    queue = [Item(1, 0.0) for _ in range(6)]
    assert policy.decide(0.0, queue) == Decision(take=4)


def test_rows_not_requests_fill_the_batch_and_requests_are_never_split() -> None:
    policy = SizeOrTimeout(8, 1.0)
    queue = [Item(3, 0.0), Item(3, 0.0), Item(3, 0.0)]
    # 3 + 3 fit, the third would make 9 rows: the batch is complete at two requests.
    assert policy.decide(0.0, queue) == Decision(take=2)


def test_groups_never_mix_and_a_different_group_closes_the_batch() -> None:
    policy = SizeOrTimeout(8, 1.0)
    queue = [Item(1, 0.0, ("short",)), Item(1, 0.0, ("short",)), Item(1, 0.0, ("long",))]
    assert policy.decide(0.0, queue) == Decision(take=2)


def test_draining_sends_what_is_queued_without_waiting() -> None:
    policy = SizeOrTimeout(8, 5.0)
    assert policy.decide(0.0, [Item(1, 0.0)], draining=True) == Decision(take=1)


def test_no_batching_takes_one_request_at_a_time() -> None:
    queue = [Item(1, 0.0), Item(1, 0.0)]
    assert NoBatching().decide(0.0, queue) == Decision(take=1)
    assert NoBatching().decide(0.0, []) == Decision()
