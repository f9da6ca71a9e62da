"""Sending requests to replicas: the part of the router that the proxy and the in-process client
share.

A `Dispatcher` owns the backends (one keep-alive connection pool to each), the pools of
replicas per model, and the policies of `router/`. `dispatch` takes one request, already framed
for the wire, and answers through a callback; on the way it:

1. picks the model's pool (the backends whose model index lists it READY; every backend while
   that is unknown, so an unknown model gets the worker's own 404) and a replica from it by the
   model's policy (affinity, p2c or round-robin), or sheds the request at once with 503 +
   Retry-After when no replica is available (all saturated, or none in service);
2. sends it, with what is left of its deadline in ``X-Deadline-Ms`` when it has one;
3. for an idempotent request, arms a timer at the model's recent p95 (per cost class): if no
   reply has come by then and the hedge budget allows, a copy goes to another replica (the
   least loaded; while the budget is short, the request waits for a token, and gets one
   once it has had no reply for the recent p99: see hedging.py). The first reply wins; the
   other copy is cancelled by closing its connection, which the worker notices and drops the
   queued work;
4. when a copy cannot connect, or its connection dies before a reply, or a worker refuses it
   with 429, tries once more on another replica within the retry budget;
5. reports every attempt to the backend's state (in flight, EWMA latency, failures) and to the
   outlier detector, which ejects a replica that keeps failing or is far slower than the rest.

Membership comes from `set_members` (command line, a watched file, DNS: see membership.py).
Active readiness checks and each backend's model index are refreshed by `run_health`.
Everything runs on one event loop; the per-request path is callbacks, not tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

from tailserve.errors import ConnectFailed, ConnectionLost, UpstreamError
from tailserve.router.backends import Backend, Pool
from tailserve.router.balancing import Balancer, BoundedLoadHash, make_balancer
from tailserve.router.config import RouterConfig, parse_backend
from tailserve.router.health import ActiveHealth, OutlierDetector
from tailserve.router.hedging import HedgeBudget, HedgePolicy, RetryBudget
from tailserve.router.metrics import RouterMetrics
from tailserve.transport import http1
from tailserve.transport.base import ClientPool, Connect, Ticket
from tailserve.transport.http1 import Headers, Response

log = logging.getLogger(__name__)
decisions = logging.getLogger("tailserve.router.decisions")

# The pool of every backend: non-model routes, and models no backend has listed yet.
ANY = "*"
# The model index is read every this many health rounds (and when a backend comes back).
_INDEX_EVERY = 5
# Cost classes by request body size: a large request's latency says nothing about a small
# one's, so each class keeps its own hedge delay.
_CLASS_EDGES = ((4096, "s"), (65536, "m"))
# The most requests waiting for a hedge token; past it, a hedge that finds no token is dropped.
_HEDGE_QUEUE = 1024
# A timeout on a request's own deadline counts against the backend only once it had this many
# times its usual reply time (see Exchange._tells).
TIMEOUT_EVIDENCE = 4.0

Framer = Callable[[float | None], bytes]


def request_framer(
    method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
) -> Framer:
    """The `Framer` of a request made from its parts (the client library's, the gRPC
    front's): the deadline left goes upstream as ``X-Deadline-Ms``."""
    given = list(headers)

    def frame(remaining_s: float | None) -> bytes:
        extra = given
        if remaining_s is not None:
            extra = [*given, ("x-deadline-ms", f"{max(remaining_s * 1e3, 0.001):.3f}")]
        return http1.frame_request(method, path, "tailserve", body, extra)

    return frame


def cost_class(body_size: int) -> str:
    for edge, label in _CLASS_EDGES:
        if body_size < edge:
            return label
    return "l"


def body_key(body: bytes, header_length: int | None = None) -> str:
    """The affinity key of an inference request with no ``X-Affinity-Key``: its OIP
    ``parameters.affinity_key`` if it has one, else a hash of its inputs (JSON header and,
    with the binary extension, the raw data after it), so identical inputs (identical cache
    keys, as a rule) meet the same replica's cache whatever the request's ``id`` or options.
    A body that is not an OIP request is hashed whole."""
    header, data = body, b""
    if header_length is not None and 0 < header_length <= len(body):
        header, data = body[:header_length], body[header_length:]
    try:
        document = orjson.loads(header)
    except orjson.JSONDecodeError:
        document = None
    if not isinstance(document, dict) or "inputs" not in document:
        return hashlib.blake2b(body, digest_size=8).hexdigest()
    parameters = document.get("parameters")
    if isinstance(parameters, dict):
        given = parameters.get("affinity_key")
        if isinstance(given, str | int) and not isinstance(given, bool):
            return str(given)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(orjson.dumps(document["inputs"], option=orjson.OPT_SORT_KEYS))
    digest.update(data)
    return digest.hexdigest()


@dataclass(slots=True)
class Outcome:
    """What a request came to: a reply (the backend's, or the router's own when it shed the
    request or every attempt failed), which replica gave it, and how."""

    status: int
    headers: Headers
    body: bytes
    backend: str | None = None
    hedged: bool = False
    attempts: int = 0
    reason: str | None = None  # why the router answered itself (shed, upstream failure)


class Upstream:
    """One backend: its routing state and its connection pool."""

    __slots__ = ("backend", "leaving", "models", "pool")

    def __init__(self, backend: Backend, pool: ClientPool) -> None:
        self.backend = backend
        self.pool = pool
        # The models it has READY, from its index; None until known (then it serves all).
        self.models: frozenset[str] | None = None
        self.leaving = False


class _Attempt:
    __slots__ = ("exchange", "kind", "sent_at", "ticket", "upstream")

    def __init__(self, exchange: Exchange, upstream: Upstream, kind: str, sent_at: float):
        self.exchange = exchange
        self.upstream = upstream
        self.kind = kind  # first, hedge, retry
        self.sent_at = sent_at
        self.ticket: Ticket | None = None

    def on_result(self, result: Response | UpstreamError) -> None:
        self.exchange._on_result(self, result)


class Exchange:
    """One request's life across its copies. `cancel` withdraws every copy (the client left)."""

    __slots__ = (
        "_d",
        "_policy",
        "_timer",
        "balancer",
        "deadline",
        "done",
        "frame",
        "has_deadline",
        "idempotent",
        "key",
        "live",
        "model",
        "on_done",
        "pool",
        "retried",
        "started",
        "tried",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        model: str,
        pool: Pool,
        balancer: Balancer,
        key: str | None,
        policy: HedgePolicy | None,
        frame: Framer,
        deadline: float,
        has_deadline: bool,
        idempotent: bool,
        on_done: Callable[[Outcome], None],
    ) -> None:
        self._d = dispatcher
        self.model = model
        self.pool = pool
        self.balancer = balancer
        self.key = key
        self._policy = policy
        self.frame = frame
        self.deadline = deadline
        self.has_deadline = has_deadline
        self.idempotent = idempotent
        self.on_done = on_done
        self.live: list[_Attempt] = []
        self.tried: list[Backend] = []
        self.done = False
        self.retried = False
        self._timer: asyncio.TimerHandle | None = None
        self.started = 0.0

    def start(self) -> None:
        d = self._d
        now = self.started = d.loop.time()
        delay = None
        if self._policy is not None:
            delay = self._policy.on_request(now)  # earns a share of a hedge token
            d.release_hedges(now)
        d.retry_budget.earn()
        if not self._send(now, "first"):
            self._shed(now)
            return
        if delay is not None and now + delay < self.deadline and not self.done:
            self._timer = d.loop.call_at(now + delay, self._hedge)

    def cancel(self) -> None:
        """The client is gone: withdraw every copy (each worker sees its connection close)."""
        if self.done and not self.live:
            return
        self.done = True
        self._stop_timer()
        for attempt in self.live:
            self._withdraw(attempt, "cancelled")
        self.live.clear()

    def _send(self, now: float, kind: str) -> bool:
        d = self._d
        gone: list[Backend] = []
        while True:
            exclude = [*self.tried, *gone] if gone else self.tried
            backend = self.balancer.choose(self.pool, self.key, now, exclude, copy=kind != "first")
            if backend is None:
                return False
            upstream = d.upstreams.get(backend.id)
            if upstream is not None:
                break
            # It left the membership since this request's pool was built (a retry or a hedge
            # of a request that began before): choose among the others.
            gone.append(backend)
        remaining = self.deadline - now
        self.tried.append(backend)
        attempt = _Attempt(self, upstream, kind, now)
        self.live.append(attempt)
        self.pool.start(backend)
        if d.decision_sample and d.rng.random() < d.decision_sample:
            d.log_decision(self, backend, kind, now)
        data = self.frame(remaining if self.has_deadline else None)
        attempt.ticket = upstream.pool.submit(data, attempt.on_result, remaining)
        return True

    def _hedge(self) -> None:
        self._timer = None
        d = self._d
        if self.done or not self.live or self._policy is None:
            return
        # Only a rationed budget asks whether the replica is suspect.
        rationed = not self._policy.budget.plenty
        suspect = rationed and self.pool.suspect(self.live[0].upstream.backend)
        if not self._policy.try_hedge(suspect=suspect):
            d.metrics.hedges.inc(self.model, "refused")
            # It waits for a token (hedging.py: rationing); tokens come with new requests,
            # and the queue is looked at again when this one turns overdue.
            d.defer_hedge(self, self._policy.overdue_s(d.loop.time()), suspect=suspect)
            return
        if suspect:
            d.suspect_hedges += 1
            d.metrics.hedges.inc(self.model, "suspect")
        self.send_hedge()

    def awaits_hedge(self, now: float) -> bool:
        """Whether this request, queued for a hedge token, still wants one: unanswered, with
        only its first copy out, and time left."""
        return not self.done and len(self.live) == 1 and now < self.deadline

    def may_hedge_late(self, now: float) -> bool:
        """Whether this queued request may take a token now (hedging.py: rationing)."""
        policy = self._policy
        return policy is not None and policy.may_hedge_late(now - self.started, now)

    def send_hedge(self, *, late: bool = False) -> None:
        """Send the copy its spent token paid for."""
        d = self._d
        assert self._policy is not None
        if self._send(d.loop.time(), "hedge"):
            d.metrics.hedges.inc(self.model, "sent")
            if late:
                d.late_hedges += 1
                d.metrics.hedges.inc(self.model, "late")
        else:
            # No other replica could take it: give the token back, nothing was sent.
            self._policy.budget.refund()

    def _on_result(self, attempt: _Attempt, result: Response | UpstreamError) -> None:
        d = self._d
        now = d.loop.time()
        with contextlib.suppress(ValueError):
            self.live.remove(attempt)
        backend = attempt.upstream.backend
        latency = now - attempt.sent_at
        if isinstance(result, Response):
            status = result.status
            ok = status < 500
            if status == 429:
                self.pool.refused(backend, latency, now=now)
            elif status == 503 or (status == 504 and not self._tells(backend, latency)):
                self.pool.inconclusive(backend, latency, now=now)
            else:
                self.pool.finish(backend, latency, ok=ok, now=now)
            d.metrics.attempts.inc(backend.id, attempt.kind, str(status))
            if ok and self._policy is not None and status < 400:
                self._policy.observe(latency, now)
        elif isinstance(result, ConnectFailed | ConnectionLost):
            self.pool.connect_failed(backend, now=now)
            d.metrics.attempts.inc(backend.id, attempt.kind, "connect_failed")
        else:  # a timeout
            if self._tells(backend, latency):
                self.pool.finish(backend, latency, ok=False, now=now)
            else:
                self.pool.inconclusive(backend, latency, now=now)
            d.metrics.attempts.inc(backend.id, attempt.kind, "timeout")
        d.observe_outcome(self.pool, attempt.upstream, now)
        if self.done:
            return
        if isinstance(result, Response) and result.status != 429:
            self._win(attempt, result)
            return
        if self.live:
            return  # another copy is still out: it may yet answer
        if self._may_retry(result) and self._send(now, "retry"):
            self.retried = True
            d.metrics.retries.inc(self.model)
            return
        if isinstance(result, Response):  # the worker's 429, passed on
            self._win(attempt, result)
            return
        status = 504 if isinstance(result, UpstreamError) and _is_timeout(result) else 502
        self._finish(
            Outcome(
                status,
                _json_headers(),
                _error(result.message),
                attempts=len(self.tried),
                reason="upstream",
            )
        )

    def _tells(self, backend: Backend, latency_s: float) -> bool:
        """Whether a timeout (the router's, or a worker's 504) after ``latency_s`` is evidence
        against the backend: always on the router's own request timeout; on the request's
        deadline, only once the backend had four times its usual reply time (the average of
        its successful replies, or the pool's median while it has none). A deadline shorter
        than any replica answers in says nothing of the one that had the request."""
        if not self.has_deadline:
            return True
        usual = backend.usual_s
        if usual is None:
            known = [b.usual_s for b in self.pool if b.usual_s is not None]
            if not known:
                return False
            usual = statistics.median(known)
        return latency_s >= TIMEOUT_EVIDENCE * usual

    def _may_retry(self, result: Response | UpstreamError) -> bool:
        if self.retried:
            return False
        # A connect that failed sent nothing: safe for any request. A connection lost mid-way
        # or a 429 is retried only for idempotent requests.
        safe = isinstance(result, ConnectFailed) or self.idempotent
        if not safe or (isinstance(result, UpstreamError) and _is_timeout(result)):
            return False
        if self.deadline - self._d.loop.time() <= 0:
            return False
        return self._d.retry_budget.try_spend()

    def _win(self, attempt: _Attempt, response: Response) -> None:
        d = self._d
        if attempt.kind == "hedge":
            d.metrics.hedges.inc(self.model, "won")
        self._note_overtaken(attempt)
        for other in self.live:
            self._withdraw(other, "lost")
        self.live.clear()
        self._finish(
            Outcome(
                response.status,
                response.headers,
                response.body,
                attempt.upstream.backend.id,
                hedged=attempt.kind == "hedge",
                attempts=len(self.tried),
            )
        )

    def _note_overtaken(self, winner: _Attempt) -> None:
        """Whether the first copy's replica was beaten by a hedge (see Pool.suspect)."""
        if winner.kind == "first":
            self.pool.overtaken(winner.upstream.backend, False)
        elif winner.kind == "hedge":
            for other in self.live:
                if other.kind == "first":
                    self.pool.overtaken(other.upstream.backend, True)

    def _withdraw(self, attempt: _Attempt, why: str) -> None:
        if attempt.ticket is not None:
            attempt.ticket.cancel()
        backend = attempt.upstream.backend
        lost_after = self._d.loop.time() - attempt.sent_at if why == "lost" else None
        self.pool.cancelled(backend, lost_after)
        self._d.metrics.attempts.inc(backend.id, attempt.kind, why)
        self._d.settle(attempt.upstream)

    def _shed(self, now: float) -> None:
        serving = self.pool.in_service(now)
        reason = "saturated" if serving else "no_replica"
        what = (
            f"every replica of {self.model!r} is at its in-flight limit"
            if serving
            else f"no replica of {self.model!r} is in service"
        )
        self._d.metrics.shed.inc(self.model, reason)
        headers = [*_json_headers(), (b"retry-after", b"1")]
        self._finish(Outcome(503, headers, _error(what), reason=reason))

    def _finish(self, outcome: Outcome) -> None:
        self.done = True
        self._stop_timer()
        self.on_done(outcome)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _is_timeout(error: UpstreamError) -> bool:
    return not isinstance(error, ConnectFailed | ConnectionLost)


def _json_headers() -> Headers:
    return [(b"content-type", b"application/json")]


def _error(message: str) -> bytes:
    return orjson.dumps({"error": message})


def error_message(body: bytes) -> str:
    """The message of an error reply (its ``error``; else the body's start, as text)."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    return str(error) if error else body.decode(errors="replace")[:200]


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        rng: random.Random | None = None,
        connect: Connect = http1.Pool,
    ) -> None:
        self.config = config
        self.loop = loop or asyncio.get_running_loop()
        # How a backend's connection pool is made (transport/base.py: real or in-process).
        self._connect = connect
        self.rng = rng or random.Random()
        self.decision_sample = config.decision_sample
        self.upstreams: dict[str, Upstream] = {}
        self._leaving: dict[str, Upstream] = {}
        self._everyone = Pool(ANY)
        self._pools: dict[str, Pool] = {}
        self._known: frozenset[str] | None = None
        self._balancers: dict[str, Balancer] = {}
        self._hedges: dict[tuple[str, str], HedgePolicy] = {}
        self.hedge_budget = HedgeBudget(ratio=config.hedge_ratio)
        # Requests whose hedge came due while the budget was short, oldest first; those on a
        # suspect replica that found no token at all wait apart, and go first.
        self._hedge_queue: deque[Exchange] = deque()
        self._suspect_queue: deque[Exchange] = deque()
        self.late_hedges = 0
        # Hedges sent at their delay while rationed, because the replica was suspect.
        self.suspect_hedges = 0
        # A dead worker fails every request in flight to it at once: the burst allowance is
        # room for those (and the connects that fail before it is ejected) to be retried.
        # It starts full: a router that has just started (or restarted) has earned nothing yet,
        # and its first minutes are when workers are most likely to be restarting too.
        # As large as one backend's in-flight limit: a worker killed while full fails that
        # many requests at once, each of which a retry could save.
        burst = max(20.0, float(config.max_in_flight))
        self.retry_budget = RetryBudget(ratio=config.retry_ratio, cap=burst, initial=burst)
        self.detector = OutlierDetector(
            consecutive_failures=config.eject_after_failures,
            # (An infinite factor: no latency is ever that far above the median.)
            latency_factor=config.eject_latency_factor or math.inf,
            overtaken_share=config.eject_overtaken_share or math.inf,
            base_ejection_s=config.eject_base_s,
            slow_base_ejection_s=config.eject_slow_base_s,
            max_ejection_s=max(120.0, config.eject_base_s, config.eject_slow_base_s),
        )
        self.health = ActiveHealth()
        self.metrics = RouterMetrics(lambda: [u.backend for u in self.upstreams.values()])
        self._health_round = 0
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()

    # --- membership -----------------------------------------------------------------------

    def set_members(self, urls: Iterable[str], *, healthy: bool = False) -> None:
        """Make the backends exactly these URLs. New ones start out of service until their
        first readiness check passes (unless ``healthy``); ones that left get no new requests
        and are closed once what they have in flight is done."""
        wanted = list(dict.fromkeys(urls))
        for url in wanted:
            if url in self.upstreams:
                continue
            host, port = parse_backend(url)
            backend = Backend(url, url, max_in_flight=self.config.max_in_flight, healthy=healthy)
            pool = self._connect(
                host, port, max_connections=self.config.max_connections, loop=self.loop
            )
            self.upstreams[url] = Upstream(backend, pool)
            self._everyone.add(backend)
            self._leaving.pop(url, None)
            log.info("backend %s joined", url)
        for url in [u for u in self.upstreams if u not in set(wanted)]:
            upstream = self.upstreams.pop(url)
            upstream.leaving = True
            self._everyone.remove(url)
            self._leaving[url] = upstream
            log.info("backend %s left: draining %d in flight", url, upstream.backend.in_flight)
            self.settle(upstream)
        self._pools.clear()
        self._known = None

    def settle(self, upstream: Upstream) -> None:
        """Close a departed backend's connections once nothing is in flight to it."""
        if (
            upstream.leaving
            and upstream.backend.in_flight == 0
            and self._leaving.pop(upstream.backend.id, None) is not None
        ):
            task = self.loop.create_task(upstream.pool.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @property
    def backends(self) -> list[Backend]:
        return [u.backend for u in self.upstreams.values()]

    # --- pools and policies ---------------------------------------------------------------

    def pool_for(self, model: str) -> Pool:
        pool = self._pools.get(model)
        if pool is None:
            members = [
                u.backend for u in self.upstreams.values() if u.models is None or model in u.models
            ]
            # No backend lists it: every backend, so the request gets a worker's own answer
            # (404 for an unknown model, 503 for one still loading).
            pool = Pool(model, members) if members else self._everyone
            self._pools[model] = pool
        return pool

    def known_models(self) -> frozenset[str]:
        """Every model some backend lists READY (kept until the membership or an index
        changes)."""
        known = self._known
        if known is None:
            known = self._known = frozenset().union(
                *(u.models for u in self.upstreams.values() if u.models is not None)
            )
        return known

    def balancer_for(self, model: str) -> Balancer:
        balancer = self._balancers.get(model)
        if balancer is None:
            balancer = make_balancer(
                self.config.policy_of(model), rng=self.rng, epsilon=self.config.epsilon
            )
            self._balancers[model] = balancer
        return balancer

    def wants_key(self, model: str) -> bool:
        return isinstance(self.balancer_for(model), BoundedLoadHash)

    def hedge_policy(self, model: str, cost: str) -> HedgePolicy:
        policy = self._hedges.get((model, cost))
        if policy is None:
            policy = HedgePolicy(
                quantile=self.config.hedge_quantile,
                min_delay_s=self.config.hedge_min_delay_s,
                min_samples=self.config.hedge_min_samples,
                budget=self.hedge_budget,
            )
            self._hedges[(model, cost)] = policy
        return policy

    def hedge_policies(self) -> dict[tuple[str, str], HedgePolicy]:
        """Every (model, cost class) hedged so far, and its policy."""
        return dict(self._hedges)

    @property
    def hedges_waiting(self) -> int:
        """Requests waiting for a hedge token now (the queue also holds ones answered since,
        dropped as the queue is next served)."""
        now = self.loop.time()
        waiting = itertools.chain(self._suspect_queue, self._hedge_queue)
        return sum(1 for e in waiting if e.awaits_hedge(now))

    def defer_hedge(
        self, exchange: Exchange, overdue_s: float | None, *, suspect: bool = False
    ) -> None:
        """``exchange``'s hedge came due with the budget short: queue it for a token, and
        serve the queue again once it has waited ``overdue_s`` (with no new requests, no
        token would be handed out otherwise). A request on a ``suspect`` replica found no
        token at all: it takes the next one, before the requests of healthy replicas, without
        waiting to be overdue (hedging.py)."""
        queue = self._suspect_queue if suspect else self._hedge_queue
        if len(queue) >= _HEDGE_QUEUE:
            now = self.loop.time()
            waiting = [e for e in queue if e.awaits_hedge(now)]
            queue.clear()
            queue.extend(waiting)
            if len(queue) >= _HEDGE_QUEUE:
                return  # (counted as refused already)
        queue.append(exchange)
        if overdue_s is not None and not suspect:
            self.loop.call_at(exchange.started + overdue_s, self._release_hedges_now)

    def _release_hedges_now(self) -> None:
        if not self._closed:
            self.release_hedges(self.loop.time())

    def release_hedges(self, now: float) -> None:
        """Hand the tokens there are to the requests that have waited longest for one (as
        far as the rationing lets them: hedging.py). Called as tokens are earned."""
        budget = self.hedge_budget
        suspects = self._suspect_queue
        while suspects:
            head = suspects[0]
            if not head.awaits_hedge(now):
                suspects.popleft()
            elif budget.ready and budget.try_spend():
                suspects.popleft()
                head.send_hedge(late=True)
            else:
                return  # no token: none for the queue below either
        queue = self._hedge_queue
        while queue:
            head = queue[0]
            if not head.awaits_hedge(now):
                queue.popleft()  # answered meanwhile
            elif head.may_hedge_late(now) and budget.try_spend():
                queue.popleft()
                head.send_hedge(late=True)
            else:
                return

    # --- requests -------------------------------------------------------------------------

    def dispatch(
        self,
        *,
        model: str,
        frame: Framer,
        on_done: Callable[[Outcome], None],
        key: str | None = None,
        cost: str = "s",
        deadline_s: float | None = None,
        idempotent: bool = False,
        hedge: bool = False,
    ) -> Exchange:
        """Send one request (``frame(remaining_s)`` gives its bytes) to a replica of
        ``model`` (or of any backend for `ANY`); ``on_done`` gets the `Outcome`, unless the
        exchange is cancelled first. ``deadline_s``: the caller's own budget, propagated.
        ``idempotent`` requests may be retried after a lost connection; ``hedge`` ones (an
        inference: idempotent too) may also be hedged, when the router hedges at all."""
        pool = self.pool_for(model) if model != ANY else self._everyone
        hedge = hedge and self.config.hedge and model != ANY
        idempotent = idempotent or hedge
        policy = self.hedge_policy(model, cost) if hedge else None
        budget = deadline_s if deadline_s is not None else self.config.request_timeout_s
        exchange = Exchange(
            self,
            model,
            pool,
            self.balancer_for(model),
            key,
            policy,
            frame,
            self.loop.time() + budget,
            deadline_s is not None,
            idempotent,
            on_done,
        )
        exchange.start()
        return exchange

    async def request(
        self,
        model: str,
        frame: Framer,
        *,
        key: str | None = None,
        cost: str = "s",
        deadline_s: float | None = None,
        idempotent: bool = False,
        hedge: bool = False,
    ) -> Outcome:
        """`dispatch` as a coroutine; cancelling it withdraws the request's copies."""
        future: asyncio.Future[Outcome] = self.loop.create_future()

        def done(outcome: Outcome) -> None:
            if not future.done():
                future.set_result(outcome)

        exchange = self.dispatch(
            model=model,
            frame=frame,
            on_done=done,
            key=key,
            cost=cost,
            deadline_s=deadline_s,
            idempotent=idempotent,
            hedge=hedge,
        )
        try:
            return await future
        except asyncio.CancelledError:
            exchange.cancel()
            raise

    def observe_outcome(self, pool: Pool, upstream: Upstream, now: float) -> None:
        ejection = self.detector.observe(pool, upstream.backend, now)
        if ejection is not None:
            self.metrics.ejections.inc(ejection.backend_id, ejection.reason)
            log.warning(
                "ejected %s for %.1f s (%s)",
                ejection.backend_id,
                ejection.backoff_s,
                ejection.reason,
            )
        self.settle(upstream)

    def log_decision(self, exchange: Exchange, chosen: Backend, kind: str, now: float) -> None:
        """One sampled routing decision, with what it was made on."""
        record: dict[str, object] = {
            "model": exchange.model,
            "policy": self.config.policy_of(exchange.model),
            "kind": kind,
            "chosen": chosen.id,
            "excluded": [b.id for b in exchange.tried],
            "replicas": {
                b.id: {
                    "in_flight": b.in_flight,
                    "ewma_ms": None if b.latency_s is None else round(b.latency_s * 1e3, 3),
                    "available": b.is_available(now),
                }
                for b in exchange.pool
            },
        }
        balancer = exchange.balancer
        if isinstance(balancer, BoundedLoadHash) and exchange.key is not None:
            home = next(iter(balancer.order(exchange.pool, exchange.key)), None)
            record["key"] = exchange.key[:16]
            record["bound"] = balancer.bound(exchange.pool, now)
            record["home"] = None if home is None else home.id
            record["spilled"] = home is not chosen
        decisions.info("%s", orjson.dumps(record).decode())

    # --- health ---------------------------------------------------------------------------

    async def check_all(self) -> None:
        """One round of readiness checks (and, every few rounds, model indexes)."""
        index = self._health_round % _INDEX_EVERY == 0
        self._health_round += 1
        upstreams = list(self.upstreams.values())
        await asyncio.gather(*(self._check(u, index) for u in upstreams))
        now = self.loop.time()
        for backend in self.detector.readmit(self._everyone, now):
            log.info("re-admitted %s", backend.id)

    async def run_health(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all()

    async def _check(self, upstream: Upstream, index: bool) -> None:
        timeout = max(0.2, self.config.health_interval_s)
        frame = http1.frame_request("GET", "/v2/health/ready", upstream.pool.origin)
        try:
            reply = await upstream.pool.request(frame, timeout)
            ready = reply.status == 200
        except UpstreamError:
            ready = False
        backend = upstream.backend
        if self.health.record(backend, ready):
            log.info("backend %s is %s", backend.id, "ready" if ready else "not ready")
            index = index or ready
            if ready:
                # Back (a restarted worker, say): what was known of its latency is old news.
                backend.reset_stats()
        if index and ready:
            await self._read_index(upstream, timeout)

    async def _read_index(self, upstream: Upstream, timeout_s: float) -> None:
        headers = []
        if self.config.admin_token:
            headers.append(("authorization", f"Bearer {self.config.admin_token}"))
        frame = http1.frame_request(
            "POST", "/v2/repository/index", upstream.pool.origin, b'{"ready":true}', headers
        )
        try:
            reply = await upstream.pool.request(frame, timeout_s)
            entries = orjson.loads(reply.body) if reply.status == 200 else None
        except (UpstreamError, orjson.JSONDecodeError):
            return
        if not isinstance(entries, list):
            return  # e.g. 401: no admin token given; it keeps serving every model
        models = frozenset(
            str(e["name"]) for e in entries if isinstance(e, dict) and e.get("state") == "READY"
        )
        if models != upstream.models:
            upstream.models = models
            self._pools.clear()
            self._known = None

    async def close(self) -> None:
        self._closed = True
        pools = [u.pool for u in (*self.upstreams.values(), *self._leaving.values())]
        await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)
