"""The worker as a pipeline sees it: calls into the data plane, and what the models it calls
can say of their queue and cost (`engine.pipeline.PipelineHost`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.engine.served import ServedVersion
from tailserve.engine.validation import Checked
from tailserve.errors import InvalidInput
from tailserve.tensors import Tensor

if TYPE_CHECKING:
    from tailserve.cache.features import FeatureResolver
    from tailserve.engine.dataplane import DataPlane


class _Port:
    __slots__ = ("_served",)

    def __init__(self, served: ServedVersion) -> None:
        self._served = served

    @property
    def variants(self) -> tuple[str, ...]:
        return self._served.variants

    def wait_s(self) -> float:
        return self._served.scheduler.wait_s()

    def cost(self, inputs: list[Tensor]) -> Callable[[int], float] | None:
        served = self._served
        if not served.config.batched:
            return None
        checked = served.plan.check(inputs)
        scheduler, buckets = served.scheduler, served.buckets

        def predict(rows: int) -> float:
            return scheduler.predict(
                buckets.classify(Checked(checked.arrays, rows, checked.group)), rows
            )

        return predict


class DataPlaneHost:
    def __init__(self, dataplane: DataPlane) -> None:
        self._dataplane = dataplane

    async def call(self, request: InferRequest) -> InferResponse:
        return await self._dataplane.infer(request)

    def port(self, model: str) -> _Port:
        return _Port(self._served(model))

    async def resolver(self, model: str, deadline: float) -> FeatureResolver:
        # (a model unloaded for the memory budget loads first, if its load fits the deadline)
        served = await self._dataplane.manager.acquire(model, None, lambda _: deadline)
        if not isinstance(served, ServedVersion):
            raise InvalidInput(f"a pipeline step looks up {model!r}, which is a pipeline itself")
        if served.features is None:
            raise InvalidInput(f"model {model!r} reads no features from the store")
        return served.features

    def _served(self, model: str) -> ServedVersion:
        served = self._dataplane.manager.get(model)
        if not isinstance(served, ServedVersion):
            raise InvalidInput(f"a pipeline step calls {model!r}, which is a pipeline itself")
        return served
