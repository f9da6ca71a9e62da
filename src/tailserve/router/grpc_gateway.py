"""The router's gRPC front: Open Inference Protocol calls, sent on to the workers over HTTP.

``tritonclient.grpc`` and the KServe gRPC clients reach a fleet through the router's gRPC port
(``--grpc-port``; `tailserve up` listens on 8081 beside HTTP on 8080). Each ``ModelInfer``
becomes the worker's binary HTTP request (every input raw, every output asked back raw) and
goes through the router's one `Dispatcher`, as an HTTP request does: replica choice (affinity
on the same key an HTTP client's identical request gets, p2c, round-robin), hedging within the
budget, one retry after a failed connection, ejection, in-flight limits and shedding, and the
call's gRPC deadline propagated as ``X-Deadline-Ms``.

Why HTTP upstream rather than gRPC: one dispatcher and one pool of kept-alive connections per
worker serve both protocols (a hedge's loser is cancelled by closing its HTTP connection, which
the worker turns into dropping the queued work), and no second address per worker has to be
known (a backend is an HTTP URL, however it was found: flags, file or DNS). What it costs:
benchmarks/grpc_vs_http.py.

- Health: ServerLive is the router's own; ServerReady is its ``/v2/health/ready`` (some backend
  in service, not draining); ModelReady asks a replica of the model.
- Metadata: ServerMetadata and ModelMetadata ask a replica (ModelMetadata, one of the model).
- Replies: the worker's status as its gRPC counterpart (400 INVALID_ARGUMENT, 404 NOT_FOUND,
  413 and 429 RESOURCE_EXHAUSTED, 502 and 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED) with its
  message, ``retry-after`` in the trailing metadata where it gave one; a success's trailing
  metadata names the replica that answered (``x-tailserve-replica``, ``x-tailserve-hedged``)
  and carries the worker's own account (``x-cache``, ``x-queue-us``, ``x-compute-us``,
  ``x-batch-size``).
- Counted in ``tailserve_router_requests_total`` and the router's latency histogram like HTTP
  requests, under the HTTP status the reply had.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import grpc
import orjson

from tailserve.errors import TailserveError
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.common import (
    code_of,
    generic_handler,
    parameters_of,
    raw_contents,
    set_parameter,
    time_left_s,
    typed_array,
)
from tailserve.protocols.http.errors import status_of
from tailserve.router.keys import body_key, cost_class
from tailserve.router.messages import Outcome, error_message, request_framer
from tailserve.router.upstreams import ANY
from tailserve.tensors import from_json, to_binary

if TYPE_CHECKING:
    from tailserve.router.proxy import Router

# Worker reply headers passed on in a successful call's trailing metadata.
_PASSED = frozenset({b"x-cache", b"x-queue-us", b"x-compute-us", b"x-batch-size"})


def http_request(message: Any) -> tuple[bytes, int]:
    """A ``ModelInferRequest`` as the body of the worker's binary HTTP request: the JSON
    header (inputs with their ``binary_data_size``, outputs asked back binary) and the raw
    data after it; answers the body and the header's length. Typed ``contents`` are turned
    into raw data here (the worker sees one form); a shape the data does not fill is the
    worker's to name."""
    raw = raw_contents(message)
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for index, tensor in enumerate(message.inputs):
        data = raw[index] if raw else to_binary(typed_array(tensor))
        shape = list(tensor.shape)
        parameters = {**parameters_of(tensor.parameters), "binary_data_size": len(data)}
        inputs.append(
            {
                "name": tensor.name,
                "datatype": tensor.datatype,
                "shape": shape,
                "parameters": parameters,
            }
        )
        chunks.append(data)
    document: dict[str, Any] = {"inputs": inputs}
    if message.id:
        document["id"] = message.id
    if message.outputs:
        document["outputs"] = [
            {"name": o.name, "parameters": {**parameters_of(o.parameters), "binary_data": True}}
            for o in message.outputs
        ]
    document["parameters"] = {**parameters_of(message.parameters), "binary_data_output": True}
    header = orjson.dumps(document)
    return b"".join([header, *chunks]), len(header)


