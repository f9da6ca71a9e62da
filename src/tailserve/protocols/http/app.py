"""The worker's HTTP surface as a bare ASGI application.

No web framework sits on the hot path: a route table lookup, a bounded body read, a codec and a
call into the data plane. (benchmarks/http_overhead.py measures what this costs over a bare ASGI
handler.) Handlers return ``(status, headers, body)``; errors from the data plane become
``{"error": "..."}`` with the status `errors.status_of` gives.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import random
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from tailserve.engine.dataplane import DataPlane
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import InvalidInput, PayloadTooLarge, TailserveError, Unauthorized
from tailserve.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tailserve.observability.metrics import Metrics
from tailserve.observability.trace_log import TraceRecorder
from tailserve.protocols.http import kserve_v1, oip
from tailserve.protocols.http.errors import headers_of, status_of
from tailserve.protocols.http.openapi import openapi_document
from tailserve.protocols.http.routes import Router
from tailserve.protocols.http.timing import DISCONNECTED, RECEIVED

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
Reply = tuple[int, Headers, bytes]

_JSON: Headers = [(b"content-type", b"application/json")]
# An inference body up to this size with no X-Deadline-Ms is read before the early refusal, to
# see whether it names a `timeout` (larger ones are refused, when they are, on the SLO).
_PEEK_BYTES = 64 * 1024
_TIMEOUT = b'"timeout"'


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class HttpRequest:
    __slots__ = ("_receive", "_scope", "max_body_bytes", "params", "received_at")

    def __init__(
        self, scope: Scope, receive: Receive, params: dict[str, str], max_body_bytes: int
    ) -> None:
        self._scope = scope
        self._receive = receive
        self.params = params
        self.max_body_bytes = max_body_bytes
        # Deadlines count from here: when the server began to read the request (or, under
        # another server than ours, now); the clock is the scheduler's (time.monotonic).
        self.received_at: float = scope.get(RECEIVED) or time.monotonic()

    @property
    def method(self) -> str:
        method: str = self._scope["method"]
        return method

    @property
    def path(self) -> str:
        path: str = self._scope["path"]
        return path

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = self._scope["headers"]
        return headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self._scope["headers"]:
            if key == name:
                return bytes(value)
        return None

    async def body(self) -> bytes:
        """The whole body, refused with 413 as soon as it passes the limit; decompressed."""
        limit = self.max_body_bytes
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(
                f"request body of {int(declared)} bytes is over the {limit}-byte limit"
            )
        chunks = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = self.header(b"content-encoding")
        if encoding is not None and encoding not in (b"identity", b""):
            body = _decompress(encoding, body, limit)
        return body

    async def json(self) -> Any:
        body = await self.body()
        if not body:
            return {}
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None


def _decompress(encoding: bytes, body: bytes, limit: int) -> bytes:
    # "deflate" on the wire is zlib-wrapped; gzip has its own header. Both capped at the limit.
    wbits = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise InvalidInput(f"unsupported Content-Encoding {encoding.decode(errors='replace')!r}")
    name = encoding.decode(errors="replace")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
        # gzip may hold several members one after another (RFC 1952): each is read in turn.
        while (
            wbits != zlib.MAX_WBITS and inflater.eof and inflater.unused_data and len(out) <= limit
        ):
            rest = inflater.unused_data
            inflater = zlib.decompressobj(wbits)
            out += inflater.decompress(rest, limit + 1 - len(out))
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {name} data: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLarge(f"decompressed request body is over the {limit}-byte limit")
    if not inflater.eof:
        raise InvalidInput(f"request body is not valid {name} data: it is cut short")
    if inflater.unused_data:
        raise InvalidInput(f"request body is not valid {name} data: bytes follow its end")
    return out


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
        max_body_bytes: int = 64 * 1024 * 1024,
        admin_token: str | None = None,
        lifespan: Callable[[Receive, Send], Awaitable[None]] | None = None,
        recorder: TraceRecorder | None = None,
        slow_fault: SlowFault | None = None,
    ) -> None:
        self.dataplane = dataplane
        self._slow_fault = slow_fault
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self._admin = f"Bearer {admin_token}".encode() if admin_token else None
        self._lifespan = lifespan
        self._recorder = recorder
        self._router = Router()
        self._openapi_body = orjson.dumps(openapi_document())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan" and self._lifespan is not None:
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        route, params, path_known = self._router.match(scope["method"], scope["path"])
        if route is None:
            status = 405 if path_known else 404
            what = "method not allowed" if path_known else "no such route"
            await _send(send, status, _JSON, _error(f"{what}: {scope['method']} {scope['path']}"))
            return
        request = HttpRequest(scope, receive, params, self.max_body_bytes)
        try:
            if route.admin:
                self._authorize(request)
            status, headers, body = await getattr(self, "_" + route.handler)(request)
            if self._slow_fault is not None and route.protocol is not None:
                await self._slow_fault.delay(time.perf_counter() - started)
        except ClientGone:
            return
        except asyncio.CancelledError:
            if not scope.get(DISCONNECTED):
                raise
            # The client hung up (the loser of a hedge, a caller that gave up): its queued
            # work is dropped and nobody is left to answer. 499 as nginx counts it.
            if route.protocol is not None:
                model = params.get("model", "")
                label = model if self.dataplane.knows(model) else "_unknown"
                self.metrics.on_request(label, route.protocol, 499, time.perf_counter() - started)
            return
        except TailserveError as exc:
            status, headers, body = status_of(exc), [*_JSON, *headers_of(exc)], _error(exc.message)
        except Exception as exc:
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            status, headers, body = 500, _JSON, _error(f"internal error: {type(exc).__name__}")
        await _send(send, status, headers, body)
        if route.protocol is not None:
            model = params.get("model", "")
            label = model if self.dataplane.knows(model) else "_unknown"
            self.metrics.on_request(label, route.protocol, status, time.perf_counter() - started)

    def _authorize(self, request: HttpRequest) -> None:
        if self._admin is None:
            return
        given = request.header(b"authorization") or b""
        if not hmac.compare_digest(given, self._admin):
            raise Unauthorized("this admin route needs 'Authorization: Bearer <token>'")

    def _shed(self, request: HttpRequest, model: str, version: str | None) -> None:
        """Refuse before reading the body when the model is too busy for the deadline."""
        deadline = request.header(b"x-deadline-ms")
        deadline_ms = None
        if deadline is not None:
            try:
                deadline_ms = float(deadline)
            except ValueError:
                return  # reading the request will say what is wrong with it
            if not deadline_ms > 0:
                return
        self.dataplane.shed(model, version, request.received_at, deadline_ms)

    async def _shed_then_read(self, request: HttpRequest, model: str, version: str | None) -> bytes:
        """An inference request's body, once its model is known not to be too busy for it.

        Refused before the body is read when it is, for the header's deadline or else the
        model's SLO. A ``timeout`` parameter in the body may be looser than the SLO (the tighter
        of it and the header wins): a small body with no header is read first, and one that
        names a timeout is left to admission, which sees its real deadline."""
        length = request.header(b"content-length")
        small = length is not None and length.isdigit() and int(length) <= _PEEK_BYTES
        if request.header(b"x-deadline-ms") is not None or not small:
            self._shed(request, model, version)
            return await self._read_traced(request)
        body = await self._read_traced(request)
        header = _header_length(request.header(b"inference-header-content-length"))
        if _TIMEOUT not in (body if header is None else body[:header]):
            self._shed(request, model, version)
        return body

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

    async def _read_traced(self, request: HttpRequest) -> bytes:
        body = await request.body()
        if self._recorder is not None:
            self._recorder.record(request.method, request.path, request.headers, body)
        return body

    async def _infer(self, request: HttpRequest) -> Reply:
        p = request.params
        body = await self._shed_then_read(request, p["model"], p.get("version"))
        header_length = _header_length(request.header(b"inference-header-content-length"))
        infer_request = oip.decode_request(p["model"], p.get("version"), body, header_length)
        _request_options(request, infer_request)
        response = await self.dataplane.infer(infer_request)
        payload, headers = oip.encode_response(infer_request, response)
        return 200, [*headers, *_served_headers(response)], payload

    async def _predict_v1(self, request: HttpRequest) -> Reply:
        name = request.params["model"]
        self._shed(request, name, None)
        config = self.dataplane.manager.get(name).config
        infer_request = kserve_v1.decode_records(name, config, await self._read_traced(request))
        _request_options(request, infer_request)
        response = await self.dataplane.infer(infer_request)
        headers = [*_JSON, *_served_headers(response)]
        return 200, headers, kserve_v1.encode_predictions(response)

    async def _model_status_v1(self, request: HttpRequest) -> Reply:
        name = request.params["model"]
        ready = self.dataplane.model_ready(name)
        return 200, _JSON, orjson.dumps({"name": name, "ready": ready})

    # --- repository (admin) -----------------------------------------------------------------

    async def _repository_index(self, request: HttpRequest) -> Reply:
        options = await request.json()
        ready_only = bool(options.get("ready", False)) if isinstance(options, dict) else False
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
            raise InvalidInput('body must be an object: {"model": ..., "version": ...} or '
                               '{"prefix": ...}')  # fmt: skip
        unknown = sorted(set(options) - {"model", "version", "prefix"})
        if unknown:
            raise InvalidInput(f"unknown field {unknown[0]!r} (known: model, version, prefix)")
        report = await self.dataplane.invalidate(
            options.get("model"), options.get("version"), options.get("prefix")
        )
        return 200, _JSON, orjson.dumps(report)

    # --- operations -------------------------------------------------------------------------

    async def _metrics(self, request: HttpRequest) -> Reply:
        return 200, [(b"content-type", METRICS_CONTENT_TYPE.encode())], self.metrics.render()

    async def _openapi(self, request: HttpRequest) -> Reply:
        return 200, _JSON, self._openapi_body


def _request_options(request: HttpRequest, infer: InferRequest) -> None:
    """Arrival time, and the deadline and priority headers, onto the engine's request."""
    infer.received_at = request.received_at
    deadline = request.header(b"x-deadline-ms")
    if deadline is not None:
        try:
            infer.deadline_ms = float(deadline)
        except ValueError:
            infer.deadline_ms = -1.0
        if not 0 < infer.deadline_ms < math.inf:  # (nan fails both)
            raise InvalidInput(f"X-Deadline-Ms must be a positive number of ms, got {deadline!r}")
    mode = request.header(b"x-cache-mode")
    if mode is not None:
        infer.cache_mode = mode.decode(errors="replace")
    priority = request.header(b"x-priority")
    if priority is not None:
        if not priority.isdigit():
            raise InvalidInput(f"X-Priority must be a whole number, got {priority!r}")
        infer.priority = int(priority)


def _served_headers(response: InferResponse) -> Headers:
    """How the request was served, as headers (v2 carries it in `parameters` as well)."""
    params = response.parameters
    return [
        (b"x-model-version", response.version.encode()),
        (b"x-queue-us", str(params["queue_us"]).encode()),
        (b"x-compute-us", str(params["compute_us"]).encode()),
        (b"x-batch-size", str(params["batch_size"]).encode()),
        (b"x-cost-class", str(params["cost_class"]).encode()),
        *([(b"x-cache", params["cache"].encode())] if "cache" in params else []),
    ]


def _header_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidInput(
            f"Inference-Header-Content-Length must be a whole number, got {value!r}"
        ) from None


def _error(message: str) -> bytes:
    return orjson.dumps({"error": message})


async def _send(send: Send, status: int, headers: Headers, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
