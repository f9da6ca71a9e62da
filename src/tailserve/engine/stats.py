"""Per model version counters for ``GET /v2/models/{m}/stats``, in the shape Triton's
statistics extension gives them (so ``tritonclient``'s ``get_inference_statistics`` reads
them), plus what the deadline batcher adds: rejections by reason and deadline misses."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def document(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class ModelStats:
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute: _Duration = field(default_factory=_Duration)
    inference_count: int = 0  # rows
    execution_count: int = 0  # batches
    last_inference_ms: int = 0
    batches_by_size: dict[int, _Duration] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    deadline_misses: int = 0
    # The last few refusals' messages, newest last: why requests are being turned away.
    recent_rejections: deque[str] = field(default_factory=lambda: deque(maxlen=8))
    # Of the refusals (in ``rejected``), those made on an earlier shed's word (overload).
    refusals_reused: int = 0
    # Of the refusals, those made while the admitted requests were comfortably within the SLO.
    false_refusals: int = 0

    def on_success(self, seconds: float, queue_s: float) -> None:
        self.success.add(seconds)
        self.queue.add(queue_s)
        self.last_inference_ms = int(time.time() * 1000)

    def on_fail(self, seconds: float) -> None:
        self.fail.add(seconds)

    def on_batch(self, rows: int, compute_s: float) -> None:
        self.execution_count += 1
        self.inference_count += rows
        self.compute.add(compute_s)
        by_size = self.batches_by_size.get(rows)
        if by_size is None:
            by_size = self.batches_by_size[rows] = _Duration()
        by_size.add(compute_s)

    def document(self, name: str, version: str) -> dict[str, Any]:
        empty = _Duration().document()
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.document(),
                "fail": self.fail.document(),
                "queue": self.queue.document(),
                "compute_input": empty,
                "compute_infer": self.compute.document(),
                "compute_output": empty,
                "cache_hit": empty,
                "cache_miss": empty,
            },
            "batch_stats": [self._batch(size) for size in sorted(self.batches_by_size)],
        }

    def _batch(self, size: int) -> dict[str, Any]:
        empty = _Duration().document()
        return {
            "batch_size": size,
            "compute_input": empty,
            "compute_infer": self.batches_by_size[size].document(),
            "compute_output": empty,
        }