def infer_response(outcome: Outcome) -> Any:
    """A worker's 200 reply to `http_request` as a ``ModelInferResponse``, outputs raw."""
    body = outcome.body
    length = _header_length(outcome)
    header, data = (body, b"") if length is None else (body[:length], body[length:])
    document = orjson.loads(header)
    message = schema.ModelInferResponse(
        model_name=document.get("model_name", ""),
        model_version=str(document.get("model_version") or ""),
        id=document.get("id") or "",
    )
    offset = 0
    for entry in document.get("outputs", []):
        output = message.outputs.add(name=entry["name"], datatype=entry["datatype"])
        output.shape.extend(entry["shape"])
        parameters = dict(entry.get("parameters") or {})
        size = parameters.pop("binary_data_size", None)
        if size is None:  # (a worker that answered this output in JSON)
            array = from_json(entry["name"], entry["datatype"], entry["shape"], entry["data"])
            message.raw_output_contents.append(to_binary(array))
        else:
            message.raw_output_contents.append(data[offset : offset + size])
            offset += size
        for key, value in parameters.items():
            set_parameter(output.parameters[key], value)
    for key, value in (document.get("parameters") or {}).items():
        set_parameter(message.parameters[key], value)
    return message


def _header_length(outcome: Outcome) -> int | None:
    for name, value in outcome.headers:
        if name.lower() == b"inference-header-content-length":
            return int(value)
    return None


def _model_path(name: str, version: str) -> str:
    path = f"/v2/models/{quote(name, safe='')}"
    return path + (f"/versions/{quote(version, safe='')}" if version else "")


def _reply_metadata(outcome: Outcome) -> list[tuple[str, str]]:
    metadata = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in outcome.headers
        if name.lower() in _PASSED
    ]
    if outcome.backend is not None:
        metadata.append(("x-tailserve-replica", outcome.backend))
        if outcome.hedged:
            metadata.append(("x-tailserve-hedged", "1"))
    return metadata


async def _refuse(context: grpc.aio.ServicerContext, outcome: Outcome) -> None:
    """Abort the call with the reply's status and message (raises)."""
    trailing = [
        ("retry-after", value.decode("latin-1"))
        for name, value in outcome.headers
        if name.lower() == b"retry-after"
    ]
    await context.abort(code_of(outcome.status), error_message(outcome.body), tuple(trailing))


class Gateway:
    """The service's handlers, over a running `Router`."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def handlers(self) -> grpc.GenericRpcHandler:
        return generic_handler(self)

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerReadyResponse(ready=self.router.ready())

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        path = _model_path(request.name, request.version) + "/ready"
        outcome = await self._get(request.name, path, context)
        return schema.ModelReadyResponse(ready=outcome.status == 200)

    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outcome = await self._get(ANY, "/v2", context)
        if outcome.status != 200:
            await _refuse(context, outcome)
        document = orjson.loads(outcome.body)
        return schema.ServerMetadataResponse(
            name=document.get("name", ""),
            version=document.get("version", ""),
            extensions=list(document.get("extensions", [])),
        )

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outcome = await self._get(request.name, _model_path(request.name, request.version), context)
        if outcome.status != 200:
            await _refuse(context, outcome)
        document = orjson.loads(outcome.body)
        message = schema.ModelMetadataResponse(
            name=document.get("name", ""),
            versions=document.get("versions", []),
            platform=document.get("platform", ""),
        )
        for side in ("inputs", "outputs"):
            for spec in document.get(side, []):
                getattr(message, side).add(
                    name=spec["name"], datatype=spec["datatype"], shape=spec["shape"]
                )
        return message

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        router = self.router
        started = router.loop.time()
        model = request.model_name
        status = 500
        try:
            body, header_length = http_request(request)
            dispatcher = router.dispatcher
            headers = [
                ("content-type", "application/octet-stream"),
                ("inference-header-content-length", str(header_length)),
            ]
            path = _model_path(model, request.model_version) + "/infer"
            outcome = await dispatcher.request(
                model,
                request_framer("POST", path, body, headers),
                key=body_key(body, header_length) if dispatcher.wants_key(model) else None,
                cost=cost_class(len(body)),
                deadline_s=time_left_s(context),
                hedge=True,
            )
            status = outcome.status
            if status != 200:
                await _refuse(context, outcome)
            # In the trailing metadata, which goes with the status: initial metadata would
            # be an operation of its own (measured: 8% of the router's samples).
            context.set_trailing_metadata(_reply_metadata(outcome))
            return infer_response(outcome)
        except TailserveError as exc:
            status = status_of(exc)
            raise
        except asyncio.CancelledError:  # the client gave up: its copies are withdrawn
            status = 499
            raise
        finally:
            label = model if model != ANY and router.knows(model) else "_other"
            router.metrics.requests.inc(label, str(status))
            router.metrics.latency.child(label).observe(router.loop.time() - started)

    async def _get(self, model: str, path: str, context: grpc.aio.ServicerContext) -> Outcome:
        frame = request_framer("GET", path)
        return await self.router.dispatcher.request(
            model or ANY, frame, deadline_s=time_left_s(context), idempotent=True
        )
