"""A retrieve step's index read from the feature store: each round trip within the time it is
given (a start-up's, before ready), else the store's own (a request's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tailserve.engine.served import StoredIndex
from tailserve.modelconfig.pipeline import PipelineStep, RetrievalIndex


class Store:
    """Item i's one field is i; records each read's entity and time limit."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, float | None]] = []

    async def read(
        self,
        entity: str,
        version: str,
        ids: Sequence[Any],
        fields: Sequence[str],
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray[Any, Any]:
        self.reads.append((entity, timeout_s))
        return np.asarray(list(ids), dtype=np.float32)[:, None].repeat(len(fields), axis=1)

    async def prepare(self, entity: str, version: str, fields: Sequence[str]) -> None: ...


def step(items: int) -> PipelineStep:
    index = RetrievalIndex(query_entity="user", item_entity="item", fields=["v"], items=items)
    return PipelineStep(name="retrieve", kind="retrieve", query="user_id", top=5, index=index)


async def test_the_index_is_read_within_the_time_given_else_the_stores_own() -> None:
    store = Store()
    index = await StoredIndex(step(12_000), store).get(timeout_s=2.0)
    # 12,000 items: three round trips of at most 5,000, each within the 2 s given.
    assert store.reads == [("item", 2.0)] * 3
    assert index.items.shape == (12_000, 1) and index.items[11_999, 0] == 11_999
    store.reads.clear()
    await StoredIndex(step(10), store).get()
    assert store.reads == [("item", None)]
