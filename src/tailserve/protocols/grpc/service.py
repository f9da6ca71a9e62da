"""The worker's gRPC surface: the Open Inference Protocol's ``GRPCInferenceService``.

Health (ServerLive, ServerReady, ModelReady), metadata (ServerMetadata, ModelMetadata),
ModelInfer and ModelStreamInfer (requests pipelined on one stream), on the worker's event
loop beside the HTTP server, into the same data plane: a gRPC request is shed, batched,
cached, admitted and refused like an HTTP one. ``tritonclient.grpc`` and the KServe clients
work unchanged.

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

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tailserve.engine.dataplane import DataPlane
from tailserve.engine.messages import InferRequest, InferResponse, RequestedOutput
from tailserve.engine.traffic import Traffic
from tailserve.errors import TailserveError
from tailserve.observability.metrics import Metrics
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.common import (
    generic_handler,
    malformed,
    parameters_of,
    raw_contents,
    set_parameter,
    time_left_s,
    typed_array,
)
from tailserve.protocols.http.errors import status_of
from tailserve.tensors import Tensor, from_binary, to_binary

log = logging.getLogger(__name__)

# Requests of one stream in flight or answered and not yet sent; past it the stream is not
# read until an answer has gone.
MAX_STREAM_IN_FLIGHT = 1024
_END = object()


def decode_request(message: Any) -> InferRequest:
    """A ``ModelInferRequest`` as the engine's request."""
    raw = raw_contents(message)
    inputs = []
    for index, tensor in enumerate(message.inputs):
        shape = list(tensor.shape)
        if raw:
            data = from_binary(tensor.name, tensor.datatype, shape, raw[index])
        else:
            data = typed_array(tensor)
        inputs.append(Tensor(tensor.name, tensor.datatype, data, parameters_of(tensor.parameters)))
    outputs = None
    if message.outputs:
        outputs = [RequestedOutput(o.name, parameters_of(o.parameters)) for o in message.outputs]
    return InferRequest(
        model=message.model_name,
        inputs=inputs,
        version=message.model_version or None,
        id=message.id or None,
        outputs=outputs,
        parameters=parameters_of(message.parameters),
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
        set_parameter(message.parameters[key], value)
    return message


class InferenceService:
    """The handlers, over the worker's data plane."""

    def __init__(self, dataplane: DataPlane, metrics: Metrics | None = None) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        # Inference calls held and finished, for the event loop's backlog (engine.traffic).
        self.traffic = Traffic()

    def handlers(self) -> grpc.GenericRpcHandler:
        return generic_handler(self)

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
            name=document["name"],
            version=document["version"],
            extensions=list(document["extensions"]),
        )

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
        return await self._infer(request, time_left_s(context))

    async def model_stream_infer(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Requests pipelined on one stream, each answered as soon as it is done (out of order:
        the client matches them by ``id``), an error as that request's ``error_message``, the
        stream going on. The client closing its side ends the stream once every answer has
        gone; the client leaving cancels the requests still in flight."""
        answers: asyncio.Queue[Any] = asyncio.Queue()
        room = asyncio.Semaphore(MAX_STREAM_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def answer(request: Any, left_s: float | None) -> None:
            try:
                message = schema.ModelStreamInferResponse(
                    infer_response=await self._infer(request, left_s)
                )
            except TailserveError as exc:
                message = _stream_error(request, exc.message)
            except Exception as exc:
                log.exception("unexpected error in a gRPC stream's request")
                message = _stream_error(request, f"internal error: {type(exc).__name__}")
            answers.put_nowait(message)

        async def read() -> None:
            async for request in requests:
                # More than the bound in flight or unsent: stop reading (HTTP/2's flow control
                # holds the client back) until an answer has gone.
                await room.acquire()
                reason = malformed(request)
                if reason is not None:
                    answers.put_nowait(schema.ModelStreamInferResponse(error_message=reason))
                    continue
                task = asyncio.create_task(answer(request, time_left_s(context)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(list(tasks))
            answers.put_nowait(_END)

        reader = asyncio.create_task(read())
        try:
            while (message := await answers.get()) is not _END:
                yield message
                room.release()
            await reader  # (its error, if it failed, ends the call)
        finally:
            for task in [reader, *tasks]:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _infer(self, request: Any, left_s: float | None) -> Any:
        """One inference request (of a unary call or a stream): ``left_s`` of the call's gRPC
        deadline counts as X-Deadline-Ms does."""
        started = time.perf_counter()
        status = 200
        self.traffic.in_flight += 1
        try:
            received = time.monotonic()
            deadline_ms = left_s * 1e3 if left_s is not None else None
            # Shed before decoding, as over HTTP; a ``timeout`` parameter with no gRPC deadline
            # may be looser than the SLO, and is left to admission.
            screened = deadline_ms is not None or "timeout" not in request.parameters
            if screened:
                self.dataplane.shed(
                    request.model_name,
                    request.model_version or None,
                    received_at=received,
                    deadline_ms=deadline_ms,
                )
            infer = decode_request(request)
            infer.received_at = received
            infer.deadline_ms = deadline_ms
            return encode_response(await self.dataplane.infer(infer, screened=screened))
        except TailserveError as exc:
            status = status_of(exc)
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception:
            status = 500
            raise
        finally:
            self.traffic.in_flight -= 1
            if status == 429:
                self.traffic.refused += 1
            else:
                self.traffic.answered += 1
            if self.metrics is not None:
                model = request.model_name
                label = model if self.dataplane.knows(model) else "_unknown"
                self.metrics.on_request(label, "grpc", status, time.perf_counter() - started)


def _stream_error(request: Any, message: str) -> Any:
    """An error answer on a stream, naming the request it answers."""
    answer = schema.ModelStreamInferResponse(error_message=message)
    answer.infer_response.model_name = request.model_name
    answer.infer_response.model_version = request.model_version
    answer.infer_response.id = request.id
    return answer
