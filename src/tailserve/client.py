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

With ``edge_cache=EdgeCache(...)`` the answers of cached models are also kept in this process
for a short TTL (``cache/edge.py``), dropped by the workers' invalidations heard on Redis
(``cache/invalidations.py``); identical requests in flight at once go out once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from tailserve.cache.edge import EdgeCache, EdgeStore, Kept, prefix_for
from tailserve.cache.invalidations import InvalidationFeed
from tailserve.cache.redis import connect, parse_url
from tailserve.errors import TailserveError
from tailserve.observability.tracing import Tracing
from tailserve.router.attempt_spans import TraceParent
from tailserve.router.config import RouterConfig, backend_url, parse_backend
from tailserve.router.dispatch import Dispatcher
from tailserve.router.keys import body_key, cost_class
from tailserve.router.messages import Outcome, error_message, request_framer
from tailserve.router.upstreams import ANY
from tailserve.tensors import datatype_of, from_json, to_json_data

__all__ = ["Client", "EdgeCache", "InferResult", "InferenceError"]

# How the edge tier took part in an answer: ``hit`` (answered from it), ``coalesced`` (shared
# the reply of an identical request in flight), ``miss`` / ``refresh`` (a worker's, now kept).
EdgeSource = Literal["hit", "coalesced", "miss", "refresh"]


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
    # The edge tier's part (None: not a model it caches, or the request bypassed it).
    edge: EdgeSource | None = None
    # The trace the worker recorded the request in (its x-trace-id), when it was sampled.
    trace_id: str | None = None


