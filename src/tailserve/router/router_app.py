"""The router as an `Application` of the one HTTP server (transport/server.py).

A request comes read whole. The router answers itself, at once, ``/v2/health/live``,
``/v2/health/ready`` (ready while any backend is in service and the router is not draining),
``/metrics`` (its own metrics) and ``/router/backends`` (each backend's state, as JSON). The
rest goes to the `Dispatcher` by its path (`classify`): inference (OIP v2
``/v2/models/{m}[/versions/{v}]/infer``, binary included, and KServe v1
``/v1/models/{m}:predict``) to the model's pool, where it may be hedged and retried; model
metadata, readiness, stats and config to the model's pool too; ``/v2/repository/models/{m}/
load|unload`` to every backend; anything else to any one backend (a worker's own 404 answers
a path it does not know).

Every reply from a backend names the replica that answered in ``x-tailserve-replica`` (and
``x-tailserve-hedged: 1`` when a hedge won). Hop-by-hop headers are not forwarded either way.
A client that hangs up cancels its request's task, which withdraws every copy of the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

import orjson

from tailserve.observability.tracing import Tracing
from tailserve.router.attempt_spans import TraceParent
from tailserve.router.dispatch import Dispatcher
from tailserve.router.keys import body_key, cost_class
from tailserve.router.messages import Framer, Outcome
from tailserve.router.route_spans import FRONTDOOR_HEADER, end_route, start_route
from tailserve.router.router_metrics import CONTENT_TYPE
from tailserve.router.upstreams import ANY
from tailserve.transport.request import HttpRequest
from tailserve.transport.server import Headers, Reply

# Not forwarded either way: they describe one connection, not the request (RFC 9110 7.6.1),
# or the router sets them itself.
_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"trailer",
        b"content-length",
        b"expect",
        b"x-deadline-ms",
    )
)
_TRACED_HOP = _HOP | {FRONTDOOR_HEADER}
_REPLY_HOP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server")
)
_JSON: Headers = [(b"content-type", b"application/json")]
# The metric label of the replies the router gives itself.
_LOCAL = "_router"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request goes: the model (or `ANY`), and whether it is an inference."""

    model: str
    infer: bool = False
    broadcast: bool = False


def classify(method: str, path: str) -> Target:
    """Which pool a path's request belongs to (``path`` as sent, its escapes kept)."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[0] == "v2" and parts[1] == "models" and parts[2] != "stats":
        return Target(unquote(parts[2]), infer=method == "POST" and parts[-1] == "infer")
    if len(parts) >= 3 and parts[0] == "v1" and parts[1] == "models":
        name, _, verb = parts[2].partition(":")
        return Target(unquote(name), infer=method == "POST" and verb == "predict")
    if (
        len(parts) == 5
        and parts[:3] == ["v2", "repository", "models"]
        and parts[4] in ("load", "unload")
    ):
        return Target(unquote(parts[3]), broadcast=True)
    return Target(ANY)


class RouterApp:
    """Local routes answered at once; the rest sent on by the dispatcher, in a task."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        ready: Callable[[], bool],
        tracing: Tracing | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.metrics = dispatcher.metrics
        self._ready = ready
        # OpenTelemetry (router/route_spans.py): None unless tracing is on.
        self.tracing = tracing

    def answer_now(self, request: HttpRequest) -> Reply | None:
        path = _raw_path(request)
        if request.method in ("GET", "HEAD"):
            local = self._local(path)
            if local is not None:
                self._count(request, _LOCAL, local[0])
                return local
        request.route = classify(request.method, path)
        return None

    async def answer(self, request: HttpRequest) -> Reply:
        target: Target = request.route
        model = target.model
        # (Only models some backend lists become metric labels: a client cannot grow the
        # label set by inventing model names.)
        known = model != ANY and model in self.dispatcher.known_models()
        status = 500
        outcome = None
        span = trace = None
        if self.tracing is not None:
            span, trace = start_route(self.tracing, request, model if known else "_other")
        try:
            if target.broadcast:
                outcome = await self._broadcast(request)
            else:
                outcome = await self._forward(request, target, trace)
            status = outcome.status
            return status, _reply_headers(outcome), outcome.body
        except asyncio.CancelledError:  # the client hung up: its copies are withdrawn
            status = 499
            raise
        finally:
            self._count(request, model if known else "_other", status)
            if span is not None and self.tracing is not None:
                end_route(self.tracing, span, status, outcome)

    def _count(self, request: HttpRequest, label: str, status: int) -> None:
        self.metrics.requests.inc(label, str(status))
        self.metrics.latency.child(label).observe(time.monotonic() - request.received_at)

    def _local(self, path: str) -> Reply | None:
        if path == "/v2/health/live":
            return 200, [], b""
        if path == "/v2/health/ready":
            if self._ready():
                return 200, [], b""
            return 503, _JSON, orjson.dumps({"error": "no backend is in service"})
        if path == "/metrics":
            return 200, [(b"content-type", CONTENT_TYPE.encode())], self.metrics.render()
        if path == "/router/backends":
            return 200, _JSON, orjson.dumps(backends_state(self.dispatcher))
        return None

    async def _forward(
        self, request: HttpRequest, target: Target, trace: TraceParent | None = None
    ) -> Outcome:
        dispatcher = self.dispatcher
        key = None
        if target.infer and dispatcher.wants_key(target.model):
            given = request.header(b"x-affinity-key")
            if given:
                key = given.decode("latin-1")
            else:
                key = body_key(request.raw_body, _binary_header_length(request))
        # Traced here, the front door's stamp becomes the lane's span, not the worker's.
        return await dispatcher.request(
            target.model,
            framer(request, _TRACED_HOP if trace is not None else _HOP),
            key=key,
            cost=cost_class(len(request.raw_body)),
            deadline_s=deadline_of(request),
            idempotent=request.method in ("GET", "HEAD"),
            hedge=target.infer,
            trace=trace,
        )

    async def _broadcast(self, request: HttpRequest) -> Outcome:
        """Repository load/unload: every backend does it; the worst answer is the reply."""
        d = self.dispatcher
        data = framer(request)(None)
        upstreams = list(d.upstreams.values())
        if not upstreams:
            return Outcome(503, _JSON, orjson.dumps({"error": "no backends"}))
        replies = await asyncio.gather(
            *(u.pool.request(data, d.config.request_timeout_s) for u in upstreams),
            return_exceptions=True,
        )
        worst = Outcome(200, _JSON, b"{}")
        errors = {}
        for upstream, reply in zip(upstreams, replies, strict=True):
            if isinstance(reply, BaseException):
                errors[upstream.backend.id] = str(reply)
                worst = Outcome(502, _JSON, b"")
            elif reply.status != 200:
                errors[upstream.backend.id] = reply.body.decode(errors="replace")
                if reply.status > worst.status:
                    worst = Outcome(reply.status, _JSON, b"")
        if errors:
            path = _raw_path(request)
            worst.body = orjson.dumps(
                {"error": f"{path} failed on some backends", "backends": errors}
            )
        return worst


