"""Candidate retrieval: the items whose vectors score highest against a query vector.

An exact search (one matrix-vector product and a partial sort): at tens of thousands of items
and a few dozen dimensions it costs well under a millisecond, less than an approximate index's
bookkeeping would save. Pure: the vectors come in as arrays, read from the store by the caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


class RetrievalIndex:
    """Item vectors (row ``i`` is item id ``i``) and the precomputed list that stands in when
    the search cannot run in time (most popular items first)."""

    def __init__(self, items: Array, fallback: Array | None = None) -> None:
        self.items = np.ascontiguousarray(items, dtype=np.float32)
        self.fallback = (
            np.asarray(fallback, dtype=np.int64) if fallback is not None else np.empty(0, np.int64)
        )

    def __len__(self) -> int:
        return len(self.items)

    def search(self, query: Array, top: int) -> tuple[Array, Array]:
        """The ``top`` item ids best first, and their scores (dot products)."""
        scores = self.items @ np.asarray(query, dtype=np.float32).reshape(-1)
        top = min(top, len(scores))
        chosen = np.argpartition(scores, len(scores) - top)[len(scores) - top :]
        order = chosen[np.argsort(scores[chosen])[::-1]]
        return order.astype(np.int64), scores[order].astype(np.float32)

    def precomputed(self, top: int) -> tuple[Array, Array]:
        """The fallback's first ``top`` ids, scored by rank (1 down towards 0)."""
        ids = self.fallback[:top]
        return ids, np.linspace(1.0, 0.0, len(ids), endpoint=False, dtype=np.float32)
