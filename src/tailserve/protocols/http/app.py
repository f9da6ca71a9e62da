"""The worker's HTTP surface: what `server.HttpServer` calls for each request.

No web framework sits on the hot path: a route table lookup, a codec and a call into the data
plane. (benchmarks/http_overhead.py measures what this costs over a bare handler.) Handlers
return ``(status, headers, body)``; errors from the data plane become ``{"error": "..."}`` with
the status `errors.status_of` gives. What needs no waiting is answered in `answer_now`, with
no task: an unknown route, an inference whose reply the reply memo holds (cache/replies.py),
and one refused before it is decoded because its model is too busy for its deadline.

Given a gRPC bridge (`protocols.grpc.over_http1`), a POST under its prefix is a unary gRPC
call the front door forwarded over HTTP/1.1: the bridge answers it, counted as gRPC.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import orjson

from tailserve.cache.replies import ReplyMemo
from tailserve.engine.dataplane import DataPlane, Hit
from tailserve.engine.messages import InferRequest
from tailserve.errors import (
    Forbidden,
    InvalidInput,
    JobNotFound,
    TailserveError,
    Unauthorized,
    shown,
)
from tailserve.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tailserve.observability.metrics import OPENMETRICS_CONTENT_TYPE, Metrics
from tailserve.observability.trace_log import TraceRecorder
from tailserve.observability.tracing import MARKS, Marks, Tracing
from tailserve.observability.worker_spans import Arrival, record
from tailserve.protocols.http import jobs, kserve_v1, oip
from tailserve.protocols.http.binary_layouts import reader_for as binary_reader_for
from tailserve.protocols.http.errors import headers_of, status_of
from tailserve.protocols.http.headers import (
    HeaderOptions,
    Headers,
    Reply,
    read_options,
    request_options,
    served_headers,
)
from tailserve.protocols.http.oip_typed import decoder_for
from tailserve.protocols.http.openapi import openapi_document
from tailserve.protocols.http.replay import Replayer
from tailserve.protocols.http.routes import Route, Router
from tailserve.protocols.refusals import refusal_reason
from tailserve.transport.admin_access import CLOSED_MESSAGE, AdminAccess
from tailserve.transport.request import HttpRequest
from tailserve.transport.server import Trailed

log = logging.getLogger(__name__)

_JSON: Headers = [(b"content-type", b"application/json")]
OPENMETRICS_TYPE = OPENMETRICS_CONTENT_TYPE.encode()
# An inference body up to this size with no X-Deadline-Ms is looked at before the early
# refusal, to see whether it names a `timeout` (larger ones are refused, when they are, on the
# SLO).
_PEEK_BYTES = 64 * 1024
_TIMEOUT = b'"timeout"'
# A body past this size, or a compressed one (40 KB of gzip can hold 40 MiB), is decompressed
# and decoded on a thread (`_decode`): zlib lets go of the GIL while it inflates, and the
# Python parts of a decode yield to the event loop at the switch interval (0.5 ms), so the
# other requests go on meanwhile. One long C call (orjson parsing a large document) still
# holds the GIL throughout. (benchmarks/large_bodies.py: small requests beside 40 MiB gzip
# bombs went from p50 268-329 ms to 1.0-1.2 ms.)
_THREAD_BODY_BYTES = 256 * 1024
_IDENTITY = (None, b"", b"identity")
T = TypeVar("T")
# Routes whose requests may be refused before they are decoded (`_shed`).
_SHED = frozenset(("infer", "predict_v1"))


class GrpcBridge(Protocol):
    """Unary gRPC calls over HTTP/1.1 (`protocols.grpc.over_http1`)."""

    prefix: str

    async def answer(self, request: HttpRequest) -> Reply | Trailed: ...


# The route of a gRPC call over HTTP/1.1 (not in the route table: no OpenAPI operation).
GRPC_ROUTE = Route("POST", "/inference.GRPCInferenceService/{method}", "grpc", "A gRPC call.")


class SlowFault:
    """A test-only fault: ``fraction`` of the requests take ``factor`` times as long as they
    did (the extra time spent asleep, so the worker stays free for the others). The router
    benchmark makes one of four workers slow this way; nothing else should set it."""

    def __init__(self, fraction: float, factor: float, rng: random.Random | None = None):
        if not 0.0 <= fraction <= 1.0 or factor < 1.0:
            raise ValueError(f"need 0 <= fraction <= 1 and factor >= 1, not {fraction}, {factor}")
        self.fraction = fraction
        self.factor = factor
        self._rng = rng or random.Random()

    async def delay(self, elapsed_s: float) -> None:
        if self.fraction and self._rng.random() < self.fraction:
            await asyncio.sleep((self.factor - 1.0) * elapsed_s)


class HttpApp:
    def __init__(
        self,
        dataplane: DataPlane,
        metrics: Metrics,
        *,
        admin_token: str | None = None,
        admin_access: AdminAccess = AdminAccess.OPEN,
        recorder: TraceRecorder | None = None,
        slow_fault: SlowFault | None = None,
        reply_memo: ReplyMemo | None = None,
        jobs: jobs.JobsApi | None = None,
        tracing: Tracing | None = None,
        grpc: GrpcBridge | None = None,
    ) -> None:
        self.dataplane = dataplane
        self._grpc = grpc
        self.tracing = tracing
        self.jobs = jobs
        # Not with the test-only fault: it delays replies, a kept one as much as any.
        self._replayer = None
        if reply_memo is not None and slow_fault is None:
            self._replayer = Replayer(dataplane, reply_memo, recorder)
        self._slow_fault = slow_fault
        self.metrics = metrics
        self._admin = f"Bearer {admin_token}".encode() if admin_token else None
        self._admin_closed = admin_access is AdminAccess.CLOSED
        self._recorder = recorder
        self._router = Router()
        self._openapi_body = orjson.dumps(openapi_document())
        # Each route's handler, by the name the route table gives it (routes.py).
        self.handlers: dict[str, Callable[[HttpRequest], Awaitable[Reply]]] = {
            "live": self._live,
            "ready": self._ready,
            "server_metadata": self._server_metadata,
            "model_metadata": self._model_metadata,
            "model_ready": self._model_ready,
            "model_stats": self._model_stats,
            "model_config": self._model_config,
            "infer": self._infer,
            "predict_v1": self._predict_v1,
            "model_status_v1": self._model_status_v1,
            "submit_job": self._submit_job,
            "submit_job_v1": self._submit_job_v1,
            "get_job": self._get_job,
            "cancel_job": self._cancel_job,
            "list_jobs": self._list_jobs,
            "repository_index": self._repository_index,
            "load_model": self._load_model,
            "unload_model": self._unload_model,
            "invalidate": self._invalidate,
            "metrics": self._metrics,
            "openapi": self._openapi,
        }

    def answer_now(self, request: HttpRequest) -> Reply | None:
        """The reply when it needs no waiting: no such route, a kept reply, or an inference
        refused before it is decoded. None: `answer` is called."""
        if self._grpc is not None and request.path.startswith(self._grpc.prefix):
            request.route = GRPC_ROUTE  # (no REST route lies under the service's prefix)
            return None
        route, params, path_known = self._router.match(request.method, request.path)
        if route is None:
            if path_known:
                allow = (b"allow", self._router.allowed(request.path).encode())
                message = f"method not allowed: {request.method} {request.path}"
                return 405, [*_JSON, allow], _error(message)
            return 404, _JSON, _error(f"no such route: {request.method} {request.path}")
        request.route = route
        request.params = params
        if route.handler not in _SHED:
            return None
        try:
            options = request.options = read_options(request)
        except TailserveError as exc:
            return self._counted(request, route, *_refusal(exc))
        if self._replayer is not None and route.handler == "infer":
            kept = self._replayer.replayed(request, options)
            if kept is not None:
                self.dataplane.online_requests += 1
                return self._counted(request, route, *kept)
        try:
            refused = self._shed(request, params["model"], params.get("version"), options)
        except TailserveError as exc:
            return self._counted(request, route, *_refusal(exc))
        if refused is not None:
            return self._counted(request, route, *refused)
        return None

    async def answer(self, request: HttpRequest) -> Reply | Trailed:
        route: Route = request.route
        if route is GRPC_ROUTE and self._grpc is not None:
            return await self._grpc.answer(request)
        handler = self.handlers[route.handler]
        try:
            if route.admin:
                self._authorize(request)
            status, headers, body = await handler(request)
            if self._slow_fault is not None and route.protocol is not None:
                await self._slow_fault.delay(time.monotonic() - request.received_at)
        except asyncio.CancelledError:
            if request.disconnected:
                # The client hung up (the loser of a hedge, a caller that gave up): its queued
                # work is dropped and nobody is left to answer. 499 as nginx counts it.
                self._counted(request, route, 499, _JSON, b"")
            raise
        except TailserveError as exc:
            status, headers, body = _refusal(exc)
        except Exception as exc:
            log.exception("unexpected error on %s %s", request.method, request.path)
            status, headers, body = 500, _JSON, _error(f"internal error: {type(exc).__name__}")
        return self._counted(request, route, status, headers, body)

    def _counted(
        self, request: HttpRequest, route: Route, status: int, headers: Headers, body: bytes
    ) -> Reply:
        if route.protocol is not None:
            model = request.params.get("model", "")
            label = model if self.dataplane.knows(model) else "_unknown"
            elapsed = time.monotonic() - request.received_at
            trace_id = None
            if self.tracing is not None:
                trace_id = self._traced(request, route, label, status, headers)
                if trace_id is not None:
                    headers = [*headers, (b"x-trace-id", trace_id.encode())]
            self.metrics.on_request(label, route.protocol, status, elapsed, trace_id)
        return status, headers, body

    def _traced(
        self, request: HttpRequest, route: Route, model: str, status: int, headers: Headers
    ) -> str | None:
        """The request's spans (observability/worker_spans.py); its trace id if sampled."""
        assert self.tracing is not None and route.protocol is not None
        marks = MARKS.get()
        arrival = Arrival(
            request.header(b"traceparent"),
            request.header(b"tracestate"),
            request.header(b"x-frontdoor-received-us"),
            request.received_at,
            route.handler,
            model,
            route.protocol,
        )
        reason = next((v.decode() for k, v in headers if k == b"x-refusal-reason"), None)
        parameters = marks.parameters if marks is not None else None
        trace_id = record(self.tracing, arrival, status, marks, parameters, reason)
        if trace_id is not None and parameters and parameters.get("compute_us"):
            seconds = parameters["compute_us"] / 1e6
            bucket = str(parameters.get("cost_class", ""))
            self.metrics.on_traced_compute(model, bucket, seconds, trace_id)
        return trace_id

    def _marks(self) -> Marks | None:
        """This request's marks, while tracing is on (the cache and pipelines note their
        moments in them)."""
        if self.tracing is None:
            return None
        marks = Marks()
        MARKS.set(marks)
        return marks

    def _authorize(self, request: HttpRequest) -> None:
        if self._admin_closed:
            raise Forbidden(CLOSED_MESSAGE)
        if self._admin is None:
            return
        given = request.header(b"authorization") or b""
        if not hmac.compare_digest(given, self._admin):
            raise Unauthorized("this admin route needs 'Authorization: Bearer <token>'")

    def _shed(
        self, request: HttpRequest, model: str, version: str | None, options: HeaderOptions
    ) -> Reply | None:
        """Refuse before decoding when the model is too busy for the request's deadline: the
        header's, else the model's SLO. A ``timeout`` parameter in the body may be looser
        than the SLO (the tighter of it and the header wins): a small body with no header
        that names one is left to admission, which sees its real deadline; so is a compressed
        one with no header (what it names is not known until it is decompressed).

        Raises the refusal, or returns its reply where the data plane keeps it for the like
        requests of the next moment (`engine.kept_refusals`: the reply is rendered once and
        kept with it); None: the request goes on."""
        deadline_ms = options.deadline_ms
        if deadline_ms is None and request.route.handler == "infer":
            encoding = request.header(b"content-encoding")
            if encoding not in (None, b"", b"identity"):
                return None
            body = request.raw_body
            if len(body) <= _PEEK_BYTES:
                header = _header_length(request.header(b"inference-header-content-length"))
                if _TIMEOUT in (body if header is None else body[:header]):
                    return None
        refusal = self.dataplane.refusals.screen(
            model, version, received_at=request.received_at, deadline_ms=deadline_ms
        )
        if refusal is None:
            request.screened = True
            return None
        if refusal.reply is None:
            refusal.reply = _refusal(refusal.error)
        reply: Reply = refusal.reply
        return reply

    # --- health and metadata ----------------------------------------------------------------

    async def _live(self, request: HttpRequest) -> Reply:
        return 200, _JSON, orjson.dumps({"live": self.dataplane.live()})

    async def _ready(self, request: HttpRequest) -> Reply:
        ready = self.dataplane.ready()
        return (200 if ready else 503), _JSON, orjson.dumps({"ready": ready})

    async def _server_metadata(self, request: HttpRequest) -> Reply:
        return 200, _JSON, orjson.dumps(self.dataplane.server_metadata())

    async def _model_metadata(self, request: HttpRequest) -> Reply:
        p = request.params
        return 200, _JSON, orjson.dumps(self.dataplane.model_metadata(p["model"], p.get("version")))

    async def _model_ready(self, request: HttpRequest) -> Reply:
        p = request.params
        ready = self.dataplane.model_ready(p["model"], p.get("version"))
        # OIP: 200 means ready, a 4xx means not.
        document = {"name": p["model"], "ready": ready}
        return (200 if ready else 400), _JSON, orjson.dumps(document)

    async def _model_stats(self, request: HttpRequest) -> Reply:
        p = request.params
        if "model" not in p:
            documents = []
            for state in self.dataplane.manager.states():
                documents += self.dataplane.model_stats(state.name)["model_stats"]
            return 200, _JSON, orjson.dumps({"model_stats": documents})
        document = self.dataplane.model_stats(p["model"], p.get("version"))
        return 200, _JSON, orjson.dumps(document)

    async def _model_config(self, request: HttpRequest) -> Reply:
        p = request.params
        return 200, _JSON, orjson.dumps(self.dataplane.model_config(p["model"], p.get("version")))

    # --- inference --------------------------------------------------------------------------

    async def _decode(self, request: HttpRequest, decode: Callable[[bytes], T]) -> T:
        """The request's body decompressed and decoded (on a thread when it is large or
        compressed), and traced when a trace is being recorded."""
        if (
            len(request.raw_body) <= _THREAD_BODY_BYTES
            and request.header(b"content-encoding") in _IDENTITY
        ):
            body = request.decoded_body()
            self._trace(request, body)
            return decode(body)

        def work() -> tuple[bytes, T | None, TailserveError | None]:
            body = request.decoded_body()
            try:
                return body, decode(body), None
            except TailserveError as exc:
                return body, None, exc

        body, decoded, error = await asyncio.to_thread(work)
        self._trace(request, body)
        if error is not None:
            raise error
        return decoded  # type: ignore[return-value]  # (None only with an error)

    def _trace(self, request: HttpRequest, body: bytes) -> None:
        if self._recorder is not None:
            self._recorder.record(request.method, request.path, request.headers, body)

    async def _infer(self, request: HttpRequest) -> Reply:
        p = request.params
        header_length = _header_length(request.header(b"inference-header-content-length"))
        model, version = p["model"], p.get("version")
        served = self.dataplane.serving(model, version)
        typed = binary = None
        if served is not None:
            if header_length is None:
                typed = decoder_for(served.config, served.plan)
            else:
                binary = binary_reader_for(served.config, served.plan)

        def decode(body: bytes) -> InferRequest:
            if typed is not None:
                decoded = typed.decode(model, version, body)
                if decoded is not None:
                    return decoded
            elif binary is not None and header_length is not None:
                return binary.decode(model, version, body, header_length)
            return oip.decode_request(model, version, body, header_length)

        infer_request = await self._decode(request, decode)
        request_options(request, infer_request, request.options or read_options(request))
        replayer = self._replayer
        hits: list[Hit] = []
        marks = self._marks()
        if marks is not None:
            marks.decoded_at = time.monotonic()
        response = await self.dataplane.infer(
            infer_request,
            screened=request.screened,
            on_hit=hits.append if replayer is not None and request.memo_key else None,
        )
        if marks is not None:
            marks.answered_at = time.monotonic()
            marks.parameters = response.parameters
        payload, headers = oip.encode_response(infer_request, response)
        headers += served_headers(response)
        if hits and replayer is not None:
            replayer.keep(request, hits[0], headers, payload)
        return 200, headers, payload

    async def _predict_v1(self, request: HttpRequest) -> Reply:
        name = request.params["model"]
        config = self.dataplane.manager.config(name)  # (a cold one loads in infer)
        infer_request = await self._decode(
            request, lambda body: kserve_v1.decode_records(name, config, body)
        )
        request_options(request, infer_request, request.options or read_options(request))
        marks = self._marks()
        if marks is not None:
            marks.decoded_at = time.monotonic()
        response = await self.dataplane.infer(infer_request, screened=request.screened)
        if marks is not None:
            marks.answered_at = time.monotonic()
            marks.parameters = response.parameters
        headers = [*_JSON, *served_headers(response)]
        return 200, headers, kserve_v1.encode_predictions(response)

    async def _model_status_v1(self, request: HttpRequest) -> Reply:
        name = request.params["model"]
        ready = self.dataplane.model_ready(name)
        return 200, _JSON, orjson.dumps({"name": name, "ready": ready})

    # --- jobs -------------------------------------------------------------------------------

    def _jobs(self) -> jobs.JobsApi:
        if self.jobs is None:
            raise JobNotFound("this worker runs no jobs")
        return self.jobs

    async def _submit_job(self, request: HttpRequest) -> Reply:
        header_length = _header_length(request.header(b"inference-header-content-length"))
        return await jobs.submit(self._jobs(), request, "v2", header_length)

    async def _submit_job_v1(self, request: HttpRequest) -> Reply:
        return await jobs.submit(self._jobs(), request, "v1", None)

    async def _get_job(self, request: HttpRequest) -> Reply:
        return await jobs.get(self._jobs(), request)

    async def _cancel_job(self, request: HttpRequest) -> Reply:
        return await jobs.cancel(self._jobs(), request)

    async def _list_jobs(self, request: HttpRequest) -> Reply:
        return await jobs.listing(self._jobs(), request)

    # --- repository (admin) -----------------------------------------------------------------

    async def _repository_index(self, request: HttpRequest) -> Reply:
        options = await request.json()
        if not isinstance(options, dict):
            raise InvalidInput('body must be an object: {"ready": true} or {}')
        ready_only = options.get("ready", False)
        if not isinstance(ready_only, bool):
            raise InvalidInput(f"'ready' must be true or false, got {shown(ready_only)}")
        index = self.dataplane.repository_index(ready_only=ready_only)
        return 200, _JSON, orjson.dumps(index)

    async def _load_model(self, request: HttpRequest) -> Reply:
        await request.body()
        await self.dataplane.load_model(request.params["model"])
        return 200, _JSON, b"{}"

    async def _unload_model(self, request: HttpRequest) -> Reply:
        await request.body()
        await self.dataplane.unload_model(request.params["model"])
        return 200, _JSON, b"{}"

    async def _invalidate(self, request: HttpRequest) -> Reply:
        options = await request.json()
        if not isinstance(options, dict):
            raise InvalidInput(
                'body must be an object: {"model": ..., "version": ...} or {"prefix": ...}'
            )
        unknown = sorted(set(options) - {"model", "version", "prefix"})
        if unknown:
            raise InvalidInput(f"unknown field {shown(unknown[0])} (known: model, version, prefix)")
        for name, value in options.items():  # (null is no way to leave a field out)
            whole = type(value) is int and value >= 0
            if name == "version" and not (isinstance(value, str) or whole):
                raise InvalidInput(
                    f"field 'version' must be a whole number (0 or more) or a string, "
                    f"got {shown(value)}"
                )
            if name != "version" and not isinstance(value, str):
                raise InvalidInput(f"field {name!r} must be a string, got {shown(value)}")
        report = await self.dataplane.invalidate(
            options.get("model"), options.get("version"), options.get("prefix")
        )
        return 200, _JSON, orjson.dumps(report)

    # --- operations -------------------------------------------------------------------------

    async def _metrics(self, request: HttpRequest) -> Reply:
        # OpenMetrics (with the latency histograms' exemplars) when the scraper asks for it.
        if b"application/openmetrics-text" in (request.header(b"accept") or b""):
            return 200, [(b"content-type", OPENMETRICS_TYPE)], self.metrics.render(openmetrics=True)
        return 200, [(b"content-type", METRICS_CONTENT_TYPE.encode())], self.metrics.render()

    async def _openapi(self, request: HttpRequest) -> Reply:
        return 200, _JSON, self._openapi_body


def _header_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidInput(
            f"Inference-Header-Content-Length must be a whole number of bytes, got {shown(value)}"
        ) from None


def _error(message: str) -> bytes:
    return orjson.dumps({"error": message})


def _refusal(exc: TailserveError) -> Reply:
    reason = refusal_reason(exc)
    if reason is None:
        return status_of(exc), [*_JSON, *headers_of(exc)], _error(exc.message)
    headers = [*_JSON, *headers_of(exc), (b"x-refusal-reason", reason.encode())]
    return status_of(exc), headers, orjson.dumps({"error": exc.message, "reason": reason})
