"""Batching policies: pure objects that look at a queue and a clock and say what to run.

A policy never touches asyncio, a model or the network. The scheduler asks it, each time an
instance is free or the queue changes, for a `Decision`: run the first ``take`` queued requests
now, or wait until ``wait_until`` (or until something new arrives). Keeping the rule here lets it
be tested with a fake clock and swapped (the deadline-aware batcher replaces this one).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


class Queued(Protocol):
    """What a policy may know of a queued request."""

    @property
    def rows(self) -> int: ...

    @property
    def enqueued_at(self) -> float: ...

    @property
    def group(self) -> Hashable:
        """Requests batch together only within a group (same per-row shapes)."""
        ...


@dataclass(frozen=True, slots=True)
class Decision:
    take: int = 0
    wait_until: float | None = None


class BatchPolicy(Protocol):
    def decide(self, now: float, queue: Sequence[Queued], *, draining: bool = False) -> Decision:
        """``draining``: the scheduler is shutting down, so waiting for company is pointless."""
        ...


@dataclass(frozen=True, slots=True)
class SizeOrTimeout:
    """Run a batch when it is full, or when its oldest request has waited ``max_delay_s``.

    A batch takes queued requests of the head's group, in arrival order, while their rows fit in
    ``max_batch_size``. A request is never split: one larger than the limit was refused earlier.
    """

    max_batch_size: int
    max_delay_s: float

    def decide(self, now: float, queue: Sequence[Queued], *, draining: bool = False) -> Decision:
        if not queue:
            return Decision()
        take, full = _fill(queue, self.max_batch_size)
        head = queue[0]
        deadline = head.enqueued_at + self.max_delay_s
        if full or draining or now >= deadline:
            return Decision(take=take)
        return Decision(wait_until=deadline)


@dataclass(frozen=True, slots=True)
class NoBatching:
    """Every request runs alone, as soon as an instance is free."""

    def decide(self, now: float, queue: Sequence[Queued], *, draining: bool = False) -> Decision:
        return Decision(take=1) if queue else Decision()


def _fill(queue: Sequence[Queued], max_rows: int) -> tuple[int, bool]:
    """How many head-of-queue requests of the head's group fit; whether the batch is complete.

    The batch is the run of same-group requests from the head, so arrival order is kept. A
    request of another group ends the run: waiting longer could not grow this batch.
    """
    group = queue[0].group
    take = rows = 0
    for item in queue:
        if item.group != group:
            return take, True
        if rows + item.rows > max_rows:
            return take, True
        take += 1
        rows += item.rows
    return take, rows >= max_rows
