"""One request's life across its copies: the state machine of hedging and retries.

An `Exchange` sends its first copy to a replica chosen by the model's balancer, or sheds the
request at once (503 + Retry-After) when no replica is available. A hedged request arms a timer
at its policy's delay (the model's recent p95 for its cost class); when it fires with no reply
yet, a copy goes to another replica if the hedge budget allows, else the request waits for a
token in the dispatcher's queue (hedge_queue.py). The first reply wins and every other copy is
withdrawn (its connection closed, so the worker drops the queued work). A copy that could not
connect, whose connection died, or that a worker refused with 429 is tried once more on
another replica when attempts.py allows; when nothing is left to try the request ends in 502,
or 504 after a timeout. Each attempt's result is reported to the pool (attempts.py) and to the
outlier detector.

Everything runs on the dispatcher's event loop, as callbacks: no task per request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from tailserve.errors import UpstreamError
from tailserve.protocols.refusals import HEADER
from tailserve.router.attempt_spans import TraceParent, end_attempt, start_attempt
from tailserve.router.attempts import Result, is_timeout, may_retry, report
from tailserve.router.backends import Backend, Pool
from tailserve.router.balancing import Balancer
from tailserve.router.hedging import HedgePolicy
from tailserve.router.messages import Framer, Outcome, error_body, json_headers
from tailserve.router.upstreams import Upstream
from tailserve.transport.base import Ticket
from tailserve.transport.http1 import Response

if TYPE_CHECKING:
    from tailserve.router.dispatch import Dispatcher

REFUSAL = HEADER.encode()


class Attempt:
    """One copy of a request, sent to one replica: ``kind`` is first, hedge or retry."""

    __slots__ = ("exchange", "kind", "sent_at", "span", "ticket", "upstream")

    def __init__(self, exchange: Exchange, upstream: Upstream, kind: str, sent_at: float):
        self.exchange = exchange
        self.upstream = upstream
        self.kind = kind
        self.sent_at = sent_at
        self.ticket: Ticket | None = None
        self.span: Any = None  # its client span, when the request is traced

    def on_result(self, result: Response | UpstreamError) -> None:
        self.exchange.on_result(self, result)


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
        "trace",
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
        trace: TraceParent | None = None,
    ) -> None:
        self._d = dispatcher
        self.trace = trace
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
        self.live: list[Attempt] = []
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
        attempt = Attempt(self, upstream, kind, now)
        self.live.append(attempt)
        self.pool.start(backend)
        if d.decision_sample and d.rng.random() < d.decision_sample:
            d.log_decision(self, backend, kind, now)
        data = self.frame(remaining if self.has_deadline else None)
        if self.trace is not None:
            attempt.span, data = start_attempt(self.trace, self.model, kind, backend.id, data)
        attempt.ticket = upstream.pool.submit(data, attempt.on_result, remaining)
        return True

    # --- hedging --------------------------------------------------------------------------

    def _hedge(self) -> None:
        self._timer = None
        d = self._d
        if self.done or not self.live or self._policy is None:
            return
        # Only a rationed budget asks whether the replica is suspect.
        rationed = not self._policy.budget.plenty
        suspect = rationed and self.pool.suspect(self.live[0].upstream.backend)
        if not self._policy.try_hedge(suspect=suspect):
            d.note_hedge(self.model, "refused")
            # It waits for a token (hedging.py: rationing); tokens come with new requests,
            # and the queue is looked at again when this one turns overdue.
            d.defer_hedge(self, self._policy.overdue_s(d.loop.time()), suspect=suspect)
            return
        if suspect:
            d.note_hedge(self.model, "suspect")
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
            d.note_hedge(self.model, "sent")
            if late:
                d.note_hedge(self.model, "late")
        else:
            # No other replica could take it: give the token back, nothing was sent.
            self._policy.budget.refund()

    # --- results --------------------------------------------------------------------------

    def on_result(self, attempt: Attempt, result: Response | UpstreamError) -> None:
        """``attempt``'s reply, or why none came."""
        d = self._d
        now = d.loop.time()
        with contextlib.suppress(ValueError):
            self.live.remove(attempt)
        backend = attempt.upstream.backend
        latency = now - attempt.sent_at
        code: Result = result.status if isinstance(result, Response) else result
        if attempt.span is not None:
            status = result.status if isinstance(result, Response) else None
            won = not self.done and status is not None and status != 429
            end_attempt(attempt.span, "won" if won else "late" if self.done else "failed", status)
        label = report(self.pool, backend, code, latency, now, has_deadline=self.has_deadline)
        d.metrics.attempts.inc(backend.id, attempt.kind, label)
        if isinstance(code, int) and code < 400 and self._policy is not None:
            self._policy.observe(latency, now)
        d.observe_outcome(self.pool, attempt.upstream, now)
        if self.done:
            return
        if isinstance(result, Response) and result.status != 429:
            self._win(attempt, result)
            return
        if self.live:
            return  # another copy is still out: it may yet answer
        if self._retry(code, now):
            return
        if isinstance(result, Response):  # the worker's 429, passed on
            self._win(attempt, result)
            return
        status = 504 if is_timeout(result) else 502
        self._finish(
            Outcome(
                status,
                json_headers(),
                error_body(result.message),
                attempts=len(self.tried),
                reason="upstream",
            )
        )

    def _retry(self, result: Result, now: float) -> bool:
        """Send the request once more, to another replica, if it may go again."""
        d = self._d
        allowed = may_retry(
            result,
            idempotent=self.idempotent,
            retried=self.retried,
            remaining_s=self.deadline - d.loop.time(),
            budget=d.retry_budget,
        )
        if allowed and self._send(now, "retry"):
            self.retried = True
            d.metrics.retries.inc(self.model)
            return True
        return False

    def _win(self, attempt: Attempt, response: Response) -> None:
        if attempt.kind == "hedge":
            self._d.note_hedge(self.model, "won")
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

    def _note_overtaken(self, winner: Attempt) -> None:
        """Whether the first copy's replica was beaten by a hedge (see Pool.suspect)."""
        if winner.kind == "first":
            self.pool.overtaken(winner.upstream.backend, False)
        elif winner.kind == "hedge":
            for other in self.live:
                if other.kind == "first":
                    self.pool.overtaken(other.upstream.backend, True)

    def _withdraw(self, attempt: Attempt, why: str) -> None:
        if attempt.ticket is not None:
            attempt.ticket.cancel()
        if attempt.span is not None:
            end_attempt(attempt.span, why)
        d = self._d
        backend = attempt.upstream.backend
        lost_after = d.loop.time() - attempt.sent_at if why == "lost" else None
        self.pool.cancelled(backend, lost_after)
        d.metrics.attempts.inc(backend.id, attempt.kind, why)
        d.upstreams.settle(attempt.upstream)

    def _shed(self, now: float) -> None:
        serving = self.pool.in_service(now)
        reason = "saturated" if serving else "no_replica"
        what = (
            f"every replica of {self.model!r} is at its in-flight limit"
            if serving
            else f"no replica of {self.model!r} is in service"
        )
        self._d.metrics.shed.inc(self.model, reason)
        # A refusal says why, as the workers' do (docs/observability.md).
        headers = [*json_headers(), (b"retry-after", b"1"), (REFUSAL, reason.encode())]
        body = orjson.dumps({"error": what, "reason": reason})
        self._finish(Outcome(503, headers, body, reason=reason))

    def _finish(self, outcome: Outcome) -> None:
        self.done = True
        self._stop_timer()
        self.on_done(outcome)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
