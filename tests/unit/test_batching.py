"""The baseline batchers (size-or-timeout, none), driven by a fake clock: no asyncio, no model."""

from __future__ import annotations

from tailserve.engine.batching import Item, NoBatching, Poll, SizeOrTimeout
from tailserve.engine.buckets import Bucket

A, B = Bucket("a", "a"), Bucket("b", "b")
FREE = [0.0]


def item(rows: int, at: float, bucket: Bucket = A) -> Item:
    return Item(rows, bucket, at)


def filled(batcher: SizeOrTimeout | NoBatching, *items: Item) -> SizeOrTimeout | NoBatching:
    for it in items:
        assert batcher.offer(it, it.enqueued_at, FREE) is None
    return batcher


def rows_of(poll: Poll) -> list[int]:
    return [it.rows for it in poll.batch]


def test_empty_queue_waits_for_arrivals() -> None:
    assert SizeOrTimeout(max_rows=8, max_delay_s=0.002, max_queue=10).poll(0.0, FREE) == Poll()


def test_lone_request_waits_until_its_delay_runs_out() -> None:
    batcher = filled(SizeOrTimeout(max_rows=8, max_delay_s=0.002, max_queue=10), item(1, 10.0))
    assert batcher.poll(10.001, FREE) == Poll(wait_until=10.002)
    assert rows_of(batcher.poll(10.002, FREE)) == [1]
    assert len(batcher) == 0


def test_full_batch_goes_at_once() -> None:
    batcher = filled(
        SizeOrTimeout(max_rows=4, max_delay_s=1.0, max_queue=10), *(item(1, 0.0) for _ in range(6))
    )
    assert rows_of(batcher.poll(0.0, FREE)) == [1, 1, 1, 1]
    assert len(batcher) == 2


def test_rows_not_requests_fill_the_batch_and_requests_are_never_split() -> None:
    batcher = filled(
        SizeOrTimeout(max_rows=8, max_delay_s=1.0, max_queue=10),
        item(3, 0.0),
        item(3, 0.0),
        item(3, 0.0),
    )
    # 3 + 3 fit, the third would make 9 rows: the batch is complete at two requests.
    assert rows_of(batcher.poll(0.0, FREE)) == [3, 3]


def test_classes_never_mix_and_a_different_class_closes_the_batch() -> None:
    batcher = filled(
        SizeOrTimeout(max_rows=8, max_delay_s=1.0, max_queue=10),
        item(1, 0.0),
        item(1, 0.0),
        item(1, 0.0, B),
    )
    poll = batcher.poll(0.0, FREE)
    assert [it.bucket for it in poll.batch] == [A, A]


def test_draining_sends_what_is_queued_without_waiting() -> None:
    batcher = filled(SizeOrTimeout(max_rows=8, max_delay_s=5.0, max_queue=10), item(1, 0.0))
    assert rows_of(batcher.poll(0.0, FREE, draining=True)) == [1]


def test_a_full_queue_refuses() -> None:
    batcher = filled(
        SizeOrTimeout(max_rows=8, max_delay_s=5.0, max_queue=2), item(1, 0.0), item(1, 0.0)
    )
    refused = batcher.offer(item(1, 0.0), 0.0, FREE)
    assert refused is not None and refused.reason == "queue_full"


def test_no_batching_takes_one_request_at_a_time() -> None:
    batcher = filled(NoBatching(10), item(1, 0.0), item(2, 0.0))
    assert rows_of(batcher.poll(0.0, FREE)) == [1]
    assert rows_of(batcher.poll(0.0, FREE)) == [2]
    assert batcher.poll(0.0, FREE) == Poll()


def test_an_arrival_asks_for_a_poll_when_it_starts_or_may_complete_a_batch() -> None:
    batcher = SizeOrTimeout(max_rows=4, max_delay_s=0.002, max_queue=10)
    asked = []
    for it in (item(1, 0.0), item(1, 0.0), item(1, 0.0), item(1, 0.0)):
        assert batcher.offer(it, 0.0, FREE) is None
        asked.append(batcher.poll_soon)
    # The head (its wait starts), then nothing new until the fourth row fills the batch.
    assert asked == [True, False, False, True]
    assert rows_of(batcher.poll(0.0, FREE)) == [1, 1, 1, 1]
    assert batcher.offer(item(1, 0.0), 0.0, FREE) is None and batcher.poll_soon
    assert batcher.offer(item(1, 0.0, B), 0.0, FREE) is None
    assert batcher.poll_soon  # another class: the head's batch is complete
    none = NoBatching(10)
    assert none.offer(item(1, 0.0), 0.0, FREE) is None and none.poll_soon