@dataclass(frozen=True, slots=True)
class _Request:
    model: str
    inputs: Mapping[str, Any]
    outputs: Sequence[str] | None
    version: str | int | None
    parameters: Mapping[str, Any] | None
    deadline_ms: float | None
    affinity_key: str | None


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
        edge_cache: EdgeCache | None = None,
        tracer_provider: Any = None,
    ) -> None:
        """``tracer_provider``: OpenTelemetry's, for the attempts' client spans (default: the
        global one, when opentelemetry-api is installed). Each attempt carries a
        ``traceparent`` naming its span, under the caller's current span."""
        if not backends:
            raise ValueError("a Client needs at least one backend URL")
        if edge_cache is not None and edge_cache.redis_url is not None:
            parse_url(edge_cache.redis_url)  # a bad URL fails here, not in the background
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
        self._recheck: asyncio.Task[None] | None = None
        self._edge = EdgeStore(edge_cache) if edge_cache is not None else None
        self._feed: InvalidationFeed | None = None
        self._flights: dict[tuple[str, str, str], asyncio.Future[Kept | InferenceError | None]] = {}
        self._tracing = _client_tracing(tracer_provider)

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
        edge = self._edge
        if edge is not None and edge.config.redis_url is not None:
            url, _ = parse_url(edge.config.redis_url)
            # A plain connection even to a cluster: every node hears every PUBLISH. Each
            # (re)subscription drops the edge, as a worker's does its L1: events were missed.
            self._feed = InvalidationFeed(
                lambda: connect(url, timeout_s=1.0, socket_timeout=None),
                edge.invalidate,
                edge.clear,
            )
            self._feed.start()

    async def close(self) -> None:
        if self._feed is not None:
            await self._feed.close()
        for task in (self._health, self._recheck):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
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
        request = _Request(model, inputs, outputs, version, parameters, deadline_ms, affinity_key)
        edge = self._edge
        mode = (parameters or {}).get("cache", "use")
        if edge is None or mode not in ("use", "refresh"):
            return await self._infer(request)
        if not edge.caches(model):
            return await self._learn(edge, request, "refresh" if mode == "refresh" else "miss")
        digest = edge.digest(model, inputs, outputs, parameters)
        if digest is None:
            return await self._infer(request)
        if mode == "refresh":
            return await self._fetch(edge, request, digest, "refresh")
        return await self._edge_infer(edge, request, digest)

    async def _infer(self, request: _Request) -> InferResult:
        body = encode_request(request.inputs, request.outputs, request.parameters)
        model, version = request.model, request.version
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "")
        headers = [("content-type", "application/json")]
        key = None
        if self.dispatcher.wants_key(model):
            key = request.affinity_key if request.affinity_key is not None else body_key(body)
        cost = cost_class(len(body))
        send = functools.partial(
            self._send,
            model,
            "POST",
            f"{path}/infer",
            body,
            headers,
            key=key,
            cost=cost,
            hedge=True,
        )
        outcome = await self._again(send, request)
        if outcome.status != 200:
            raise InferenceError(outcome.status, error_message(outcome.body), outcome.backend)
        return decode_response(outcome)

    async def _again(self, send: Callable[..., Awaitable[Outcome]], request: _Request) -> Outcome:
        """``send`` an inference, and again while its answer is one a later try may change:
        nothing could be reached (a front door restarting, no replica in service) or the fleet
        was full for a moment (503 with Retry-After, 429), after a pause that doubles, within
        the request's deadline (else the client's timeout). Through a front door, the client's
        one backend, the dispatcher has no other replica to retry on: the retries are here."""
        loop = asyncio.get_running_loop()
        wait_s = self.config.request_timeout_s
        until = loop.time() + (wait_s if request.deadline_ms is None else request.deadline_ms / 1e3)
        pause = RETRY_PAUSE_S
        while True:
            left_ms = None if request.deadline_ms is None else (until - loop.time()) * 1e3
            outcome = await send(deadline_ms=left_ms)
            reached = outcome.reason not in ("no_replica", "upstream")
            if not _worth_again(outcome) or loop.time() + pause >= until:
                return outcome
            # A refusal is retried within the retry budget, not to feed an overload.
            if reached and not self.dispatcher.retry_budget.try_spend():
                return outcome
            if outcome.reason == "no_replica" and (self._recheck is None or self._recheck.done()):
                # Taken out by its checks: look again now rather than at the next round.
                self._recheck = loop.create_task(self.dispatcher.check_all())
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_PAUSE_MAX_S)

    # --- the edge tier ----------------------------------------------------------------------

    async def _edge_infer(self, edge: EdgeStore, request: _Request, digest: str) -> InferResult:
        """A cached model's request: the edge's answer, an identical request's in flight, or
        a worker's (then kept)."""
        loop = asyncio.get_running_loop()
        until = None if request.deadline_ms is None else loop.time() + request.deadline_ms / 1e3
        flight = (request.model, str(request.version), digest)
        while True:
            kept = edge.lookup(edge.key(request.model, request.version, digest))
            if kept is not None:
                return _answer(kept, "hit")
            leader = self._flights.get(flight) if edge.config.coalesce else None
            if leader is None:
                break
            try:
                timeout = None if until is None else max(0.0, until - loop.time())
                shared = await asyncio.wait_for(asyncio.shield(leader), timeout)
            except TimeoutError:
                raise InferenceError(
                    504, "deadline passed waiting for an identical request in flight"
                ) from None
            if isinstance(shared, InferenceError):
                raise InferenceError(shared.status, shared.message, shared.replica)
            if shared is not None:
                edge.coalesced += 1
                return _answer(shared, "coalesced")
            # The first gave up for reasons of its own (cancelled, its deadline): look again.
        if not edge.config.coalesce:
            return await self._fetch(edge, request, digest, "miss")
        future: asyncio.Future[Kept | InferenceError | None] = loop.create_future()
        self._flights[flight] = future
        shared = None
        try:
            result = await self._fetch(edge, request, digest, "miss")
            shared = _kept(result)
            return result
        except InferenceError as exc:
            # Followers with a deadline of their own wait for it, not for the first's.
            shared = None if exc.status == 504 else exc
            raise
        finally:
            if self._flights.get(flight) is future:
                del self._flights[flight]
            future.set_result(shared)

    async def _fetch(
        self, edge: EdgeStore, request: _Request, digest: str, how: EdgeSource
    ) -> InferResult:
        stamp = edge.stamp(request.model)
        result = await self._infer(request)
        edge.learn(request.model, result.parameters, pinned=request.version is not None)
        _freeze(result.outputs)
        edge.keep(request.model, digest, _kept(result), stamp)
        result.edge = how
        return result

    async def _learn(self, edge: EdgeStore, request: _Request, how: EdgeSource) -> InferResult:
        """A model not (yet) cached here: its reply may say its workers cache it."""
        stamp = edge.stamp(request.model)
        result = await self._infer(request)
        pinned = request.version is not None
        if edge.learn(request.model, result.parameters, pinned=pinned):
            inputs, outputs = request.inputs, request.outputs
            digest = edge.digest(request.model, inputs, outputs, request.parameters)
            if digest is not None:
                _freeze(result.outputs)
                edge.keep(request.model, digest, _kept(result), stamp)
                result.edge = how
        return result

    @property
    def edge(self) -> EdgeStore | None:
        """The edge tier (its entries and counters), when the client has one."""
        return self._edge

    @property
    def edge_subscribed(self) -> bool:
        """Whether the edge tier hears the workers' invalidations now."""
        return self._feed is not None and self._feed.subscribed.is_set()

    def invalidate_edge(
        self,
        model: str | None = None,
        version: str | int | None = None,
        *,
        prefix: str | None = None,
    ) -> int:
        """Drop this process's edge entries of a model, a version of it, a key prefix, or
        (nothing named) all; how many. The workers' caches are untouched: for those, POST
        ``/v2/cache/invalidate`` (through `request`, which applies its answer here too)."""
        if self._edge is None:
            return 0
        if prefix is not None and (model is not None or version is not None):
            raise ValueError("give either a key prefix or a model (and version)")
        return self._edge.invalidate(prefix if prefix is not None else prefix_for(model, version))

    async def request(
        self, method: str, path: str, body: bytes = b"", *, model: str = ANY
    ) -> Outcome:
        """Any other route (metadata, readiness, stats), to a replica of ``model``. An
        invalidation (``POST /v2/cache/invalidate``) a worker accepts drops the edge's entries
        under its prefix at once, without waiting for the channel."""
        outcome = await self._send(model, method, path, body, [], idempotent=method == "GET")
        if (
            self._edge is not None
            and outcome.status == 200
            and method == "POST"
            and path.partition("?")[0] == "/v2/cache/invalidate"
        ):
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                prefix = orjson.loads(outcome.body).get("prefix")
                if isinstance(prefix, str):
                    self._edge.invalidate(prefix)
        return outcome

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
        trace = None
        if self._tracing is not None:
            trace = TraceParent(self._tracing, self._tracing.current())
        return await self.dispatcher.request(
            model, frame, deadline_s=deadline_s, trace=trace, **options
        )


