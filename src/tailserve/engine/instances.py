"""A model instance as the scheduler (`engine.scheduler`) keeps it: its runtimes, its own
thread, and the batches handed to it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tailserve.runtimes import Runtime


class Instance:
    """One model instance: its runtime (one per variant of the model), its own thread, and the
    batches handed to it."""

    def __init__(self, model: str, index: int, runtimes: Sequence[Runtime]) -> None:
        self.index = index
        self.runtimes = runtimes
        # Whether its cheap batches may run on the loop's thread (runtimes/base.py).
        self.steady = all(getattr(runtime, "steady", False) for runtime in runtimes)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{model}-{index}")
        self.outstanding = 0
        # When its handed-over batches should be done (0: idle); the last one's prediction.
        self.free_at = 0.0
        self.predicted = 0.0
        self.tasks: set[asyncio.Task[None]] = set()
