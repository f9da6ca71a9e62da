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
  DEADLINE_EXCEEDED; anything unexpected is INTERNAL. A refusal says why in the trailing
  metadata's ``x-refusal-reason`` (a stream's, in its answer's ``refusal_reason`` parameter).
- Traces, while tracing is on: the call's ``traceparent`` metadata is the parent of each of
  its requests' spans (`grpc/traced.py`), and a sampled request's trace id is in its
  response's ``trace_id`` parameter (a unary call's, in ``x-trace-id`` trailing metadata too).
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
from tailserve.engine.validation import Checked
from tailserve.errors import TailserveError
from tailserve.observability.metrics import Metrics
from tailserve.observability.tracing import Tracing
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.common import (
    malformed,
    parameters_of,
    raw_contents,
    set_parameter,
    time_left_s,
    typed_array,
)
from tailserve.protocols.grpc.layouts import LayoutReader, reader_for
from tailserve.protocols.grpc.traced import Heads, RequestTrace
from tailserve.protocols.http.errors import status_of
from tailserve.protocols.refusals import refusal_reason
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
        name, datatype, given = tensor.name, tensor.datatype, tensor.parameters
        if raw:
            data = from_binary(name, datatype, list(tensor.shape), raw[index])
        else:
            data = typed_array(tensor)
        inputs.append(Tensor(name, datatype, data, parameters_of(given) if given else {}))
    return request_of(message, inputs)


def request_of(message: Any, inputs: list[Tensor]) -> InferRequest:
    """A ``ModelInferRequest`` as the engine's request, its inputs read."""
    outputs = None
    if message.outputs:
        outputs = [RequestedOutput(o.name, parameters_of(o.parameters)) for o in message.outputs]
    sent = message.parameters
    return InferRequest(
        model=message.model_name,
        inputs=inputs,
        version=message.model_version or None,
        id=message.id or None,
        outputs=outputs,
        parameters=parameters_of(sent) if sent else {},
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

    def __init__(
        self, dataplane: DataPlane, metrics: Metrics | None = None, tracing: Tracing | None = None
    ) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        self.tracing = tracing
        # Inference calls held and finished, for the event loop's backlog (engine.traffic).
        self.traffic = Traffic()

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
        heads = Heads.of(context, "ModelInfer") if self.tracing is not None else None
        trace = RequestTrace(self.tracing, heads) if heads is not None else None
        try:
            return await self._infer(request, time_left_s(context), trace)
        finally:
            if trace is not None and trace.trace_id is not None:
                context.set_trailing_metadata((("x-trace-id", trace.trace_id),))

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

        # Every request of the stream hangs under the call's traceparent; the front door's
        # stamp is the stream's opening, so only its first request has a frontdoor span.
        heads = Heads.of(context, "ModelStreamInfer") if self.tracing is not None else None

        async def answer(request: Any, left_s: float | None, heads: Heads | None) -> None:
            trace = RequestTrace(self.tracing, heads) if heads is not None else None
            try:
                message = schema.ModelStreamInferResponse(
                    infer_response=await self._infer(request, left_s, trace)
                )
            except TailserveError as exc:
                message = _stream_error(request, exc.message, refusal_reason(exc))
                if trace is not None and trace.trace_id is not None:
                    set_parameter(message.infer_response.parameters["trace_id"], trace.trace_id)
            except Exception as exc:
                log.exception("unexpected error in a gRPC stream's request")
                message = _stream_error(request, f"internal error: {type(exc).__name__}")
            answers.put_nowait(message)

        async def read() -> None:
            nonlocal heads
            async for request in requests:
                # More than the bound in flight or unsent: stop reading (HTTP/2's flow control
                # holds the client back) until an answer has gone.
                await room.acquire()
                reason = malformed(request)
                if reason is not None:
                    answers.put_nowait(schema.ModelStreamInferResponse(error_message=reason))
                    continue
                task = asyncio.create_task(answer(request, time_left_s(context), heads))
                if heads is not None:
                    heads = heads.later()
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

    def _decode(self, message: Any) -> InferRequest:
        """The request, its inputs checked where the model's layout reader judged them
        (`grpc.layouts`); read the general way otherwise, and its layout learnt."""
        reader = self._reader(message.model_name, message.model_version or None)
        if reader is None:
            return decode_request(message)
        found = reader.read(message)
        checked: Checked | None
        if found is not None:
            inputs, checked = found
            request = request_of(message, inputs)
        else:
            request = decode_request(message)
            checked = reader.learn(message, request.inputs)
        if checked is not None:
            request.checked = (reader.plan, checked)
        return request

    def _reader(self, model: str, version: str | None) -> LayoutReader | None:
        served = self.dataplane.serving(model, version)
        return None if served is None else reader_for(served.config, served.plan)

    async def _infer(self, request: Any, left_s: float | None, trace: RequestTrace | None) -> Any:
        """One inference request (of a unary call or a stream): ``left_s`` of the call's gRPC
        deadline counts as X-Deadline-Ms does; ``trace``: its spans, while tracing is on."""
        started = time.perf_counter()
        status = 200
        refusal = None
        self.traffic.in_flight += 1
        received = time.monotonic()
        try:
            deadline_ms = left_s * 1e3 if left_s is not None else None
            # Screened before decoding, as over HTTP (a refusal of a moment ago may answer
            # it); a ``timeout`` parameter with no gRPC deadline may be looser than the SLO,
            # and is left to admission.
            screened = deadline_ms is not None or "timeout" not in request.parameters
            if screened:
                kept = self.dataplane.refusals.screen(
                    request.model_name,
                    request.model_version or None,
                    received_at=received,
                    deadline_ms=deadline_ms,
                )
                if kept is not None:
                    raise kept.error.with_traceback(None)
            infer = self._decode(request)
            infer.received_at = received
            infer.deadline_ms = deadline_ms
            if trace is None:
                return encode_response(await self.dataplane.infer(infer, screened=screened))
            marks = trace.decoded()
            response = await self.dataplane.infer(infer, screened=screened)
            marks.answered_at = time.monotonic()
            marks.parameters = response.parameters
            message = encode_response(response)
            trace_id = trace.record(request.model_name, received, 200, None)
            if trace_id is not None:
                set_parameter(message.parameters["trace_id"], trace_id)
            return message
        except TailserveError as exc:
            status = status_of(exc)
            refusal = refusal_reason(exc)
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
            model = request.model_name
            label = model if self.dataplane.knows(model) else "_unknown"
            if trace is not None and status != 200:
                trace.record(label, received, status, refusal)
            if self.metrics is not None:
                trace_id = trace.trace_id if trace is not None else None
                elapsed = time.perf_counter() - started
                self.metrics.on_request(label, "grpc", status, elapsed, trace_id)
                if trace is not None and trace_id is not None:
                    trace.exemplify(self.metrics, label)


def _stream_error(request: Any, message: str, refusal: str | None = None) -> Any:
    """An error answer on a stream, naming the request it answers (and why it was refused,
    for a refusal)."""
    answer = schema.ModelStreamInferResponse(error_message=message)
    answer.infer_response.model_name = request.model_name
    answer.infer_response.model_version = request.model_version
    answer.infer_response.id = request.id
    if refusal is not None:
        set_parameter(answer.infer_response.parameters["refusal_reason"], refusal)
    return answer
