"""The dispatcher: sending requests to replicas, the part of the router that the proxy, the gRPC
front and the in-process client share.

A `Dispatcher` owns the registry of backends (upstreams.py: one connection pool to each, and
the pool of replicas per model), each model's balancer and hedge policies, the hedge and retry
budgets, the queue of hedges waiting for a token (hedge_queue.py), the outlier detector and the
health polling (polling.py). `dispatch` takes one request, already framed for the wire
(messages.py), and answers through a callback; on the way (exchange.py) it:

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
   with 429, tries once more on another replica within the retry budget (attempts.py);
5. reports every attempt to the backend's state (in flight, EWMA latency, failures) and to the
   outlier detector, which ejects a replica that keeps failing or is far slower than the rest.

Membership comes from `set_members` (command line, a watched file, DNS: see membership.py).
Active readiness checks and each backend's model index are refreshed by `run_health`.
Everything runs on one event loop; the per-request path is callbacks, not tasks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Iterable

import orjson

from tailserve.router.attempt_spans import TraceParent
from tailserve.router.backends import Backend, Pool
from tailserve.router.balancing import Balancer, BoundedLoadHash, make_balancer
from tailserve.router.config import RouterConfig
from tailserve.router.exchange import Exchange
from tailserve.router.health import OutlierDetector
from tailserve.router.hedge_queue import HedgeQueue
from tailserve.router.hedging import HedgeBudget, HedgePolicy, RetryBudget
from tailserve.router.messages import Framer, Outcome
from tailserve.router.polling import HealthPoller
from tailserve.router.router_metrics import RouterMetrics
from tailserve.router.upstreams import ANY, Upstream, Upstreams
from tailserve.transport import http1
from tailserve.transport.base import Connect

log = logging.getLogger(__name__)
decisions = logging.getLogger("tailserve.router.decisions")


class Dispatcher:
    """Sends requests to the replicas of their models, hedging and retrying within budgets."""

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
        self.rng = rng or random.Random()
        self.decision_sample = config.decision_sample
        self.upstreams = Upstreams(config, connect=connect, loop=self.loop)
        self._balancers: dict[str, Balancer] = {}
        self._hedges: dict[tuple[str, str], HedgePolicy] = {}
        self.hedge_budget = HedgeBudget(ratio=config.hedge_ratio)
        self._hedge_queue = HedgeQueue(self.hedge_budget)
        self._late_hedges = 0
        self._suspect_hedges = 0
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
        self.metrics = RouterMetrics(lambda: self.upstreams.backends)
        self._poller = HealthPoller(config, self.upstreams, self.detector, loop=self.loop)
        self._closed = False

    # --- membership -----------------------------------------------------------------------

    def set_members(self, urls: Iterable[str], *, healthy: bool = False) -> None:
        """Make the backends exactly these URLs (upstreams.py: `Upstreams.set_members`)."""
        self.upstreams.set_members(urls, healthy=healthy)

    @property
    def backends(self) -> list[Backend]:
        return self.upstreams.backends

    # --- pools and policies ---------------------------------------------------------------

    def pool_for(self, model: str) -> Pool:
        return self.upstreams.pool_for(model)

    def known_models(self) -> frozenset[str]:
        """Every model some backend lists READY."""
        return self.upstreams.known_models()

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

    # --- hedges waiting for a token -------------------------------------------------------

    @property
    def hedges_waiting(self) -> int:
        """Requests waiting for a hedge token now."""
        return self._hedge_queue.waiting(self.loop.time())

    @property
    def late_hedges(self) -> int:
        """Hedges sent once a token came, after waiting for one."""
        return self._late_hedges

    @property
    def suspect_hedges(self) -> int:
        """Hedges sent at their delay while rationed, because the replica was suspect."""
        return self._suspect_hedges

    def note_hedge(self, model: str, event: str) -> None:
        """Count a hedge of ``model`` that was refused, sent, sent late, sent for a suspect
        replica, or won."""
        self.metrics.hedges.inc(model, event)
        if event == "late":
            self._late_hedges += 1
        elif event == "suspect":
            self._suspect_hedges += 1

    def defer_hedge(
        self, exchange: Exchange, overdue_s: float | None, *, suspect: bool = False
    ) -> None:
        """``exchange``'s hedge came due with the budget short: queue it for a token, and
        serve the queue again once it has waited ``overdue_s`` (with no new requests, no
        token would be handed out otherwise). A request on a ``suspect`` replica found no
        token at all: it takes the next one, before the requests of healthy replicas, without
        waiting to be overdue (hedge_queue.py)."""
        queued = self._hedge_queue.defer(exchange, self.loop.time(), suspect=suspect)
        if queued and overdue_s is not None and not suspect:
            self.loop.call_at(exchange.started + overdue_s, self._release_hedges_now)

    def _release_hedges_now(self) -> None:
        if not self._closed:
            self.release_hedges(self.loop.time())

    def release_hedges(self, now: float) -> None:
        """Hand the tokens there are to the requests that have waited longest for one (as
        far as the rationing lets them: hedging.py). Called as tokens are earned."""
        self._hedge_queue.release(now)

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
        trace: TraceParent | None = None,
    ) -> Exchange:
        """Send one request (``frame(remaining_s)`` gives its bytes) to a replica of
        ``model`` (or of any backend for `ANY`); ``on_done`` gets the `Outcome`, unless the
        exchange is cancelled first. ``deadline_s``: the caller's own budget, propagated.
        ``idempotent`` requests may be retried after a lost connection; ``hedge`` ones (an
        inference: idempotent too) may also be hedged, when the router hedges at all."""
        pool = self.upstreams.pool_for(model)
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
            trace,
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
        trace: TraceParent | None = None,
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
            trace=trace,
        )
        try:
            return await future
        except asyncio.CancelledError:
            exchange.cancel()
            raise

    def observe_outcome(self, pool: Pool, upstream: Upstream, now: float) -> None:
        """After an attempt: eject its backend if it is now an outlier, and close the
        backend's connections if it has left and this was its last request."""
        ejection = self.detector.observe(pool, upstream.backend, now)
        if ejection is not None:
            self.metrics.ejections.inc(ejection.backend_id, ejection.reason)
            log.warning(
                "ejected %s for %.1f s (%s)",
                ejection.backend_id,
                ejection.backoff_s,
                ejection.reason,
            )
        self.upstreams.settle(upstream)

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

    # --- health and shutdown --------------------------------------------------------------

    async def check_all(self) -> None:
        """One round of readiness checks (and, every few rounds, model indexes)."""
        await self._poller.check_all()

    async def run_health(self) -> None:
        """Poll the backends every ``health_interval_s`` until `close`."""
        await self._poller.run()

    async def close(self) -> None:
        self._closed = True
        self._poller.stop()
        await self.upstreams.close()
