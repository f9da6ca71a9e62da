"""What the worker's gRPC service and the router's gRPC front share: the method table of
``GRPCInferenceService`` with request parsing and error statuses, the server, the HTTP status
each gRPC status stands for, and ``InferParameter`` values to and from Python."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
import numpy as np
import orjson

from tailserve.errors import InvalidInput, TailserveError, shown
from tailserve.protocols.grpc import schema
from tailserve.protocols.http.errors import status_of
from tailserve.protocols.refusals import HEADER as REFUSAL_HEADER
from tailserve.protocols.refusals import refusal_reason
from tailserve.tensors import from_json

log = logging.getLogger(__name__)

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Which typed ``contents`` field carries each datatype.
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def code_of(status: int) -> grpc.StatusCode:
    """The gRPC counterpart of an HTTP status (INTERNAL for any other)."""
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


def time_left_s(context: grpc.aio.ServicerContext) -> float | None:
    """What is left of the call's gRPC deadline (seconds, above 0), or None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else max(remaining, 1e-6)


def raw_contents(message: Any) -> Any:
    """A ``ModelInferRequest``'s raw input buffers (empty: the inputs are typed), checked
    against its inputs."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(
            f"raw_input_contents holds {len(raw)} buffers for {len(message.inputs)} inputs"
        )
    return raw


def typed_array(tensor: Any) -> np.ndarray[Any, Any]:
    """An input tensor's typed ``contents`` as an array of its shape."""
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        raise InvalidInput(
            f"tensor {tensor.name!r}: {tensor.datatype} travels in raw_input_contents only"
        )
    values = list(getattr(tensor.contents, field))
    return from_json(tensor.name, tensor.datatype, list(tensor.shape), values)


def parameters_of(entries: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, parameter in entries.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            value = getattr(parameter, choice)
            # JSON has no NaN or infinity: sent on over HTTP, one would turn into null and be
            # dropped unseen, so it is refused here as the HTTP surface would refuse it.
            if choice == "double_param" and not math.isfinite(value):
                raise InvalidInput(f"parameter {shown(key)} is {value}: not a finite number")
            out[key] = value
    return out


def set_parameter(parameter: Any, value: Any) -> None:
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


class _Malformed:
    """Bytes that are no message of the method's kind (the handler answers
    INVALID_ARGUMENT, where grpcio itself would answer INTERNAL)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def parser(kind: Any) -> Callable[[bytes], Any]:
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
            # A refusal says why (docs/observability.md), beside what the handler set.
            trailing = tuple(context.trailing_metadata() or ())
            reason = refusal_reason(exc)
            if reason is not None:
                trailing += ((REFUSAL_HEADER, reason),)
            await context.abort(code_of(status_of(exc)), exc.message, trailing)
        except grpc.aio.AbortError:  # the handler's own answer, already given
            raise
        except Exception as exc:
            if context.done():
                # The call ended under it (its deadline passed, the client left): an answer
                # could no longer be given (aborting fails then), and nobody waits for one.
                return None
            log.exception("unexpected error in gRPC %s", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

    return call


class Servicer(Protocol):
    """The service's methods, each taking the parsed request and the call's context."""

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...
    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...
    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...
    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...
    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...
    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...


Parse = Callable[[bytes], Any]


def unary_methods(servicer: Servicer) -> dict[str, tuple[Handler, Parse]]:
    """The service's unary methods by name: each handler answering errors as statuses
    (`_guarded`), and the parser of its request (bytes that are no such message: a
    `_Malformed` the handler answers INVALID_ARGUMENT)."""
    methods: dict[str, tuple[Handler, Any]] = {
        "ServerLive": (servicer.server_live, schema.ServerLiveRequest),
        "ServerReady": (servicer.server_ready, schema.ServerReadyRequest),
        "ModelReady": (servicer.model_ready, schema.ModelReadyRequest),
        "ServerMetadata": (servicer.server_metadata, schema.ServerMetadataRequest),
        "ModelMetadata": (servicer.model_metadata, schema.ModelMetadataRequest),
        "ModelInfer": (servicer.model_infer, schema.ModelInferRequest),
    }
    return {name: (_guarded(handler), parser(kind)) for name, (handler, kind) in methods.items()}


def generic_handler(servicer: Servicer) -> grpc.GenericRpcHandler:
    """The service's unary methods for grpcio's server (`unary_methods`): the routing
    lane's gateway. (The worker serves its own over HTTP/2: `over_http2`.)"""
    table = {
        name: grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=parse, response_serializer=serialize
        )
        for name, (handler, parse) in unary_methods(servicer).items()
    }
    return grpc.method_handlers_generic_handler(schema.SERVICE, table)


def serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def malformed(request: Any) -> str | None:
    """Why a parsed request is no such message (None: it is one)."""
    return request.reason if isinstance(request, _Malformed) else None


async def start(
    handler: grpc.GenericRpcHandler, host: str, port: int, *, max_message_bytes: int
) -> grpc.aio.Server:
    """A started gRPC server of ``handler`` on ``host:port`` (raises OSError when the port is
    taken)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC could not listen on {host}:{port}")
    await server.start()
    return server