def backends_state(d: Dispatcher) -> dict[str, object]:
    """Each backend's routing state and the budgets' counters (``/router/backends``)."""
    now = d.loop.time()
    return {
        "backends": [
            {
                "id": u.backend.id,
                "in_flight": u.backend.in_flight,
                "ewma_ms": None
                if u.backend.latency_s is None
                else round(u.backend.latency_s * 1e3, 3),
                "healthy": u.backend.healthy,
                "ejected": u.backend.is_ejected(now),
                "ejections": u.backend.ejections,
                # The share of its recent requests that a hedge elsewhere beat.
                "overtaken": round(u.backend.overtaken, 4),
                # What outlier ejection judges it on: its recent first copies, and those a
                # hedge beat.
                "first_copies": u.backend.first_copies,
                "first_losses": u.backend.first_losses,
                "models": None if u.models is None else sorted(u.models),
            }
            for u in d.upstreams.values()
        ],
        "hedges": {
            "requests": d.hedge_budget.requests,
            "sent": d.hedge_budget.spent,
            # Refused: found the budget empty when due (each then waits for a token); late:
            # sent once one came; waiting: queued for one now.
            "refused": d.hedge_budget.refused,
            "late": d.late_hedges,
            "suspect": d.suspect_hedges,
            "waiting": d.hedges_waiting,
            # The delay after which each model and cost class hedges now (None: too few
            # replies known yet).
            "delays_ms": {
                f"{model}/{cost}": None if delay is None else round(delay * 1e3, 3)
                for (model, cost), policy in d.hedge_policies().items()
                for delay in (policy.delay_s(now),)
            },
        },
        "retries": {"sent": d.retry_budget.spent, "refused": d.retry_budget.refused},
    }


def _raw_path(request: HttpRequest) -> str:
    return request.target.split(b"?", 1)[0].decode("latin-1")


def _reply_headers(outcome: Outcome) -> Headers:
    headers = [(name, value) for name, value in outcome.headers if name.lower() not in _REPLY_HOP]
    if outcome.backend is not None:
        headers.append((b"x-tailserve-replica", outcome.backend.encode()))
        if outcome.hedged:
            headers.append((b"x-tailserve-hedged", b"1"))
    return headers


def deadline_of(request: HttpRequest) -> float | None:
    """The request's own budget (``X-Deadline-Ms``), in seconds; None when it gives none (or
    one that is not a positive number: the worker names the problem)."""
    raw = request.header(b"x-deadline-ms")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value / 1e3 if value > 0 else None


def framer(request: HttpRequest, hop: frozenset[bytes] = _HOP) -> Framer:
    """The request's bytes for a backend, given what is left of its deadline (or None);
    ``hop``: the headers not sent on."""
    # HEAD goes upstream as GET (our response parser expects a body where a length is
    # given); the server drops the body from the reply to the client again.
    method = b"GET" if request.method == "HEAD" else request.method.encode("latin-1")
    lines = [method + b" " + request.target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in request.headers if name not in hop]
    body = request.raw_body
    if body or request.method in ("POST", "PUT", "PATCH"):
        lines.append(b"content-length: %d" % len(body))
    head = b"\r\n".join(lines)
    raw_deadline = request.header(b"x-deadline-ms")

    def frame(remaining_s: float | None) -> bytes:
        if remaining_s is None:
            if raw_deadline is not None:  # not a number: the worker names the problem
                return head + b"\r\nx-deadline-ms: " + raw_deadline + b"\r\n\r\n" + body
            return head + b"\r\n\r\n" + body
        remaining_ms = max(remaining_s * 1e3, 0.001)
        return head + b"\r\nx-deadline-ms: %.3f\r\n\r\n" % remaining_ms + body

    return frame


def _binary_header_length(request: HttpRequest) -> int | None:
    """The JSON header's length of a body in the binary tensor extension (None: all JSON)."""
    value = request.header(b"inference-header-content-length")
    return int(value) if value is not None and value.isdigit() else None
