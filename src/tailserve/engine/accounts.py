"""What the scheduler tells the rest of the worker: how each request was served, each batch's
record for the metrics, and the event loop's state it reads (engine/scheduler.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BatchStats:
    """How one request was served: its wait in the queue, its batch's run time and size."""

    queue_s: float
    compute_s: float
    batch_size: int
    cost_class: str = "all"
    variant: str = ""  # the variant that ran it (models with variants only)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch run, for the metrics."""

    model: str
    bucket: str
    rows: int
    compute_s: float  # in the runtime (merge, predict, split)
    wall_s: float  # from dispatch until the results were back on the loop
    predicted_s: float
    queue_s: Sequence[float]
    missed: int  # members answered after their deadline
    variant: str = ""  # the variant that ran it (models with variants only)
    rows_each: Sequence[int] = ()  # each member's rows, in the order of queue_s
    # The cost model's seconds a row at the largest batch the model may run (the cheapest a
    # row), before it learnt from this batch (observability/efficiency.py); 0: not known.
    best_s_per_row: float = 0.0


class BatchObserver(Protocol):
    def on_batch(self, record: BatchRecord) -> None: ...

    def on_reject(self, model: str, reason: str, *, needless: bool = False) -> None: ...


class LoopState(Protocol):
    """The event loop as the worker measures it (observability.loop_lag.LoopLag)."""

    lag_s: float  # how late it runs what is ready, seconds
    busy: float  # how busy its thread is, 0..1

    @property
    def backlog_s(self) -> float:
        """The loop's time the requests it holds now still need, seconds."""