# An inference sent again (_again) waits this long first, twice as long each time after.
RETRY_PAUSE_S = 0.025
RETRY_PAUSE_MAX_S = 0.5


def _worth_again(outcome: Outcome) -> bool:
    """Whether a later try of an inference (idempotent) may be answered otherwise: no replica
    in service, a connection that failed or was lost (502 after the dispatcher's own tries),
    a front door with every queue full or no worker ready (503 + Retry-After), a worker that
    could not fit it in time (429)."""
    if outcome.reason == "no_replica":
        return True
    if outcome.reason == "upstream":
        return outcome.status == 502
    if outcome.status == 503:
        return any(name.lower() == b"retry-after" for name, _ in outcome.headers)
    return outcome.status == 429


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
        arrays,
        outcome.backend,
        outcome.hedged,
        reply.get("parameters") or {},
        headers,
        trace_id=headers.get("x-trace-id"),
    )


def _client_tracing(provider: Any) -> Tracing | None:
    """The client's tracing: OpenTelemetry's given or global provider; None without it."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    chosen = provider if provider is not None else trace.get_tracer_provider()
    return Tracing(chosen, "tailserve-client", own_provider=False)


def _freeze(outputs: Mapping[str, np.ndarray[Any, Any]]) -> None:
    # A kept answer's arrays go to every caller it answers: none may change them in place.
    for array in outputs.values():
        array.flags.writeable = False


def _kept(result: InferResult) -> Kept:
    return Kept(dict(result.outputs), result.replica, dict(result.parameters), dict(result.headers))


def _answer(kept: Kept, how: EdgeSource) -> InferResult:
    parameters = dict(kept.parameters)
    parameters["cache"] = "edge"
    headers = dict(kept.headers)
    headers["x-cache"] = "edge"
    return InferResult(dict(kept.outputs), kept.replica, False, parameters, headers, how)
