"""``tailserve.client``: call the workers directly, with the router's policies in-process.

For a caller that wants no extra hop: the same `Dispatcher` as ``tailserve route`` (replica
choice by affinity, p2c or round-robin; hedged requests after the model's p95 within a 5%
budget; one retry on another replica after a failed connection; outlier ejection; readiness
checks; shedding when every replica is saturated) runs in the caller's event loop.

    async with Client(["http://10.0.0.5:8000", "http://10.0.0.6:8000"]) as client:
        result = await client.infer("churn", {"tenure_months": np.array([[12]]), ...})
        result.outputs["churn_probability"], result.replica

Requests go as OIP v2 JSON. A reply other than 200 raises `InferenceError` with the status and
the worker's (or the dispatcher's) message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from tailserve.errors import TailserveError
from tailserve.router.config import RouterConfig, backend_url, parse_backend
from tailserve.router.dispatch import Dispatcher
from tailserve.router.keys import body_key, cost_class
from tailserve.router.messages import Outcome, error_message, request_framer
from tailserve.router.upstreams import ANY
from tailserve.tensors import datatype_of, from_json, to_json_data

__all__ = ["Client", "InferResult", "InferenceError"]


class InferenceError(TailserveError):
    def __init__(self, status: int, message: str, replica: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.replica = replica


@dataclass(slots=True)
class InferResult:
    outputs: dict[str, np.ndarray[Any, Any]]
    # The worker that answered, and whether a hedged copy's reply won.
    replica: str | None
    hedged: bool
    parameters: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


class Client:
    def __init__(
        self,
        backends: Sequence[str],
        *,
        balance: str = "p2c",
        model_balance: Mapping[str, str] | None = None,
        hedge: bool = True,
        hedge_ratio: float = 0.05,
        retry_ratio: float = 0.1,
        max_in_flight: int = 64,
        timeout_s: float = 30.0,
        health_interval_s: float = 1.0,
        admin_token: str | None = None,
    ) -> None:
        if not backends:
            raise ValueError("a Client needs at least one backend URL")
        self.config = RouterConfig(
            backends=tuple(backend_url(*parse_backend(url)) for url in backends),
            balance=balance,
            model_balance=dict(model_balance or {}),
            hedge=hedge,
            hedge_ratio=hedge_ratio,
            retry_ratio=retry_ratio,
            max_in_flight=max_in_flight,
            request_timeout_s=timeout_s,
            health_interval_s=health_interval_s,
            admin_token=admin_token,
        )
        self._dispatcher: Dispatcher | None = None
        self._health: asyncio.Task[None] | None = None

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise RuntimeError("the client is not started: use 'async with Client(...)'")
        return self._dispatcher

    async def start(self) -> None:
        """Check every backend once (so the first request goes to a ready one), then keep
        checking in the background."""
        dispatcher = self._dispatcher = Dispatcher(self.config)
        dispatcher.set_members(self.config.backends)
        await dispatcher.check_all()
        self._health = asyncio.get_running_loop().create_task(dispatcher.run_health())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self._dispatcher is not None:
            await self._dispatcher.close()

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        deadline_ms: float | None = None,
        affinity_key: str | None = None,
    ) -> InferResult:
        """Run ``model`` on named arrays; answers its outputs as arrays."""
        body = encode_request(inputs, outputs, parameters)
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "")
        headers = [("content-type", "application/json")]
        key = None
        if self.dispatcher.wants_key(model):
            key = affinity_key if affinity_key is not None else body_key(body)
        outcome = await self._send(
            model,
            "POST",
            f"{path}/infer",
            body,
            headers,
            key=key,
            cost=cost_class(len(body)),
            deadline_ms=deadline_ms,
            hedge=True,
        )
        if outcome.status != 200:
            raise InferenceError(outcome.status, error_message(outcome.body), outcome.backend)
        return decode_response(outcome)

    async def request(
        self, method: str, path: str, body: bytes = b"", *, model: str = ANY
    ) -> Outcome:
        """Any other route (metadata, readiness, stats), to a replica of ``model``."""
        return await self._send(model, method, path, body, [], idempotent=method == "GET")

    async def _send(
        self,
        model: str,
        method: str,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        *,
        deadline_ms: float | None = None,
        **options: Any,
    ) -> Outcome:
        frame = request_framer(method, path, body, headers)
        deadline_s = None if deadline_ms is None else deadline_ms / 1e3
        return await self.dispatcher.request(model, frame, deadline_s=deadline_s, **options)


def encode_request(
    inputs: Mapping[str, Any],
    outputs: Sequence[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> bytes:
    tensors = []
    for name, value in inputs.items():
        array = np.asarray(value)
        tensors.append(
            {
                "name": name,
                "datatype": datatype_of(array),
                "shape": list(array.shape),
                "data": to_json_data(array.reshape(-1)),
            }
        )
    request: dict[str, Any] = {"inputs": tensors}
    if outputs is not None:
        request["outputs"] = [{"name": name} for name in outputs]
    if parameters:
        request["parameters"] = dict(parameters)
    return orjson.dumps(request, option=orjson.OPT_SERIALIZE_NUMPY)


def decode_response(outcome: Outcome) -> InferResult:
    reply = orjson.loads(outcome.body)
    arrays = {
        t["name"]: from_json(t["name"], t["datatype"], t["shape"], t["data"])
        for t in reply.get("outputs", [])
    }
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in outcome.headers}
    return InferResult(
        arrays, outcome.backend, outcome.hedged, reply.get("parameters") or {}, headers
    )
