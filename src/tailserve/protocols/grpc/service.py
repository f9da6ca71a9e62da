"""The worker's gRPC surface: the Open Inference Protocol's ``GRPCInferenceService``.

Health (ServerLive, ServerReady, ModelReady), metadata (ServerMetadata, ModelMetadata) and
ModelInfer, on the worker's event loop beside the HTTP server, into the same data plane: a
gRPC request is batched, cached, admitted and refused like an HTTP one. ``tritonclient.grpc``
and the KServe clients work unchanged.

- Inputs come as ``raw_input_contents`` (one raw buffer per input, in order; BYTES items
  4-byte length-prefixed, as the binary HTTP extension has them) or as typed ``contents``.
  Outputs always go back raw, in ``raw_output_contents``.
- Request options are the same parameters as over HTTP (``timeout`` in µs, ``priority``,
  ``cache``); a gRPC deadline set by the client counts as ``X-Deadline-Ms`` does.
- Errors carry the HTTP status's gRPC counterpart and the same message: 400 →
  INVALID_ARGUMENT, 404 → NOT_FOUND, 429 → RESOURCE_EXHAUSTED, 503 → UNAVAILABLE, 504 →
  DEADLINE_EXCEEDED; anything unexpected is INTERNAL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import orjson

from tailserve.engine.dataplane import DataPlane
from tailserve.engine.messages import InferRequest, InferResponse, RequestedOutput
from tailserve.errors import InvalidInput, TailserveError
from tailserve.observability.metrics import Metrics
from tailserve.protocols.grpc import schema
from tailserve.protocols.http.errors import status_of
from tailserve.tensors import Tensor, from_binary, from_json, to_binary

log = logging.getLogger(__name__)

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Which typed ``contents`` field carries each datatype.
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}  # fmt: skip


def decode_request(message: Any) -> InferRequest:
    """A ``ModelInferRequest`` as the engine's request."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(
            f"raw_input_contents holds {len(raw)} buffers for {len(message.inputs)} inputs"
        )
    inputs = []
    for index, tensor in enumerate(message.inputs):
        shape = list(tensor.shape)
        if raw:
            data = from_binary(tensor.name, tensor.datatype, shape, raw[index])
        else:
            field = _CONTENTS.get(tensor.datatype)
            if field is None:
                raise InvalidInput(
                    f"tensor {tensor.name!r}: {tensor.datatype} travels in raw_input_contents only"
                )
            values = list(getattr(tensor.contents, field))
            data = from_json(tensor.name, tensor.datatype, shape, values)
        inputs.append(Tensor(tensor.name, tensor.datatype, data, _parameters(tensor.parameters)))
    outputs = None
    if message.outputs:
        outputs = [RequestedOutput(o.name, _parameters(o.parameters)) for o in message.outputs]
    return InferRequest(
        model=message.model_name,
        inputs=inputs,
        version=message.model_version or None,
        id=message.id or None,
        outputs=outputs,
        parameters=_parameters(message.parameters),
    )


def encode_response(response: InferResponse) -> Any:
    """The engine's response as a ``ModelInferResponse``, every output raw."""
    message = schema.ModelInferResponse(
        model_name=response.model, model_version=response.version, id=response.id or ""
    )
    for tensor in response.outputs:
        output = message.outputs.add(name=tensor.name, datatype=tensor.datatype)
        output.shape.extend(tensor.shape)
        message.raw_output_contents.append(to_binary(tensor.data))
    for key, value in response.parameters.items():
        _set_parameter(message.parameters[key], value)
    return message


def _parameters(entries: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, parameter in entries.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(parameter, choice)
    return out


def _set_parameter(parameter: Any, value: Any) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    else:  # (lineage and other structured values: as their JSON)
        parameter.string_param = orjson.dumps(value, default=str).decode()


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class InferenceService:
    """The handlers, over the worker's data plane."""

    def __init__(self, dataplane: DataPlane, metrics: Metrics | None = None) -> None:
        self.dataplane = dataplane
        self.metrics = metrics

    def handlers(self) -> grpc.GenericRpcHandler:
        methods: dict[str, tuple[Handler, Any]] = {
            "ServerLive": (self.server_live, schema.ServerLiveRequest),
            "ServerReady": (self.server_ready, schema.ServerReadyRequest),
            "ModelReady": (self.model_ready, schema.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, schema.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, schema.ModelMetadataRequest),
            "ModelInfer": (self.model_infer, schema.ModelInferRequest),
        }
        return grpc.method_handlers_generic_handler(schema.SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(
                _guarded(handler), request_deserializer=_parser(kind),
                response_serializer=lambda message: message.SerializeToString(),
            )
            for name, (handler, kind) in methods.items()
        })  # fmt: skip

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerLiveResponse(live=self.dataplane.live())

    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerReadyResponse(ready=self.dataplane.ready())

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ready = self.dataplane.model_ready(request.name, request.version or None)
        return schema.ModelReadyResponse(ready=ready)

    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        document = self.dataplane.server_metadata()
        return schema.ServerMetadataResponse(
            name=document["name"], version=document["version"],
            extensions=list(document["extensions"]),
        )  # fmt: skip

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        document = self.dataplane.model_metadata(request.name, request.version or None)
        message = schema.ModelMetadataResponse(
            name=document["name"], versions=document["versions"], platform=document["platform"]
        )
        for side in ("inputs", "outputs"):
            for spec in document[side]:
                getattr(message, side).add(
                    name=spec["name"], datatype=spec["datatype"], shape=spec["shape"]
                )
        return message

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        status = 200
        try:
            infer = decode_request(request)
            infer.received_at = time.monotonic()
            remaining = context.time_remaining()
            if remaining is not None:  # the client's gRPC deadline, as X-Deadline-Ms
                infer.deadline_ms = max(remaining, 1e-6) * 1e3
            return encode_response(await self.dataplane.infer(infer))
        except TailserveError as exc:
            status = status_of(exc)
            raise
        except Exception:
            status = 500
            raise
        finally:
            if self.metrics is not None:
                model = request.model_name
                label = model if self.dataplane.knows(model) else "_unknown"
                self.metrics.on_request(label, "grpc", status, time.perf_counter() - started)


class _Malformed:
    """Bytes that are no message of the method's kind (the handler answers
    INVALID_ARGUMENT, where grpcio itself would answer INTERNAL)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parser(kind: Any) -> Callable[[bytes], Any]:
    name = kind.DESCRIPTOR.name

    def parse(data: bytes) -> Any:
        try:
            return kind.FromString(data)
        except Exception as exc:  # protobuf's DecodeError, and whatever a runtime raises
            return _Malformed(f"the request is not a valid {name}: {exc}")

    return parse


def _guarded(handler: Handler) -> Handler:
    """Errors as gRPC statuses with the message the HTTP surface would give."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            return await handler(request, context)
        except TailserveError as exc:
            code = _CODES.get(status_of(exc), grpc.StatusCode.INTERNAL)
            await context.abort(code, exc.message)
        except Exception as exc:
            log.exception("unexpected error in gRPC %s", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

    return call


async def start(
    service: InferenceService, host: str, port: int, *, max_message_bytes: int
) -> grpc.aio.Server:
    """A started gRPC server on ``host:port`` (raises OSError when the port is taken)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((service.handlers(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC could not listen on {host}:{port}")
    await server.start()
    return server
